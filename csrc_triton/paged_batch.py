# SPDX-License-Identifier: Apache-2.0
"""The batch plan and paged gathers shared by the batched PyTorch twins (`*/batched.py`).

A vLLM step mixes decode rows (requests with one query row) and prefill runs
(requests with several). The batched twins treat all decode rows together, in
a few tensor ops, and each prefill run with matrix products over its own
keys. Which rows are which is host knowledge: `make_plan` computes it once per
step (vLLM's metadata builder calls it), so the attention forward needs no
host value at all. Called without a plan, a twin builds one itself (one host
read of `query_start_loc` and `seq_lens`; fine for tests, not for serving).
"""

from dataclasses import dataclass

import numpy as np
import torch

from csrc_triton import cpu_ext
from csrc_triton.paged_args import check_paged_batch

# Floats one gathered or scored tensor may hold; bounds the rows handled at once.
ELEMENT_BUDGET = 1 << 24


@dataclass(frozen=True)
class PrefillRun:
    """Rows `[start, end)` of request `req`: the last `end - start` of its `seq_len` positions."""

    req: int
    start: int
    end: int
    seq_len: int

    @property
    def first_pos(self) -> int:
        return self.seq_len - (self.end - self.start)


@dataclass
class BatchPlan:
    """Where each query row of a step sits; device tensors plus the host sizes that shape the work.

    Attributes:
        num_tokens: rows that belong to a request (`query_start_loc[-1]`, capped at the batch).
        row_pos: `[num_tokens]` int64 absolute position of every row; `row_req` `[num_tokens]` int64 its request.
        decode_rows: `[Nd]` int64 rows of the requests with a single query row.
        decode_reqs: `[Nd]` int64 their requests; `decode_lens` `[Nd]` int64 their sequence lengths.
        max_decode_len: the longest of those sequences (0 without decode rows).
        prefills: the requests with several query rows.
    """

    num_tokens: int
    row_pos: torch.Tensor
    row_req: torch.Tensor
    decode_rows: torch.Tensor
    decode_reqs: torch.Tensor
    decode_lens: torch.Tensor
    max_decode_len: int
    prefills: tuple[PrefillRun, ...]

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.shape[0]


def make_plan(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, num_tokens: int,
              device: torch.device) -> BatchPlan:
    """Host tensors `[R + 1]` and `[R]` of a step -> its plan, with device tensors on `device`.

    In numpy, whole-batch: a loop of tensor ops per request cost 0.15 ms a step for eight decode rows.
    """
    starts = query_start_loc_cpu.numpy().astype(np.int64)
    lens = seq_lens_cpu.numpy().astype(np.int64)
    num_tokens = min(num_tokens, int(starts[-1])) if len(starts) else 0
    begin = starts[:-1]
    rows = np.maximum(np.minimum(starts[1:], num_tokens) - begin, 0)  # each request's rows in this step
    req = np.repeat(np.arange(len(rows)), rows)
    # a request's rows are the last of its positions: row i of request r sits at lens[r] - rows[r] + (i - its first)
    first_row = np.cumsum(rows) - rows
    pos = lens[req] - rows[req] + np.arange(len(req)) - first_row[req]
    dec = np.flatnonzero(rows == 1)
    prefills = tuple(PrefillRun(int(r), int(begin[r]), int(begin[r] + rows[r]), int(lens[r]))
                     for r in np.flatnonzero(rows > 1))

    def on_device(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device, non_blocking=True)

    return BatchPlan(
        num_tokens=num_tokens,
        row_pos=on_device(pos),
        row_req=on_device(req),
        decode_rows=on_device(begin[dec]),
        decode_reqs=on_device(dec),
        decode_lens=on_device(lens[dec]),
        max_decode_len=int(lens[dec].max()) if len(dec) else 0,
        prefills=prefills,
    )


def plan_or_make(plan: BatchPlan | None, query_start_loc, seq_lens, num_tokens: int) -> BatchPlan:
    """`plan`, or one computed from the device tensors (a host read: standalone use only)."""
    if plan is not None:
        return plan
    return make_plan(query_start_loc.cpu(), seq_lens.cpu(), num_tokens, query_start_loc.device)


def chunks(n: int, size: int):
    """`(start, end)` pairs covering `[0, n)` in steps of `size` (at least 1)."""
    size = max(1, size)
    for s in range(0, n, size):
        yield s, min(s + size, n)


def _merged(cache: torch.Tensor, end_dim: int) -> torch.Tensor | None:
    """`cache` with dims `0..end_dim` merged into one, as a view; None when its strides do not allow one."""
    try:
        return cache.view(-1, *cache.shape[end_dim + 1:])
    except RuntimeError:
        return None


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, reqs: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Positions `[0, num_keys)` of several requests: `reqs [n]` -> `[n, G, num_keys, D]` float32.

    One `index_select` of whole (page, group) slabs, already in `[n, G, pages, page]`
    order (an advanced-index gather of a strided cache view is several times slower).
    Positions past a request's own length hold whatever its pages hold: callers mask them.
    """
    num_pages, groups, page, dim = cache.shape
    pages = block_table[reqs, : -(-num_keys // page)].long()  # [n, P]
    slabs = _merged(cache, 1)  # [num_pages * G, page, D]
    if slabs is None:  # a layout whose (page, group) dims do not merge: gather, then reorder
        x = cache[pages].transpose(1, 2)
    else:
        index = pages[:, None, :] * groups + torch.arange(groups, device=cache.device)[None, :, None]
        x = slabs.index_select(0, index.flatten()).view(*index.shape, page, dim)
    x = x.reshape(reqs.shape[0], groups, -1, dim)
    return x[:, :, :num_keys].float()


def gather_request(cache: torch.Tensor, block_table_row: torch.Tensor, num_keys: int) -> torch.Tensor:
    """`[num_pages, G, page, D]` cache -> `[G, num_keys, D]` float32 for positions `[0, num_keys)` of one request."""
    reqs = torch.zeros(1, dtype=torch.long, device=cache.device)
    return gather_context(cache, block_table_row[None], reqs, num_keys)[0]


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, reqs: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """Per-row key positions `[n, G, S]` (valid, >= 0) of requests `reqs [n]` -> `[n, G, S, D]` float32."""
    num_pages, groups, page, dim = cache.shape
    pages = block_table[reqs[:, None, None], positions // page].long()
    group = torch.arange(groups, device=cache.device)[None, :, None]
    tokens = _merged(cache, 2)  # [num_pages * G * page, D]
    if tokens is None:
        return cache[pages, group, positions % page].float()
    index = (pages * groups + group) * page + positions % page
    return tokens.index_select(0, index.flatten()).view(*index.shape, dim).float()


def interleaved(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """The `[num_pages, G, page, D_k + D_v]` tensor that both views slice (vLLM's page layout), or None.

    Gathering it once moves each token's K and V as one contiguous run,
    instead of two strided half-rows. D_k and D_v may differ (SPEC §2.6).
    """
    d, dv = k_cache.shape[-1], v_cache.shape[-1]
    if (k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.stride(2) != d + dv
            or v_cache.shape[:3] != k_cache.shape[:3] or v_cache.dtype != k_cache.dtype
            or v_cache.data_ptr() != k_cache.data_ptr() + d * k_cache.element_size()):
        return None
    return torch.as_strided(k_cache, (*k_cache.shape[:3], d + dv), k_cache.stride())


def cpu_kernel_pages(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """The interleaved pages the C++ CPU kernels read, or None where they do not apply (then PyTorch runs).

    They need float32 pages of vLLM's layout on the CPU. They read V right after K in equal widths,
    so a layout with D_k != D_v (SPEC §2.6 `v_head_dim`) stays on the PyTorch path.
    """
    if k_cache.dtype != torch.float32 or k_cache.device.type != "cpu" or k_cache.shape[-1] != v_cache.shape[-1]:
        return None
    return interleaved(k_cache, v_cache)


def _gather_kv(gather, k_cache, v_cache, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values by `gather(cache, *args)`: one gather of the interleaved pages where they are, else two."""
    base = interleaved(k_cache, v_cache)
    if base is None:
        return gather(k_cache, *args), gather(v_cache, *args)
    kv = gather(base, *args)
    return kv[..., :k_cache.shape[-1]], kv[..., k_cache.shape[-1]:]


def gather_context_kv(k_cache, v_cache, block_table, reqs, num_keys):
    """`gather_context` of keys and values: `[n, G, num_keys, D]` and `[n, G, num_keys, Dv]` float32."""
    return _gather_kv(gather_context, k_cache, v_cache, block_table, reqs, num_keys)


def gather_request_kv(k_cache, v_cache, block_table_row, num_keys):
    """`gather_request` of keys and values: `[G, num_keys, D]` and `[G, num_keys, Dv]` float32."""
    return _gather_kv(gather_request, k_cache, v_cache, block_table_row, num_keys)


def gather_rows_kv(k_cache, v_cache, block_table, reqs, positions):
    """`gather_rows` of keys and values: `[n, G, S, D]` and `[n, G, S, Dv]` float32."""
    return _gather_kv(gather_rows, k_cache, v_cache, block_table, reqs, positions)


def sink_softmax(z: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim with an optional sink logit in the denominator.

    Args:
        z: `[..., S]` float32 logits, -inf where a key is not attended.
        sinks: float32 broadcastable to `z[..., 0]`, or None.
    Returns:
        `[..., S]` probabilities; a row with neither keys nor sink is all 0.
    """
    m = z.amax(dim=-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks[..., None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(z - m)
    den = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks[..., None] - m)
    return e / den.clamp_min(torch.finfo(torch.float32).tiny)


def grouped_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """GQA logits as one batched matrix product per KV group.

    Args:
        q: `[b, G, M, D]` float32 (M = rows x heads per group).
        k: `[b, G, S, D]` float32.
    Returns:
        `[b, G, M, S]` float32.
    """
    return torch.matmul(q, k.transpose(-1, -2)).mul_(scale)


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[n, H, D]` rows -> `[G, n, P, D]` float32, P = H / G heads per group (head h is in group h // P)."""
    n, num_heads, head_dim = q.shape
    return q.float().view(n, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)


def attend_positions(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     reqs: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """Sink attention of each row over its own gathered keys (the sparse roles' decode path).

    Args:
        q: `[n, H, D]` rows of requests `reqs [n]` (int64).
        positions: `[n, G, S]` int64 key positions; `valid [n, G, S]` bool marks the attended ones.
        sinks: `[G, P]` float32 sink logits, or None.
    Returns:
        `[n, H, Dv]` float32.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    positions = torch.where(valid, positions, 0)  # position 0 always holds data: no NaN from unwritten slots
    k, v = gather_rows_kv(k_cache, v_cache, block_table, reqs, positions)
    qg = q.float().view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    z = grouped_logits(qg, k, scale).masked_fill_(~valid[:, :, None, :], float("-inf"))  # [n, G, P, S]
    p = sink_softmax(z, sinks)
    return torch.matmul(p, v).view(n, num_heads, v.shape[-1])


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, scale: float,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """Sink attention of one request's rows over its keys under a per-row key mask (the sparse roles' prefill path).

    Dense products over all `S` keys: on a CPU they beat gathering each row's
    keys until the context is many times the selection. There, PyTorch's
    fused flash attention does it without materialising the logits; the sink
    rescales its output by `Σe / (Σe + e^s) = sigmoid(lse - s)`.

    Args:
        q: `[n, H, D]`; k: `[G, S, D]`, v: `[G, S, Dv]` float32 (the request's keys `[0, S)`).
        key_mask: `[n, G, S]` bool, True where row i attends key j.
        sinks: `[G, P]` float32, or None.
    Returns:
        `[n, H, Dv]` float32.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k.shape[0], v.shape[-1]
    per_group = num_heads // num_kv_heads
    if q.device.type != "cpu":
        return _attend_masked_unfused(q, k, v, key_mask, scale, sinks)
    qg = group_queries(q, num_kv_heads).transpose(1, 2)  # [G, P, n, D]
    # The CPU flash kernel wants one head size: zero columns change no logit (the
    # scale is explicit) and only add output columns, which are sliced off.
    width = max(head_dim, head_dim_v)
    qg, k, v = (_pad_last(x, width) for x in (qg, k, v))
    shape = (num_kv_heads, per_group, k.shape[1], width)
    bias = torch.zeros(key_mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~key_mask, float("-inf"))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, k[:, None].expand(shape), v[:, None].expand(shape), attn_mask=bias.transpose(0, 1)[:, None], scale=scale)
    o = o[..., :head_dim_v]
    weight = torch.isfinite(lse).float()  # [G, P, n]; rows with no key get 0 (flash leaves them undefined)
    if sinks is not None:
        weight = weight * torch.sigmoid(lse - sinks[:, :, None])
    o = torch.where(weight[..., None] > 0, o * weight[..., None], 0.0)
    return o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim_v)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` with zero columns appended to its last dim up to `width` (itself when already that wide)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _attend_masked_unfused(q, k, v, key_mask, scale, sinks):
    """`attend_masked` with explicit logits (devices without PyTorch's CPU flash kernel)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    per_group = num_heads // num_kv_heads
    qg = group_queries(q, num_kv_heads).reshape(num_kv_heads, n * per_group, head_dim)
    z = grouped_logits(qg, k, scale).view(num_kv_heads, n, per_group, -1)
    z.masked_fill_(~key_mask.transpose(0, 1)[:, :, None, :], float("-inf"))
    p = sink_softmax(z, None if sinks is None else sinks[:, None, :])
    o = torch.matmul(p.view(num_kv_heads, n * per_group, -1), v)  # [G, n * P, Dv]
    head_dim_v = v.shape[-1]
    return o.view(num_kv_heads, n, per_group, head_dim_v).transpose(0, 1).reshape(n, num_heads, head_dim_v)


# A prefill run gathers its rows' selected keys (instead of masking all of its
# keys) once its context is this many times the selection width.
GATHER_FACTOR = 8


NO_SINKS = NO_GATE = torch.empty(0, dtype=torch.float32)


def gated_store(out: torch.Tensor, o: torch.Tensor, gate: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """`out = (out if accumulate else 0) + sigmoid(gate) * o`, in float32, stored in out's dtype: a branch's output
    through its gate (SPEC §2.5), the PyTorch twin of the C++ kernels' gated rows (`cpu_gate.h`).

    out, o: `[n, H, Dv]`; gate: `[n, H, Dv]`, or `[n, H, 1]` (one gate per head). Returns out.
    """
    y = torch.sigmoid(gate.float()) * o.float()
    out.copy_(out.float() + y if accumulate else y)
    return out


def bind_sparse(q, k_cache, v_cache, *, span: int, scale: float, sinks):
    """`sparse_attention`'s C++ kernel bound to one layer's pages, span, scale and sinks (`[H]` float32 or None);
    None where it does not apply (then the PyTorch path runs): float32, vLLM's interleaved pages on the CPU,
    D_k == D_v, a compiled head dim.

    Returns `run(q [n, H, D], block_table, plan, out [n, H, D], ids [n, G, W] int32, gate=None, accumulate=False)`
    for the `n = plan.num_tokens` rows of a step; with `gate` (`[n, H, D]` float32, its last stride 1 or 0) the rows
    are stored through it, as `gated_store`. The serving path binds it once per layer and cache
    (`HySparseAttentionImpl`): what is checked here holds for the cache's life, and per call these checks and
    lookups cost more than the kernel does for a decode row (0.07 ms of 0.11 at 512 tokens, 2-core AMD EPYC).
    """
    pages = cpu_kernel_pages(k_cache, v_cache)
    ext = cpu_ext.load("sparse") if pages is not None and q.dtype == torch.float32 else None
    if ext is None or q.shape[-1] not in ext.SUPPORTED_DIMS or q.shape[1] // k_cache.shape[1] > 64:
        return None
    op, sinks = ext.paged_sparse, NO_SINKS if sinks is None else sinks

    def run(q, block_table, plan, out, ids, gate=None, accumulate=False):
        op(q, pages, block_table, plan.row_req, plan.row_pos, ids, span, scale, sinks,
           NO_GATE if gate is None else gate, accumulate, out)

    return run


def sparse_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale: float, sinks, out,
                     plan: BatchPlan | None, ids: torch.Tensor, span: int, select, mask) -> torch.Tensor:
    """A sparse role over a step (the kernels' contract).

    Where the C++ kernel is built (float32, vLLM's interleaved pages on the
    CPU, D_k == D_v), every row runs over its own selection straight from the pages.
    Otherwise decode rows gather their keys together and each prefill run is
    attended with a key mask.

    Args:
        q: `[T, H, D]`; sinks: `[H]` or None; out: `[T, H, Dv]` or None (rows past the last request get 0).
        ids: `[T, G, W]` selection; entry `i` stands for positions `[i * span, i * span + span)`, -1 for none.
        select: `(plan, rows [n]) -> (positions, valid)`, both `[n, G, W * span]`.
        mask: `(plan, start, end, num_keys) -> [end - start, G, num_keys]` bool key mask of rows `[start, end)`.
    Returns:
        out.
    """
    out, sinks = check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out, sinks)
    plan = plan_or_make(plan, query_start_loc, seq_lens, q.shape[0])
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, head_dim_v = k_cache.shape[1], v_cache.shape[3]
    out[plan.num_tokens:].zero_()
    run = bind_sparse(q, k_cache, v_cache, span=span, scale=scale, sinks=sinks)
    if run is not None:
        n = plan.num_tokens
        run(q[:n], block_table, plan, out[:n], ids[:n].to(torch.int32))
        return out
    width = ids.shape[-1] * span
    sinks = None if sinks is None else sinks.view(num_kv_heads, -1)
    rows_per_chunk = ELEMENT_BUDGET // (num_kv_heads * width * (head_dim + head_dim_v + num_heads // num_kv_heads))

    def gathered(rows, reqs):
        positions, valid = select(plan, rows)
        o = attend_positions(q[rows], k_cache, v_cache, block_table, reqs, positions, valid, scale, sinks)
        out[rows] = o.to(out.dtype)

    for s, e in chunks(plan.num_decodes, rows_per_chunk):
        gathered(plan.decode_rows[s:e], plan.decode_reqs[s:e])
    for run in plan.prefills:
        if run.seq_len > GATHER_FACTOR * width:
            for s, e in chunks(run.end - run.start, rows_per_chunk):
                rows = torch.arange(run.start + s, run.start + e, device=q.device)
                gathered(rows, torch.full_like(rows, run.req))
            continue
        k, v = gather_request_kv(k_cache, v_cache, block_table[run.req], run.seq_len)
        for s, e in chunks(run.end - run.start, ELEMENT_BUDGET // (2 * num_kv_heads * run.seq_len)):
            a, b = run.start + s, run.start + e
            num_keys = run.first_pos + (b - run.start)
            o = attend_masked(q[a:b], k[:, :num_keys], v[:, :num_keys], mask(plan, a, b, num_keys), scale, sinks)
            out[a:b] = o.to(out.dtype)
    return out


def decode_kernel():
    """`(q [N, H, D], pages, block_table, reqs [N], lens [N], num_keys, scale) -> (out [N, H, D], logits
    [N, H, num_keys] (-inf past each row's length), lse [N, H])` in C++ (`oracle/cpu_decode.cpp`), or None (then
    PyTorch runs). Where the tiled kernel is built, neither oracle comes here: the block oracle calls it directly
    (`oracle/batched.py`), the token oracle with its C++ selection (`token_oracle/batched.py`)."""
    ext = cpu_ext.load()
    return None if ext is None else ext.paged_decode


def oracle_attention_rows(q, k_cache, v_cache, block_table, plan: BatchPlan, out, indices, *, scale: float,
                          select) -> None:
    """Drive an oracle role over a step: exact causal attention plus a per-row selection from the same logits.

    Decode rows are handled together: by the C++ kernel straight from the
    pages where it is built (float32, vLLM's interleaved page layout, D_k == D_v), else
    over their requests' keys gathered and padded to the longest. Each prefill
    run is handled over its own keys, in row chunks, by matrix products.

    Args:
        q: `[T, H, D]`; out `[T, H, Dv]` and indices `[T, G, width]`: rows `[0, plan.num_tokens)` are written.
        select: `(z [b, G, r, P, S], lse [b, G, r, P, 1], limit [b, r]) -> ids [b, r, G, width]`, where
            row i of batch b sees keys `j <= limit[b, i]` and z is -inf past it.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, head_dim_v = k_cache.shape[1], v_cache.shape[3]
    per_group = num_heads // num_kv_heads

    def write(rows, o, ids):
        out[rows] = o.permute(0, 2, 1, 3, 4).reshape(-1, num_heads, head_dim_v).to(out.dtype)
        if indices.shape[-1]:  # an empty selection (plain attention, `csrc_triton/dense.py`) writes no ids
            indices[rows] = ids.reshape(-1, *indices.shape[1:]).to(indices.dtype)

    if plan.num_decodes:
        num_keys = plan.max_decode_len
        base = cpu_kernel_pages(k_cache, v_cache)
        decode = decode_kernel() if base is not None else None
        per_req = num_keys * (num_heads if decode else num_kv_heads * (head_dim + head_dim_v) + 3 * num_heads)
        for s, e in chunks(plan.num_decodes, ELEMENT_BUDGET // per_req):
            rows, reqs, lens = plan.decode_rows[s:e], plan.decode_reqs[s:e], plan.decode_lens[s:e]
            limit = (lens - 1)[:, None]
            if decode is not None:
                o, z, lse = decode(q[rows].float(), base, block_table, reqs, lens, num_keys, scale)
                shape = (e - s, num_kv_heads, 1, per_group)
                o = o.view(*shape, head_dim_v)
                ids = select(z.view(*shape, num_keys), lse.view(*shape, 1), limit)
            else:
                k, v = gather_context_kv(k_cache, v_cache, block_table, reqs, num_keys)
                # keys past a shorter request's end are other data (or never written): no weight, no NaN
                past = torch.arange(num_keys, device=q.device)[None, None, :, None] >= lens[:, None, None, None]
                v.masked_fill_(past, 0.0)
                qg = q[rows].float().view(-1, num_kv_heads, 1, per_group, head_dim)
                ids, o = causal_attention(qg, k, v, limit, scale, select)
            write(rows, o, ids)
    for run in plan.prefills:
        k, v = gather_request_kv(k_cache, v_cache, block_table[run.req], run.seq_len)
        k, v = k[None], v[None]
        for s, e in chunks(run.end - run.start, ELEMENT_BUDGET // (3 * num_heads * run.seq_len)):
            a, b = run.start + s, run.start + e
            num_keys = run.first_pos + (b - run.start)
            qg = group_queries(q[a:b], num_kv_heads)[None]  # [1, G, r, P, D]
            limit = plan.row_pos[a:b][None]
            ids, o = causal_attention(qg, k[:, :, :num_keys], v[:, :, :num_keys], limit, scale, select,
                                      mask_from=run.first_pos + s + 1)
            write(slice(a, b), o, ids)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor, scale: float, select,
                     mask_from: int = 0):
    """Exact causal GQA attention and a selection from the same logits (each key is scored once).

    The selection reads the logits before they are turned, in place, into the
    probabilities that weight the values.

    Args:
        q: `[b, G, r, P, D]` float32; k: `[b, G, S, D]`, v: `[b, G, S, Dv]` float32; limit: `[b, r]` last
            visible key of each row.
        select: `(z [b, G, r, P, S], lse [b, G, r, P, 1], limit) -> ids`; z is -inf past each row's limit.
        mask_from: no row's limit is below `mask_from - 1` (a host bound): keys before it need no mask.
    Returns:
        the selection `ids` and the output `[b, G, r, P, Dv]`.
    """
    b, g, r, p, d = q.shape
    s = k.shape[2]
    z = torch.matmul((q * scale).reshape(b, g, r * p, d), k.transpose(-1, -2)).view(b, g, r, p, s)
    j = torch.arange(mask_from, s, device=q.device)
    z[..., mask_from:].masked_fill_(j > limit[:, None, :, None, None], float("-inf"))
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    ids = select(z, lse, limit)
    probs = z.sub_(lse).exp_()
    o = torch.matmul(probs.view(b, g, r * p, s), v).view(b, g, r, p, v.shape[-1])
    return ids, o
