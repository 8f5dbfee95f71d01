# SPDX-License-Identifier: Apache-2.0
"""Head split under tensor parallelism with replicated KV heads, on simulated ranks (no engine).

When `tp` exceeds the KV heads, one KV group's query heads are spread over
several ranks. The oracles reduce scores over a whole group (SPEC §3.1,
§3.3), so a rank selecting from its own heads selects differently; these
tests show that on random data and that the gathered path (`group_query`:
all ranks' queries, this rank's group) selects exactly what the whole model
selects, on every rank, with the serving kernels (`torch` path).
"""

import pytest
import torch

from csrc_triton.oracle.batched import oracle_attention_batched
from csrc_triton.token_oracle.batched import token_oracle_attention_batched
from tests.kernel_utils import make_paged_batch, nan_like
from vllm_hysparse.configs.base import kv_report, tensor_parallel_heads
from vllm_hysparse.models.tp_heads import HeadSplit
from vllm_hysparse.tools.make_checkpoint import build_config

# (H, G, tp): MQA over two ranks (HySparse2's presets), and two groups over four ranks.
LAYOUTS = [(4, 1, 2), (8, 2, 4)]


def config(h: int, g: int, head_dim: int = 16, v_head_dim: int = 16):
    return build_config("hysparse2", "tiny", {"num_attention_heads": h, "num_key_value_heads": g,
                                              "head_dim": head_dim, "v_head_dim": v_head_dim, "swa_rotary_dim": 8})


def ranks(cfg, tp: int) -> list[HeadSplit]:
    return [HeadSplit(cfg, tp=tp, rank=r) for r in range(tp)]


def test_head_split_replicates_kv_heads():
    cfg = config(8, 2)
    got = [(s.num_heads, s.num_kv_heads, s.kv_head, s.group_offset, s.groups_split) for s in ranks(cfg, 4)]
    assert got == [(2, 1, 0, 0, True), (2, 1, 0, 2, True), (2, 1, 1, 0, True), (2, 1, 1, 2, True)]
    assert all(s.oracle_heads == 4 for s in ranks(cfg, 4))
    # tp dividing G splits groups whole: nothing to gather.
    split = ranks(cfg, 2)
    assert [(s.num_heads, s.num_kv_heads, s.kv_head, s.groups_split, s.oracle_heads) for s in split] == [
        (4, 1, 0, False, 4), (4, 1, 1, False, 4)]
    assert HeadSplit(cfg, tp=2, rank=1).kv_parallel() == {} and HeadSplit(cfg, tp=4, rank=1).kv_parallel() == {
        "disable_tp": True}


@pytest.mark.parametrize("h, g, tp, message", [
    (6, 2, 3, "tensor_parallel_size=3 must be a multiple of num_key_value_heads=2 to replicate KV heads"),
    (8, 4, 8, None),
    (12, 6, 4, "tensor_parallel_size=4 must divide num_key_value_heads=6"),
    (4, 1, 3, "tensor_parallel_size=3 must divide num_attention_heads=4"),
])
def test_bad_tensor_parallel_size_is_one_line_error(h, g, tp, message):
    cfg = config(h, g)
    if message is None:
        assert tensor_parallel_heads(cfg, tp) == (1, 1)
        return
    with pytest.raises(ValueError) as e:
        HeadSplit(cfg, tp=tp, rank=0)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def oracle_run(kind: str, batch, q: torch.Tensor, k_cache, v_cache):
    """(out `[T, n, Dv]`, selection `[T, G, width]`) of the serving kernel over the heads in `q`."""
    args = (q, k_cache, v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t)
    if kind == "block":
        return oracle_attention_batched(*args, scale=0.25, sparse_block_size=16, topk=2, out=nan_like(q))
    return token_oracle_attention_batched(*args, scale=0.25, topk_tokens=8, recent_window=8,
                                          score_head_reduce=kind, out=nan_like(q))


@pytest.mark.parametrize("kind", ["block", "max", "sum"])  # HySparse block oracle, HySparse2 token oracle reduces
@pytest.mark.parametrize("h, g, tp", LAYOUTS, ids=str)
def test_gathered_group_selects_like_the_whole_model(kind, h, g, tp):
    d = dv = 16
    cfg = config(h, g, d, dv)
    # Prefill of 96 and 70 tokens plus two decode rows: many rows where top-k is a real choice.
    batch = make_paged_batch([96, 70, 1, 1], [96, 70, 120, 57], num_kv_heads=g, head_dim=d, page_size=16,
                             dtype=torch.float32, seed=7, head_dim_v=dv)
    t = batch.num_tokens
    q = torch.randn(t, h, d, generator=torch.Generator().manual_seed(3))
    ref_out, ref_ids = oracle_run(kind, batch, q, batch.k_cache, batch.v_cache)  # every head, every group
    q_all = q.reshape(t, h * d)  # what the all-gather of the ranks' queries returns (rank order)
    differs = 0
    for s in ranks(cfg, tp):
        assert s.groups_split
        kv = slice(s.kv_head, s.kv_head + 1)  # the cache this rank holds: its replicated KV head
        k_cache, v_cache = batch.k_cache[:, kv], batch.v_cache[:, kv]
        own = slice(s.rank * s.num_heads, (s.rank + 1) * s.num_heads)
        # A rank alone: its own query heads only.
        _, alone_ids = oracle_run(kind, batch, q[:, own], k_cache, v_cache)
        differs += int((alone_ids != ref_ids[:, kv]).any(dim=(1, 2)).sum())
        # The gathered path the oracle layers run.
        group_q = s.group_of(q_all).view(t, s.oracle_heads, d)
        out, ids = oracle_run(kind, batch, group_q, k_cache, v_cache)
        assert torch.equal(ids, ref_ids[:, kv]), f"rank {s.rank}: gathered selection differs from the model's"
        mine = s.own_heads(out.reshape(t, -1)).view(t, s.num_heads, dv)
        torch.testing.assert_close(mine, ref_out[:, own], rtol=1e-5, atol=1e-5)
    # Per-rank selection is wrong on a good share of the rank-rows (seen: 30% block, 80% token ids).
    assert differs >= t * tp // 4, f"per-rank selection differed on only {differs} of {t * tp} rank-rows"


@pytest.mark.parametrize("h, g, tp", LAYOUTS + [(8, 4, 2)], ids=str)
def test_bridge_kv_keeps_the_ranks_head(h, g, tp):
    d, dv = 12, 8  # v_head_dim != head_dim
    cfg = config(h, g, d, dv)
    kv_rows = torch.randn(5, g * d + g * dv)  # a replicated `kv_proj` output: [G*D | G*Dv]
    k_heads, v_heads = kv_rows[:, :g * d].view(5, g, d), kv_rows[:, g * d:].view(5, g, dv)
    for s in ranks(cfg, tp):
        if not s.groups_split:
            continue  # column-parallel: the projection already holds only this rank's heads
        k, v = s.own_kv(kv_rows)
        assert torch.equal(k, k_heads[:, s.kv_head]) and torch.equal(v, v_heads[:, s.kv_head])


def test_kv_report_counts_one_ranks_kv_heads():
    cfg = build_config("hysparse", "tiny", {"v_head_dim": 32})  # G=2, D=64, Dv=32
    full = cfg.kv_cache_layers()[0]
    assert f"HySparse KV cache: {full * 2 * 96 * 4} bytes/token" in kv_report(cfg, 4, None)
    # TP=2 splits the two KV heads; TP=4 replicates them (one per rank).
    for tp in (2, 4):
        line = kv_report(cfg, 4, 2**30, tp)
        assert line.startswith(f"HySparse KV cache per rank (tensor_parallel_size={tp}: 1 of 2 KV heads each): "
                               f"{full * 96 * 4} bytes/token"), line
        assert f"holds about {2**30 // (full * 96 * 4):,} tokens" in line
