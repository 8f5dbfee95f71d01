# SPDX-License-Identifier: Apache-2.0
"""Reference attention math of HySparse and HySparse2 (SPEC §3), written for obviousness.

Every op works on dense per-sequence tensors and materialises full score
matrices; it is the ground truth for the vLLM models and the Triton kernels,
not a fast path. Shapes use:
    B batch, Tq queries, Tk keys, H query heads, G KV heads, D the q/k head dim,
    Dv the value head dim (SPEC §2.6: `v_head_dim`, D unless set; outputs are
    Dv wide), NB = ceil(Tk / block_size) key blocks.
By default queries are the *last* Tq positions of the Tk keys, so query i sits
at absolute position `Tk - Tq + i` (prefill: Tq == Tk; decode: Tq == 1); ops
that take `positions` (`[Tq]`, ascending) accept any subset of rows instead
(HySparse2 early exit runs the cross-decoder on the logits rows only).
Math runs in float32; outputs come back in the input dtype.
"""

import torch

NEG_INF = float("-inf")


def query_positions(num_queries: int, num_keys: int, device=None, positions=None) -> torch.Tensor:
    """Absolute positions `[Tq]` of the queries: `positions`, or the last Tq of Tk."""
    if positions is not None:
        return positions.to(device)
    if num_queries > num_keys:
        raise ValueError(f"{num_queries} queries cannot follow only {num_keys} keys")
    return torch.arange(num_keys - num_queries, num_keys, device=device)


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[B, Tk, G, D]` -> `[B, Tk, H, D]`: head h reads KV group h // (H / G)."""
    return x.repeat_interleave(num_heads // x.shape[2], dim=2)


def attention_logits(q: torch.Tensor, k: torch.Tensor, scale: float, positions=None) -> torch.Tensor:
    """Causal logits `z[b, h, i, j] = scale * q_h[i] . k_g(h)[j]`, -inf where key j > query position.

    Args:
        q: `[B, Tq, H, D]`.
        k: `[B, Tk, G, D]`.
    Returns:
        `[B, H, Tq, Tk]` float32.
    """
    k = expand_kv_heads(k, q.shape[2])
    z = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * scale
    t = query_positions(q.shape[1], k.shape[1], q.device, positions)
    j = torch.arange(k.shape[1], device=q.device)
    return z.masked_fill(j[None, :] > t[:, None], NEG_INF)


def window_mask(num_queries: int, num_keys: int, window: int, device=None, positions=None) -> torch.Tensor:
    """`[Tq, Tk]` bool: key j is inside query t's window `[t - window + 1, t]`."""
    t = query_positions(num_queries, num_keys, device, positions)
    j = torch.arange(num_keys, device=device)
    return (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - window)


def sink_softmax(z: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim with an optional per-head sink logit in the denominator.

    `p_j = exp(z_j) / (exp(s_h) + sum_j' exp(z_j'))`; the sink has no value and
    is not scaled. Rows whose keys are all masked (-inf) get zeros.

    Args:
        z: `[B, H, Tq, Tk]` float32, masked keys at -inf.
        sink: `[H]` or None (no sink).
    Returns:
        `[B, H, Tq, Tk]` float32.
    """
    if sink is not None:
        s = sink.float().view(1, -1, 1, 1).expand(*z.shape[:-1], 1)
        z = torch.cat([z, s], dim=-1)
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(z - m)
    p = e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return p[..., :-1] if sink is not None else p


def weighted_values(p: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`p [B, H, Tq, Tk]` times `v [B, Tk, G, Dv]` -> `[B, Tq, H, Dv]` in `dtype`."""
    v = expand_kv_heads(v, p.shape[1]).float()
    return torch.einsum("bhij,bjhd->bihd", p, v).to(dtype)


def dense_attention(q, k, v, scale, sink=None, window=None, positions=None):
    """Causal attention, optionally windowed and with a sink.

    Args:
        q: `[B, Tq, H, D]`; k: `[B, Tk, G, D]`; v: `[B, Tk, G, Dv]`.
        sink: `[H]` or None. window: keys `[t - window + 1, t]` when set.
    Returns:
        `[B, Tq, H, Dv]`.
    """
    z = attention_logits(q, k, scale, positions)
    if window is not None:
        keep = window_mask(q.shape[1], k.shape[1], window, q.device, positions)
        z = z.masked_fill(~keep, NEG_INF)
    return weighted_values(sink_softmax(z, sink), v, q.dtype)


def oracle_block_scores(z: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Eq. 3 block scores with the group-wise max over the heads of each KV group.

    `S_h[t, b] = exp(u[t, b] - m[t]) / l[t]` with `u` the max logit of block b
    (keys <= t), `m` the row max, `l` the row's softmax denominator; then
    `R[g, t, b] = max_{h in g} S_h[t, b]`. Blocks with no visible key score 0.

    Args:
        z: `[B, H, Tq, Tk]` causal logits (see `attention_logits`).
    Returns:
        `[B, G, Tq, NB]` float32.
    """
    b, h, tq, tk = z.shape
    nb = -(-tk // block_size)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    padded = torch.nn.functional.pad(z, (0, nb * block_size - tk), value=NEG_INF)
    u = padded.view(b, h, tq, nb, block_size).amax(dim=-1)
    # exp(u - m) / l  ==  exp(u - lse), since lse = m + log(l).
    s = torch.exp(u - lse)
    return s.view(b, num_kv_heads, h // num_kv_heads, tq, nb).amax(dim=2)


def select_topk(scores: torch.Tensor, candidate: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k candidate ids per row: ties go to the smaller id; sorted ascending; -1 padded.

    Args:
        scores: `[..., N]` float.
        candidate: `[..., N]` bool (broadcastable); non-candidates are never chosen.
        k: how many to keep.
    Returns:
        `[..., k]` int64. A row with fewer than k candidates returns all of them.
    """
    candidate = candidate.expand_as(scores)
    n = scores.shape[-1]
    keyed = scores.float().masked_fill(~candidate, NEG_INF)
    # A stable descending sort keeps equal scores in id order, so ties go to
    # the smaller id; non-candidates sink to the end behind real zeros.
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.gather(candidate, -1, order)
    ids = torch.where(chosen, order, torch.full_like(order, n))
    ids = torch.sort(ids, dim=-1).values
    ids = ids.masked_fill(ids == n, -1)
    if ids.shape[-1] < k:
        ids = torch.nn.functional.pad(ids, (0, k - ids.shape[-1]), value=-1)
    return ids


def visible_blocks(num_queries: int, num_keys: int, block_size: int, device=None) -> torch.Tensor:
    """`[Tq, NB]` bool: block b has a key at or before the query (b * B <= t)."""
    t = query_positions(num_queries, num_keys, device)
    nb = -(-num_keys // block_size)
    return torch.arange(nb, device=device)[None, :] * block_size <= t[:, None]


def oracle_block_topk(q, k, scale, block_size, topk):
    """Oracle block indices of a HySparse full layer (SPEC §3.1).

    Args:
        q: `[B, Tq, H, D]`; k: `[B, Tk, G, D]`.
    Returns:
        `[B, Tq, G, topk]` int64 block ids, sorted ascending, -1 padded.
    """
    z = attention_logits(q, k, scale)
    r = oracle_block_scores(z, block_size, k.shape[2])
    vis = visible_blocks(q.shape[1], k.shape[1], block_size, q.device)
    return select_topk(r, vis[None, None], topk).transpose(1, 2)


def full_attention_with_oracle(q, k, v, scale, block_size, topk):
    """HySparse full layer: causal attention plus its oracle block indices.

    Returns:
        (`[B, Tq, H, Dv]` output, `[B, Tq, G, topk]` block ids).
    """
    return dense_attention(q, k, v, scale), oracle_block_topk(q, k, scale, block_size, topk)


def ids_to_mask(ids: torch.Tensor, size: int) -> torch.Tensor:
    """`[..., k]` ids with -1 padding -> `[..., size]` bool membership."""
    mask = torch.zeros(*ids.shape[:-1], size + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(-1, ids.masked_fill(ids < 0, size), True)
    return mask[..., :size]


def block_sparse_attention(q, k, v, block_ids, block_size, scale, sink=None, positions=None):
    """Global branch of a HySparse sparse layer: keys in the selected blocks, j <= t.

    The block holding the query is causal-masked like any other key.

    Args:
        q: `[B, Tq, H, D]`; k: `[B, Tk, G, D]`, v: `[B, Tk, G, Dv]` (the oracle full layer's KV).
        block_ids: `[B, Tq, G, K]` int, -1 padded.
        sink: `[H]` or None.
    Returns:
        `[B, Tq, H, Dv]`.
    """
    h, tk = q.shape[2], k.shape[1]
    nb = -(-tk // block_size)
    blocks = ids_to_mask(block_ids, nb)  # [B, Tq, G, NB]
    keys = blocks.repeat_interleave(block_size, dim=-1)[..., :tk]  # [B, Tq, G, Tk]
    keys = keys.repeat_interleave(h // k.shape[2], dim=2).permute(0, 2, 1, 3)  # [B, H, Tq, Tk]
    z = attention_logits(q, k, scale, positions).masked_fill(~keys, NEG_INF)
    return weighted_values(sink_softmax(z, sink), v, q.dtype)


def sparse_layer_attention(
    q, k_full, v_full, block_ids, k_swa, v_swa, gate_sparse, gate_swa, *,
    block_size, swa_window, scale, sink_sparse=None, sink_swa=None,
):
    """HySparse sparse layer before `o_proj` (SPEC §3.2).

    `o = sigmoid(gate_sparse) * o_sa + sigmoid(gate_swa) * o_swa`: two separate
    sink softmaxes, the global one over the selected blocks of the full layer's
    KV and the local one over the layer's own window KV. With `k_swa=None` the
    SWA branch is switched off and its gate weights the global output instead.

    Args:
        q: `[B, Tq, H, D]`.
        k_full, k_swa: `[B, Tk, G, D]`; v_full, v_swa: `[B, Tk, G, Dv]` (k_swa None: no SWA branch).
        block_ids: `[B, Tq, G, K]`.
        gate_sparse, gate_swa: gate logits `[B, Tq, H, Dv]` (elementwise) or `[B, Tq, H, 1]` (headwise).
    Returns:
        `[B, Tq, H, Dv]`.
    """
    o_sa = block_sparse_attention(q, k_full, v_full, block_ids, block_size, scale, sink_sparse)
    if k_swa is None:
        o_swa = o_sa
    else:
        o_swa = dense_attention(q, k_swa, v_swa, scale, sink_swa, window=swa_window)
    out = torch.sigmoid(gate_sparse.float()) * o_sa.float() + torch.sigmoid(gate_swa.float()) * o_swa.float()
    return out.to(q.dtype)


def reduce_heads(p: torch.Tensor, num_kv_heads: int, reduce: str) -> torch.Tensor:
    """`[B, H, Tq, Tk]` probabilities -> `[B, G, Tq, Tk]` by max or sum over each group."""
    b, h, tq, tk = p.shape
    grouped = p.view(b, num_kv_heads, h // num_kv_heads, tq, tk)
    if reduce == "max":
        return grouped.amax(dim=2)
    if reduce == "sum":
        return grouped.sum(dim=2)
    raise ValueError(f"score_head_reduce: must be 'max' or 'sum' (got {reduce!r})")


def token_topk(q, k, scale, topk_tokens, recent_window, reduce="max", forced_window=True, positions=None):
    """HySparse2 token selection `S_t = W_t ∪ top-k_g(R outside W_t)` (SPEC §3.3).

    `R` reduces the exact per-head probabilities of each KV group. Without
    `forced_window` the window is not forced: the top `topk_tokens +
    recent_window` keys by `R` are taken instead (same budget).

    Args:
        q: `[B, Tq, H, D]`; k: `[B, Tk, G, D]`.
    Returns:
        `[B, Tq, G, topk_tokens + recent_window]` int64 positions, ascending, -1 padded.
    """
    tq, tk = q.shape[1], k.shape[1]
    p = sink_softmax(attention_logits(q, k, scale, positions), None)
    r = reduce_heads(p, k.shape[2], reduce)  # [B, G, Tq, Tk]
    t = query_positions(tq, tk, q.device, positions)
    j = torch.arange(tk, device=q.device)
    causal = j[None, :] <= t[:, None]
    budget = topk_tokens + recent_window
    if not forced_window:
        return select_topk(r, causal[None, None], budget).transpose(1, 2)
    in_window = window_mask(tq, tk, recent_window, q.device, positions)
    picked = select_topk(r, (causal & ~in_window)[None, None], topk_tokens)  # [B, G, Tq, k]
    chosen = ids_to_mask(picked, tk) | in_window[None, None]
    ids = torch.where(chosen, j, tk)
    ids = torch.sort(ids, dim=-1).values[..., :budget]
    ids = ids.masked_fill(ids == tk, -1)
    if ids.shape[-1] < budget:
        ids = torch.nn.functional.pad(ids, (0, budget - ids.shape[-1]), value=-1)
    return ids.transpose(1, 2)


def token_sparse_attention(q, k, v, token_ids, scale, sink=None, positions=None):
    """HySparse2 cross sparse layer: one sink softmax over the selected positions.

    Args:
        q: `[B, Tq, H, D]`; k: `[B, Tk, G, D]`, v: `[B, Tk, G, Dv]` (the cross full layer's cache).
        token_ids: `[B, Tq, G, S]` int, -1 padded (see `token_topk`).
        sink: `[H]` or None.
    Returns:
        `[B, Tq, H, Dv]`.
    """
    h, tk = q.shape[2], k.shape[1]
    keys = ids_to_mask(token_ids, tk)  # [B, Tq, G, Tk]
    keys = keys.repeat_interleave(h // k.shape[2], dim=2).permute(0, 2, 1, 3)
    z = attention_logits(q, k, scale, positions).masked_fill(~keys, NEG_INF)
    return weighted_values(sink_softmax(z, sink), v, q.dtype)
