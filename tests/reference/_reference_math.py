# SPDX-License-Identifier: Apache-2.0
"""Independent, loop-based implementations of SPEC §3 for the tests.

Nothing here imports `vllm_hysparse`: these are the oracles the code under test
is checked against. They favour obviousness over speed (python loops over
batch, query, head; float64), so keep shapes small.
"""

import math

import torch

F64 = torch.float64


# ----------------------------------------------------------------------------- ops


def group_of(h: int, num_heads: int, num_kv_heads: int) -> int:
    return h // (num_heads // num_kv_heads)


def heads_of(g: int, num_heads: int, num_kv_heads: int) -> list[int]:
    per = num_heads // num_kv_heads
    return list(range(g * per, (g + 1) * per))


def default_positions(tq: int, tk: int) -> list[int]:
    return list(range(tk - tq, tk))


def row_logits(qv: torch.Tensor, keys: torch.Tensor, scale: float, upto: int) -> list[float]:
    """[scale * q . k_j for j in 0..upto] as python floats (float64)."""
    return (keys[: upto + 1].to(F64) @ qv.to(F64) * scale).tolist()


def attend(qv, keys, vals, js, scale, sink=None) -> torch.Tensor:
    """One softmax (with optional sink logit in the denominator) over key positions `js`."""
    js = list(js)
    if not js:
        return torch.zeros(vals.shape[-1], dtype=F64)
    z = keys[js].to(F64) @ qv.to(F64) * scale
    m = z.max()
    if sink is not None:
        m = torch.maximum(m, torch.tensor(float(sink), dtype=F64))
    e = torch.exp(z - m)
    den = e.sum() + (math.exp(float(sink) - m) if sink is not None else 0.0)
    return (e / den) @ vals[js].to(F64)


def block_scores_row(q_heads, keys, scale, t, block_size) -> dict[int, float]:
    """R[b] = max over the given heads of exp(u_b - m) / l (SPEC §3.1), for one query t."""
    r: dict[int, float] = {}
    for qv in q_heads:
        z = row_logits(qv, keys, scale, t)
        m = max(z)
        l = sum(math.exp(zj - m) for zj in z)
        for blk in range(t // block_size + 1):
            u = max(z[j] for j in range(blk * block_size, min((blk + 1) * block_size, t + 1)))
            r[blk] = max(r.get(blk, -1.0), math.exp(u - m) / l)
    return r


def top_ids(scores: dict[int, float], k: int, pad_to: int) -> list[int]:
    """The k ids of largest score, ties -> smaller id; ascending; padded with -1 to pad_to."""
    chosen = sorted(sorted(scores, key=lambda i: (-scores[i], i))[:k])
    return chosen + [-1] * (pad_to - len(chosen))


def brute_block_topk(q, k, scale, block_size, topk, positions=None) -> torch.Tensor:
    """`[B, Tq, G, topk]` oracle block ids by loops over batch, query, group, head, block."""
    bsz, tq, nh, _ = q.shape
    tk, ng = k.shape[1], k.shape[2]
    pos = positions if positions is not None else default_positions(tq, tk)
    out = torch.full((bsz, tq, ng, topk), -1, dtype=torch.long)
    for b in range(bsz):
        for i, t in enumerate(pos):
            for g in range(ng):
                qs = [q[b, i, h] for h in heads_of(g, nh, ng)]
                r = block_scores_row(qs, k[b, :, g], scale, t, block_size)
                out[b, i, g] = torch.tensor(top_ids(r, topk, topk))
    return out


def brute_token_scores(q_heads, keys, scale, t, reduce) -> dict[int, float]:
    """R[j] = reduce over heads of the exact softmax probability of key j (j <= t)."""
    per_head = []
    for qv in q_heads:
        z = row_logits(qv, keys, scale, t)
        m = max(z)
        l = sum(math.exp(zj - m) for zj in z)
        per_head.append([math.exp(zj - m) / l for zj in z])
    if reduce == "max":
        return {j: max(p[j] for p in per_head) for j in range(t + 1)}
    return {j: sum(p[j] for p in per_head) for j in range(t + 1)}


def brute_token_select_row(r: dict[int, float], t, topk_tokens, window, forced_window=True) -> list[int]:
    budget = topk_tokens + window
    if not forced_window:
        return top_ids(r, budget, budget)
    win = set(range(max(0, t - window + 1), t + 1))
    outside = {j: s for j, s in r.items() if j not in win}
    glob = sorted(outside, key=lambda j: (-outside[j], j))[:topk_tokens]
    chosen = sorted(win | set(glob))
    return chosen + [-1] * (budget - len(chosen))


def brute_token_topk(q, k, scale, topk_tokens, window, reduce="max", forced_window=True, positions=None):
    """`[B, Tq, G, k_g + w]` HySparse2 token selection by loops (SPEC §3.3)."""
    bsz, tq, nh, _ = q.shape
    tk, ng = k.shape[1], k.shape[2]
    pos = positions if positions is not None else default_positions(tq, tk)
    out = torch.full((bsz, tq, ng, topk_tokens + window), -1, dtype=torch.long)
    for b in range(bsz):
        for i, t in enumerate(pos):
            for g in range(ng):
                qs = [q[b, i, h] for h in heads_of(g, nh, ng)]
                r = brute_token_scores(qs, k[b, :, g], scale, t, reduce)
                out[b, i, g] = torch.tensor(brute_token_select_row(r, t, topk_tokens, window, forced_window))
    return out


def block_keys(ids, block_size, t) -> list[int]:
    """Key positions j <= t inside the (non -1) blocks `ids`."""
    js = []
    for blk in sorted(int(x) for x in ids if int(x) >= 0):
        js += [j for j in range(blk * block_size, (blk + 1) * block_size) if j <= t]
    return js


def brute_attention(q, k, v, scale, key_sets, sink=None) -> torch.Tensor:
    """`[B, Tq, H, D]` float64 with `key_sets(b, i, h) -> iterable of key positions`."""
    bsz, tq, nh, _ = q.shape
    ng = k.shape[2]
    out = torch.zeros(bsz, tq, nh, v.shape[-1], dtype=F64)
    for b in range(bsz):
        for i in range(tq):
            for h in range(nh):
                g = group_of(h, nh, ng)
                s = None if sink is None else float(sink[h])
                out[b, i, h] = attend(q[b, i, h], k[b, :, g], v[b, :, g], key_sets(b, i, h), scale, s)
    return out


# ----------------------------------------------------------------------------- model pieces


def rms(x, w, eps):
    x = x.to(F64)
    return w.to(F64) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, positions, theta, rotary_dim=None, factor=1.0):
    """Llama rotate-half RoPE on the first `rotary_dim` dims of `x [B, T, n, D]` (float64).

    Pair (i, i + rotary_dim/2) is rotated by `p * theta ** (-2i / rotary_dim) / factor`
    (`factor` > 1: linear position scaling).
    """
    x = x.to(F64)
    d = x.shape[-1]
    rd = d if rotary_dim is None else rotary_dim
    half = rd // 2
    out = x.clone()
    for ti, p in enumerate(positions):
        ang = torch.tensor([p * theta ** (-2.0 * i / rd) / factor for i in range(half)], dtype=F64)
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = x[:, ti, :, :half], x[:, ti, :, half:rd]
        out[:, ti, :, :half] = a * c - b * s
        out[:, ti, :, half:rd] = b * c + a * s
    return out


def lin(sd, name, x):
    y = x.to(F64) @ sd[name + ".weight"].to(F64).T
    if name + ".bias" in sd:
        y = y + sd[name + ".bias"].to(F64)
    return y


def swiglu(sd, p, x):
    g = lin(sd, p + ".gate_proj", x)
    return lin(sd, p + ".down_proj", g * torch.sigmoid(g) * lin(sd, p + ".up_proj", x))


def moe(sd, c, p, x):
    """SPEC §2.6 MoE MLP `p + "mlp"`, token by token: softmax router, the k most probable experts
    (renormalised when `norm_topk_prob`), plus the sigmoid-gated shared expert if there is one."""
    flat = x.reshape(-1, x.shape[-1]).to(F64)
    out = torch.zeros_like(flat)
    for n, xt in enumerate(flat):
        logits = lin(sd, p + "mlp.gate", xt)
        probs = torch.exp(logits - logits.max())
        probs = probs / probs.sum()
        chosen = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[: c["num_experts_per_tok"]]
        weights = [float(probs[e]) for e in chosen]
        if c["norm_topk_prob"]:
            weights = [w / sum(weights) for w in weights]
        for e, w in zip(chosen, weights):
            out[n] += w * swiglu(sd, f"{p}mlp.experts.{e}", xt)
        if p + "mlp.shared_expert_gate.weight" in sd:
            out[n] += torch.sigmoid(lin(sd, p + "mlp.shared_expert_gate", xt)) * swiglu(sd, p + "mlp.shared_expert", xt)
    return out.view(x.shape)


def mlp(sd, c, p, x):
    """The MLP of layer prefix `p`: MoE when the layer has a router, else dense SwiGLU."""
    if p + "mlp.gate.weight" in sd:
        return moe(sd, c, p, x)
    return swiglu(sd, p + "mlp", x)


def heads(x, d):
    return x.view(*x.shape[:2], -1, d)


def lm_logits(sd, c, h):
    h = rms(h, sd["model.norm.weight"], c["rms_norm_eps"])
    w = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]
    return h @ w.to(F64).T


def hysparse_forward(sd, c, ids, sparse_selection=True, kv_sharing=True, swa_branch=True):
    """Logits of SPEC §3.1/§3.2 HySparse from a state dict and a config dict, by loops."""
    nh, ng, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    dv = c.get("v_head_dim") or d  # SPEC §2.6: V (and o_proj's input) may be narrower than q/k
    eps, bs, topk, win = c["rms_norm_eps"], c["sparse_block_size"], c["sparse_topk_blocks"], c["swa_window"]
    theta, scale, qkn = c["rope_theta"], d**-0.5, c.get("qk_norm", False)
    rs = c.get("rope_scaling") or {}
    factor = rs["factor"] if rs.get("rope_type", rs.get("type")) == "linear" else 1.0
    assert not rs or factor != 1.0, f"the loop oracle supports default and linear RoPE only: {rs}"
    bsz, T = ids.shape
    pos = list(range(T))
    h = sd["model.embed_tokens.weight"].to(F64)[ids]
    shared = None
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        x = rms(h, sd[p + "input_layernorm.weight"], eps)
        q = heads(lin(sd, a + "q_proj", x), d)
        if qkn:
            q = rms(q, sd[a + "q_norm.weight"], eps)
        q = rope(q, pos, theta, factor=factor)
        if kind == "full_attention":
            k, v = heads(lin(sd, a + "k_proj", x), d), heads(lin(sd, a + "v_proj", x), dv)
            if qkn:
                k = rms(k, sd[a + "k_norm.weight"], eps)
            k = rope(k, pos, theta, factor=factor)
            o = brute_attention(q, k, v, scale, lambda b, t, hh: range(t + 1))
            shared = (k, v, brute_block_topk(q, k, scale, bs, topk))
        else:
            ks, vs = heads(lin(sd, a + "swa_k_proj", x), d), heads(lin(sd, a + "swa_v_proj", x), dv)
            if qkn:
                ks = rms(ks, sd[a + "swa_k_norm.weight"], eps)
            ks = rope(ks, pos, theta, factor=factor)
            if kv_sharing:
                kg, vg, blocks = shared
            else:
                kg, vg = ks, vs
                blocks = brute_block_topk(q, ks, scale, bs, topk)
            if not sparse_selection:
                nb = -(-T // bs)
                blocks = torch.arange(nb).expand(bsz, T, ng, nb)
            s_sa = sd.get(a + "sparse_sinks")
            s_w = sd.get(a + "swa_sinks")
            o_sa = brute_attention(
                q, kg, vg, scale, lambda b, t, hh: block_keys(blocks[b, t, group_of(hh, nh, ng)], bs, t), s_sa)
            if swa_branch:
                o_w = brute_attention(q, ks, vs, scale, lambda b, t, hh: range(max(0, t - win + 1), t + 1), s_w)
            else:
                o_w = o_sa
            gs = torch.sigmoid(lin(sd, a + "sparse_gate_proj", x)).view(bsz, T, nh, -1)
            gw = torch.sigmoid(lin(sd, a + "swa_gate_proj", x)).view(bsz, T, nh, -1)
            o = gs * o_sa + gw * o_w
        h = h + lin(sd, a + "o_proj", o.reshape(bsz, T, nh * dv))
        h = h + mlp(sd, c, p, rms(h, sd[p + "post_attention_layernorm.weight"], eps))
    return lm_logits(sd, c, h)


def hysparse2_forward(sd, c, ids, token_selection=True, forced_window=True, bridge=True, sliding_window=True,
                      cross_kv_sharing=True):
    """Logits of SPEC §3.3 HySparse2 (every layer on every token) by loops.

    `sliding_window=False`: sliding layers see every causal key. `cross_kv_sharing=False`:
    cross sparse layers project K/V from their own input with `sd`'s `k_proj` / `v_proj`
    (/ `k_norm`) of that layer, which the caller adds (a checkpoint has none).
    """
    nh, ng, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    dv = c.get("v_head_dim") or d
    eps, scale, qkn = c["rms_norm_eps"], d**-0.5, c.get("qk_norm", False)
    n_self, types = c["num_self_decoder_layers"], c["layer_types"]
    full_rope = c.get("full_rope", False)
    kg_, w_, red = c["sparse_topk_tokens"], c["recent_window"], c.get("score_head_reduce", "max")
    bsz, T = ids.shape
    pos = list(range(T))
    h = sd["model.embed_tokens.weight"].to(F64)[ids]

    def frope(x):
        return rope(x, pos, c["rope_theta"]) if full_rope else x

    def gated(a, x, o):
        return torch.sigmoid(lin(sd, a + "gate_proj", x)).view(bsz, T, nh, -1) * o

    sources, shared, n_cross_full = {}, None, 0
    for i, kind in enumerate(types):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if i < n_self and i in c["bridge_sources"]:
            sources[i] = h
        x = rms(h, sd[p + "input_layernorm.weight"], eps)
        q = heads(lin(sd, a + "q_proj", x), d)
        if qkn:
            q = rms(q, sd[a + "q_norm.weight"], eps)
        if kind in ("full_attention", "sliding_attention") or not cross_kv_sharing:
            src = x
            if i >= n_self and kind == "full_attention":  # cross full layer
                if bridge:
                    s = c["bridge_sources"][n_cross_full]
                    src = rms(sources[s], sd[a + "bridge_norm.weight"], eps)
                n_cross_full += 1
            k, v = heads(lin(sd, a + "k_proj", src), d), heads(lin(sd, a + "v_proj", src), dv)
            if qkn:
                k = rms(k, sd[a + "k_norm.weight"], eps)
        if kind == "sliding_attention":
            rd, th, win = c["swa_rotary_dim"], c["swa_rope_theta"], c["swa_window"]
            q, k = rope(q, pos, th, rd), rope(k, pos, th, rd)
            lo = (lambda t: max(0, t - win + 1)) if sliding_window else (lambda t: 0)
            o = brute_attention(q, k, v, scale, lambda b, t, hh: range(lo(t), t + 1), sd.get(a + "sinks"))
            o = gated(a, x, o)
        elif kind == "full_attention":
            q, k = frope(q), frope(k)
            o = brute_attention(q, k, v, scale, lambda b, t, hh: range(t + 1))
            if i >= n_self:
                if token_selection:
                    sel = brute_token_topk(q, k, scale, kg_, w_, red, forced_window)
                else:
                    sel = None
                shared = (k, v, sel)
        else:  # cross sparse
            q = frope(q)
            if cross_kv_sharing:
                k, v, sel = shared
            else:  # own K/V, the cross full layer's token selection
                k, v, sel = frope(k), v, shared[2]
            def keys(b, t, hh, sel=sel):
                if sel is None:
                    return range(t + 1)
                return [int(j) for j in sel[b, t, group_of(hh, nh, ng)] if 0 <= int(j) <= t]

            o = gated(a, x, brute_attention(q, k, v, scale, keys, sd.get(a + "sinks")))
        h = h + lin(sd, a + "o_proj", o.reshape(bsz, T, nh * dv))
        h = h + mlp(sd, c, p, rms(h, sd[p + "post_attention_layernorm.weight"], eps))
    return lm_logits(sd, c, h)
