# SPDX-License-Identifier: Apache-2.0
"""`vllm_hysparse.reference.ops` against hand-worked examples and loop-based oracles (SPEC §3)."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.reference._reference_math import (
    F64,
    block_keys,
    brute_attention,
    brute_block_topk,
    brute_token_scores,
    brute_token_topk,
    group_of,
    heads_of,
)
from vllm_hysparse.reference import ops


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, std=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std


def logits_as_qk(z: torch.Tensor):
    """q, k with `scale * q_h[t] . k[j] == z[h, t, j]`: identity keys, `q = z / scale`.

    z: `[H, Tq, Tk]`. Returns q `[1, Tq, H, Tk]`, k `[1, Tk, 1, Tk]` (one KV group), scale.
    """
    nh, tq, tk = z.shape
    scale = tk**-0.5
    q = (z / scale).permute(1, 0, 2).unsqueeze(0).contiguous()
    k = torch.eye(tk).view(1, tk, 1, tk)
    return q, k, scale


# ----------------------------------------------------------------------------- oracle (SPEC §3.1)

WORKED_P = [0.04, 0.06, 0.30, 0.05, 0.08, 0.12, 0.20, 0.15]


def worked_example_qk():
    g = gen(1)
    z = randn(g, 1, 8, 8)  # other query rows: random
    z[0, 7] = torch.log(torch.tensor(WORKED_P))
    return logits_as_qk(z)


def test_worked_example_block_scores():
    q, k, scale = worked_example_qk()
    z = ops.attention_logits(q, k, scale)
    assert z.shape == (1, 1, 8, 8)
    torch.testing.assert_close(torch.softmax(z[0, 0, 7], -1), torch.tensor(WORKED_P), atol=1e-6, rtol=1e-5)
    s = ops.oracle_block_scores(z, block_size=2, num_kv_heads=1)
    assert s.shape == (1, 1, 8, 4)
    torch.testing.assert_close(s[0, 0, 7], torch.tensor([0.06, 0.30, 0.12, 0.20]), atol=1e-6, rtol=1e-5)


def test_worked_example_block_topk():
    q, k, scale = worked_example_qk()
    ids = ops.oracle_block_topk(q, k, scale, block_size=2, topk=2)
    assert ids.shape == (1, 8, 1, 2)
    assert ids[0, 7, 0].tolist() == [1, 3]
    # The other rows agree with the loop oracle too.
    assert torch.equal(ids, brute_block_topk(q, k, scale, 2, 2))


def test_eq3_exp_decides_group_max():
    """Two heads of one KV group where Eq. 3 (with exp) and the exp-less line disagree on top-1.

    Without exp, every head's own argmax block scores exactly 0 (the maximum), so
    the two heads' argmax blocks tie and the smaller id wins; with exp, the peaked
    head's argmax block (score ~1/l, l small) beats the flat head's (1/l, l large).
    """
    tk, bs = 4, 2
    last = torch.tensor([[1.0, 0.9, 0.8, 0.7],  # head 0: flat, argmax in block 0
                         [0.0, 0.0, 5.0, 0.0]])  # head 1: peaked, argmax in block 1
    z = randn(gen(2), 2, tk, tk)
    z[:, -1] = last

    def by_hand(with_exp: bool) -> int:
        r = {}
        for hrow in last.tolist():
            m = max(hrow)
            l = sum(math.exp(x - m) for x in hrow)
            for b in range(tk // bs):
                u = max(hrow[b * bs:(b + 1) * bs])
                s = math.exp(u - m) / l if with_exp else (u - m) / l
                r[b] = max(r.get(b, -math.inf), s)
        return sorted(r, key=lambda b: (-r[b], b))[0]

    assert by_hand(True) != by_hand(False)
    q, k, scale = logits_as_qk(z)
    ids = ops.oracle_block_topk(q, k, scale, block_size=bs, topk=1)
    assert ids[0, -1, 0].tolist() == [by_hand(True)] == [1]


def test_block_score_ties_smaller_block_wins():
    # Last query: blocks 1 and 3 hold the same max logit, the rest is lower.
    z = randn(gen(3), 1, 8, 8)
    z[0, 7] = torch.tensor([0.1, -0.3, 2.0, 0.5, -1.0, 0.2, 0.7, 2.0])
    q, k, scale = logits_as_qk(z)
    s = ops.oracle_block_scores(ops.attention_logits(q, k, scale), 2, 1)
    assert s[0, 0, 7, 1] == s[0, 0, 7, 3]
    assert ops.oracle_block_topk(q, k, scale, 2, 1)[0, 7, 0].tolist() == [1]
    assert ops.oracle_block_topk(q, k, scale, 2, 2)[0, 7, 0].tolist() == [1, 3]
    # All keys equal: every visible block ties, the smallest ids win.
    zz = torch.full((1, 8, 8), 0.3)
    q, k, scale = logits_as_qk(zz)
    ids = ops.oracle_block_topk(q, k, scale, 2, 2)
    assert ids[0, 7, 0].tolist() == [0, 1]
    assert ids[0, 0, 0].tolist() == [0, -1]


@pytest.mark.parametrize("seed", range(3))
def test_select_topk_matches_sorted_python(seed):
    g = gen(100 + seed)
    # Few distinct values so that ties are frequent.
    scores = torch.randint(0, 4, (5, 7, 11), generator=g).float()
    cand = torch.rand(5, 7, 11, generator=g) < 0.6
    for k in (1, 3, 11, 14):
        got = ops.select_topk(scores, cand, k)
        assert got.shape == (5, 7, k)
        for a in range(5):
            for b in range(7):
                ids = [i for i in range(11) if cand[a, b, i]]
                best = sorted(sorted(ids, key=lambda i: (-float(scores[a, b, i]), i))[:k])
                assert got[a, b].tolist() == best + [-1] * (k - len(best))


def test_token_topk_ties_smaller_position_wins():
    # One query (t = 9), identical logits everywhere: outside the window, the
    # smallest positions win; the window is forced.
    z = torch.full((1, 10, 10), 0.25)
    q, k, scale = logits_as_qk(z)
    ids = ops.token_topk(q, k, scale, topk_tokens=3, recent_window=2)
    assert ids[0, 9, 0].tolist() == [0, 1, 2, 8, 9]
    ids = ops.token_topk(q, k, scale, topk_tokens=3, recent_window=2, forced_window=False)
    assert ids[0, 9, 0].tolist() == [0, 1, 2, 3, 4]
    # A two-way tie between positions 6 and 2 (above the others) for one global slot.
    z = randn(gen(4), 1, 10, 10, std=0.1)
    z[0, 9, 2] = z[0, 9, 6] = 3.0
    q, k, scale = logits_as_qk(z)
    ids = ops.token_topk(q, k, scale, topk_tokens=1, recent_window=2)
    assert ids[0, 9, 0].tolist() == [2, 8, 9]


def test_fewer_visible_blocks_than_k():
    bs, topk, tk = 4, 3, 10  # 3 blocks; query t sees t // 4 + 1 of them
    g = gen(5)
    q, k = randn(g, 2, tk, 4, 8), randn(g, 2, tk, 2, 8)
    ids = ops.oracle_block_topk(q, k, 8**-0.5, bs, topk)
    assert ids.shape == (2, tk, 2, topk)
    for t in range(tk):
        vis = t // bs + 1
        row = ids[:, t].reshape(-1, topk)
        for r in row.tolist():
            assert r == list(range(vis)) + [-1] * (topk - vis)
    # With more blocks than k, no block starting after t is ever picked.
    tk = 23
    q, k = randn(g, 2, tk, 4, 8), randn(g, 2, tk, 2, 8)
    ids = ops.oracle_block_topk(q, k, 8**-0.5, bs, topk)
    t = torch.arange(tk).view(1, tk, 1, 1)
    assert bool(((ids * bs <= t) | (ids == -1)).all())
    assert bool((ids[:, bs * topk:] >= 0).all())  # enough visible blocks: no padding


BS, TOPK = 4, 3


@pytest.mark.parametrize("tk", [BS - 1, BS, BS + 1, TOPK * BS - 1, TOPK * BS, TOPK * BS + 1])
def test_oracle_boundary_lengths_vs_loops(tk):
    g = gen(200 + tk)
    q, k = randn(g, 1, tk, 4, 8, std=2.0), randn(g, 1, tk, 2, 8)
    assert torch.equal(ops.oracle_block_topk(q, k, 8**-0.5, BS, TOPK), brute_block_topk(q, k, 8**-0.5, BS, TOPK))


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("tq", [17, 1, 5], ids=["prefill", "decode", "chunk"])
def test_oracle_group_max_vs_loops(num_kv_heads, tq):
    g = gen(300 + 10 * num_kv_heads + tq)
    tk, d = 17, 8
    q, k = randn(g, 2, tq, 4, d, std=2.0), randn(g, 2, tk, num_kv_heads, d)
    got = ops.oracle_block_topk(q, k, d**-0.5, 3, 2)
    assert got.shape == (2, tq, num_kv_heads, 2)
    assert torch.equal(got, brute_block_topk(q, k, d**-0.5, 3, 2))
    # The group score really is the max over the group's heads.
    z = ops.attention_logits(q, k, d**-0.5)
    r = ops.oracle_block_scores(z, 3, num_kv_heads)
    per_head = ops.oracle_block_scores(z, 3, 4)
    for gg in range(num_kv_heads):
        hs = heads_of(gg, 4, num_kv_heads)
        torch.testing.assert_close(r[:, gg], per_head[:, hs].amax(1))


# ----------------------------------------------------------------------------- sparse layer (SPEC §3.2)


def dense_sink(q, k, v, scale, sink):
    """Independent causal masked softmax with a sink logit in the denominator (Tq == Tk)."""
    nh = q.shape[2]
    kk = k.to(F64).repeat_interleave(nh // k.shape[2], 2)
    vv = v.to(F64).repeat_interleave(nh // v.shape[2], 2)
    z = torch.einsum("bihd,bjhd->bhij", q.to(F64), kk) * scale
    t = q.shape[1]
    z = z.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    s = sink.to(F64).view(1, -1, 1, 1).expand(*z.shape[:3], 1)
    p = torch.softmax(torch.cat([z, s], -1), -1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", p, vv)


def sdpa_causal(q, k, v):
    nh = q.shape[2]
    kk = k.repeat_interleave(nh // k.shape[2], 2).transpose(1, 2)
    vv = v.repeat_interleave(nh // v.shape[2], 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, is_causal=True).transpose(1, 2)


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_sparse_layer_all_blocks_equals_dense(gate, with_sinks):
    g = gen(400 + 2 * (gate == "headwise") + with_sinks)
    bsz, t, nh, ng, d, bs = 2, 11, 4, 2, 8, 4
    q = randn(g, bsz, t, nh, d)
    kf, vf, ks, vs = (randn(g, bsz, t, ng, d) for _ in range(4))
    gw = d if gate == "elementwise" else 1
    gate_sa, gate_w = randn(g, bsz, t, nh, gw), randn(g, bsz, t, nh, gw)
    sink_sa, sink_w = (randn(g, nh), randn(g, nh)) if with_sinks else (None, None)
    nb = -(-t // bs)
    all_blocks = torch.cat([torch.arange(nb), torch.tensor([-1])]).expand(bsz, t, ng, nb + 1)  # -1 padded
    got = ops.sparse_layer_attention(
        q, kf, vf, all_blocks, ks, vs, gate_sa, gate_w,
        block_size=bs, swa_window=t + 3, scale=d**-0.5, sink_sparse=sink_sa, sink_swa=sink_w)
    assert got.shape == (bsz, t, nh, d) and got.dtype == torch.float32
    if with_sinks:
        want = (torch.sigmoid(gate_sa.double()) * dense_sink(q, kf, vf, d**-0.5, sink_sa)
                + torch.sigmoid(gate_w.double()) * dense_sink(q, ks, vs, d**-0.5, sink_w))
    else:
        want = (torch.sigmoid(gate_sa) * sdpa_causal(q, kf, vf) + torch.sigmoid(gate_w) * sdpa_causal(q, ks, vs))
    torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


def test_sparse_layer_vs_loops_with_selection():
    g = gen(450)
    bsz, t, nh, ng, d, bs, win = 1, 14, 4, 2, 8, 3, 4
    q = randn(g, bsz, t, nh, d, std=2.0)
    kf, vf, ks, vs = (randn(g, bsz, t, ng, d) for _ in range(4))
    gsa, gsw = randn(g, bsz, t, nh, 1), randn(g, bsz, t, nh, 1)
    s1, s2 = randn(g, nh), randn(g, nh)
    scale = d**-0.5
    ids = ops.oracle_block_topk(q, kf, scale, bs, 2)
    got = ops.sparse_layer_attention(q, kf, vf, ids, ks, vs, gsa, gsw, block_size=bs, swa_window=win,
                                     scale=scale, sink_sparse=s1, sink_swa=s2)
    ref_ids = brute_block_topk(q, kf, scale, bs, 2)
    o_sa = brute_attention(q, kf, vf, scale, lambda b, i, h: block_keys(ref_ids[b, i, group_of(h, nh, ng)], bs, i), s1)
    o_w = brute_attention(q, ks, vs, scale, lambda b, i, h: range(max(0, i - win + 1), i + 1), s2)
    want = torch.sigmoid(gsa.double()) * o_sa + torch.sigmoid(gsw.double()) * o_w
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d,dv", [(12, 8), (8, 12)], ids=["narrow-v", "wide-v"])
def test_every_attention_op_with_separate_v_head_dim_vs_loops(d, dv):
    """SPEC §2.6: outputs are Dv wide, the scale is head_dim ** -0.5, and selections see only q/k."""
    g = gen(470 + d)
    bsz, t, nh, ng, bs, win = 2, 14, 4, 2, 3, 4
    scale = d**-0.5
    q = randn(g, bsz, t, nh, d, std=2.0)
    kf, ks = randn(g, bsz, t, ng, d), randn(g, bsz, t, ng, d)
    vf, vs = randn(g, bsz, t, ng, dv), randn(g, bsz, t, ng, dv)
    s1, s2 = randn(g, nh), randn(g, nh)

    def check(got, want):
        assert got.shape == (bsz, t, nh, dv)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    check(ops.dense_attention(q, kf, vf, scale), brute_attention(q, kf, vf, scale, lambda b, i, h: range(i + 1)))
    check(ops.dense_attention(q, ks, vs, scale, s2, window=win),
          brute_attention(q, ks, vs, scale, lambda b, i, h: range(max(0, i - win + 1), i + 1), s2))
    o, ids = ops.full_attention_with_oracle(q, kf, vf, scale, bs, 2)
    assert torch.equal(ids, brute_block_topk(q, kf, scale, bs, 2))
    o_sa = brute_attention(q, kf, vf, scale, lambda b, i, h: block_keys(ids[b, i, group_of(h, nh, ng)], bs, i), s1)
    check(ops.block_sparse_attention(q, kf, vf, ids, bs, scale, s1), o_sa)
    gsa, gsw = randn(g, bsz, t, nh, dv), randn(g, bsz, t, nh, dv)
    o_w = brute_attention(q, ks, vs, scale, lambda b, i, h: range(max(0, i - win + 1), i + 1), s2)
    check(ops.sparse_layer_attention(q, kf, vf, ids, ks, vs, gsa, gsw, block_size=bs, swa_window=win, scale=scale,
                                     sink_sparse=s1, sink_swa=s2),
          torch.sigmoid(gsa.double()) * o_sa + torch.sigmoid(gsw.double()) * o_w)
    tok = ops.token_topk(q, kf, scale, 2, 3)
    assert torch.equal(tok, brute_token_topk(q, kf, scale, 2, 3))
    check(ops.token_sparse_attention(q, kf, vf, tok, scale, s1),
          brute_attention(q, kf, vf, scale, lambda b, i, h: [int(j) for j in tok[b, i, group_of(h, nh, ng)]
                                                             if j >= 0], s1))


@pytest.mark.parametrize("tq,tk", [(1, 37), (5, 20), (13, 13)], ids=["decode", "chunk", "prefill"])
@pytest.mark.parametrize("with_sink", [True, False])
def test_block_sparse_attention_vs_loops(tq, tk, with_sink):
    g = gen(500 + tq + tk + with_sink)
    bsz, nh, ng, d, bs, kk = 2, 4, 2, 8, 4, 3
    q = randn(g, bsz, tq, nh, d)
    k, v = randn(g, bsz, tk, ng, d), randn(g, bsz, tk, ng, d)
    nb = -(-tk // bs)
    # Random distinct block ids (any block, including ones after t), some -1 padding.
    ids = torch.stack([torch.randperm(nb, generator=g)[:kk] for _ in range(bsz * tq * ng)]).view(bsz, tq, ng, kk)
    ids[..., -1] = torch.where(torch.rand(bsz, tq, ng, generator=g) < 0.3, -1, ids[..., -1])
    sink = randn(g, nh) if with_sink else None
    got = ops.block_sparse_attention(q, k, v, ids, bs, d**-0.5, sink)
    want = brute_attention(
        q, k, v, d**-0.5, lambda b, i, h: block_keys(ids[b, i, group_of(h, nh, ng)], bs, tk - tq + i), sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- window, sinks


@pytest.mark.parametrize("tk", [5, 6, 7])
@pytest.mark.parametrize("with_sink", [True, False])
def test_sliding_window_boundary(tk, with_sink):
    w = 6
    g = gen(600 + tk + with_sink)
    q, k, v = randn(g, 1, tk, 4, 8), randn(g, 1, tk, 1, 8), randn(g, 1, tk, 1, 8)
    sink = randn(g, 4) if with_sink else None
    got = ops.dense_attention(q, k, v, 8**-0.5, sink, window=w)
    want = brute_attention(q, k, v, 8**-0.5, lambda b, t, h: range(max(0, t - w + 1), t + 1), sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    mask = ops.window_mask(tk, tk, w)
    for t in range(tk):
        assert [j for j in range(tk) if mask[t, j]] == list(range(max(0, t - w + 1), t + 1))
    # Decode: the single query is the last position.
    got1 = ops.dense_attention(q[:, -1:], k, v, 8**-0.5, sink, window=w)
    torch.testing.assert_close(got1, got[:, -1:], atol=1e-6, rtol=1e-5)


def test_sink_softmax_hand_formula():
    g = gen(700)
    z = randn(g, 2, 3, 4, 6)
    z[..., 4:] = -math.inf  # masked keys
    sink = randn(g, 3)
    p = ops.sink_softmax(z, sink)
    ez = torch.exp(z.double())
    tot = ez.sum(-1)
    want_sum = 1.0 / (1.0 + torch.exp(sink.double()).view(1, 3, 1) / tot)
    torch.testing.assert_close(p.double().sum(-1), want_sum, atol=1e-6, rtol=1e-6)
    want = ez / (torch.exp(sink.double()).view(1, 3, 1, 1) + tot[..., None])
    torch.testing.assert_close(p.double(), want, atol=1e-6, rtol=1e-6)
    assert bool((p[..., 4:] == 0).all())
    # No sink: a plain softmax.
    torch.testing.assert_close(ops.sink_softmax(z, None), torch.softmax(z, -1))
    # A fully masked row gives zeros, not NaN.
    zm = torch.full((1, 3, 1, 4), -math.inf)
    assert bool((ops.sink_softmax(zm, sink) == 0).all()) and bool((ops.sink_softmax(zm, None) == 0).all())


# ----------------------------------------------------------------------------- HySparse2 tokens (SPEC §3.3)

KG, W = 3, 4


def _token_inputs(seed, t, nh=4, ng=2, d=8):
    g = gen(seed)
    return randn(g, 2, t, nh, d, std=2.0), randn(g, 2, t, ng, d), d**-0.5


@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("t_len", [KG + W - 2, KG + W + 6])
def test_token_topk_structure_and_loops(reduce, t_len):
    q, k, scale = _token_inputs(800 + t_len + (reduce == "sum"), t_len)
    ids = ops.token_topk(q, k, scale, KG, W, reduce)
    assert ids.shape == (2, t_len, 2, KG + W)
    assert torch.equal(ids, brute_token_topk(q, k, scale, KG, W, reduce))
    for b in range(2):
        for t in range(t_len):
            for g in range(2):
                row = ids[b, t, g].tolist()
                sel = [j for j in row if j >= 0]
                assert row == sel + [-1] * (len(row) - len(sel))  # padding at the end
                assert sel == sorted(set(sel))
                assert len(sel) == min(t + 1, KG + W)
                win = set(range(max(0, t - W + 1), t + 1))
                assert win <= set(sel)
                glob = [j for j in sel if j not in win]
                assert all(j <= t - W for j in glob)
                # The global part is the brute-force top-k_g outside the window.
                r = brute_token_scores([q[b, t, h] for h in heads_of(g, 4, 2)], k[b, :, g], scale, t, reduce)
                outside = [j for j in range(t - W + 1)]
                best = sorted(sorted(outside, key=lambda j: (-r[j], j))[:KG])
                assert glob == best


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_topk_without_forced_window(reduce):
    t_len = KG + W + 5
    q, k, scale = _token_inputs(850 + (reduce == "sum"), t_len)
    ids = ops.token_topk(q, k, scale, KG, W, reduce, forced_window=False)
    assert torch.equal(ids, brute_token_topk(q, k, scale, KG, W, reduce, forced_window=False))
    forced = ops.token_topk(q, k, scale, KG, W, reduce)
    assert not torch.equal(ids, forced)  # the window is not always in the top by score


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_topk_positions_subset(reduce):
    t_len = 15
    q, k, scale = _token_inputs(870 + (reduce == "sum"), t_len)
    full = ops.token_topk(q, k, scale, KG, W, reduce)
    rows = torch.tensor([0, 3, 4, 10, 14])
    sub = ops.token_topk(q[:, rows], k, scale, KG, W, reduce, positions=rows)
    assert torch.equal(sub, full[:, rows])
    sub = ops.token_topk(q[:, rows], k, scale, KG, W, reduce, forced_window=False, positions=rows)
    assert torch.equal(sub, ops.token_topk(q, k, scale, KG, W, reduce, forced_window=False)[:, rows])
    # Decode-style: one query at the last position, default positions.
    assert torch.equal(ops.token_topk(q[:, -1:], k, scale, KG, W, reduce), full[:, -1:])


@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("tq,tk", [(12, 12), (1, 19), (4, 9)])
def test_token_sparse_attention_vs_loops(with_sink, tq, tk):
    g = gen(900 + tq + tk + with_sink)
    nh, ng, d = 4, 1, 8
    q, k, v = randn(g, 2, tq, nh, d), randn(g, 2, tk, ng, d), randn(g, 2, tk, ng, d)
    sink = randn(g, nh) if with_sink else None
    ids = ops.token_topk(q, k, d**-0.5, 2, 3)
    got = ops.token_sparse_attention(q, k, v, ids, d**-0.5, sink)
    want = brute_attention(q, k, v, d**-0.5, lambda b, i, h: [int(j) for j in ids[b, i, 0] if j >= 0], sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # Arbitrary ids, including ones after t (must be causal-masked) and -1 padding.
    rnd = torch.randint(-1, tk, (2, tq, ng, 5), generator=g)
    got = ops.token_sparse_attention(q, k, v, rnd, d**-0.5, sink)
    pos0 = tk - tq
    want = brute_attention(
        q, k, v, d**-0.5,
        lambda b, i, h: sorted({int(j) for j in rnd[b, i, 0] if 0 <= int(j) <= pos0 + i}), sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # With positions (subset of rows).
    rows = torch.tensor([0, tq - 1]) if tq > 1 else torch.tensor([0])
    qa = randn(g, 2, tk, nh, d)
    ids = ops.token_topk(qa, k, d**-0.5, 2, 3)
    full = ops.token_sparse_attention(qa, k, v, ids, d**-0.5, sink)
    part = ops.token_sparse_attention(qa[:, rows], k, v, ids[:, rows], d**-0.5, sink, positions=rows)
    torch.testing.assert_close(part, full[:, rows], atol=1e-6, rtol=1e-5)


def test_reduce_heads_bad_value():
    with pytest.raises(ValueError, match="score_head_reduce"):
        ops.reduce_heads(torch.rand(1, 4, 2, 2), 2, "mean")
