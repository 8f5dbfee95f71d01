# SPDX-License-Identifier: Apache-2.0
"""Paged-cache writes and the batch plan / gathers, against explicit per-token loops."""

import itertools
import os
import random

import pytest
import torch

from csrc_triton import cpu_ext
from csrc_triton.paged_args import FP8_KV_DTYPE
from csrc_triton.paged_batch import gather_context, gather_request, gather_rows, make_plan
from vllm_hysparse.attention.paged import FP8_MAX, split_kv_cache, write_kv, write_kv_torch

SEED = int(os.environ.get("HYSPARSE_TEST_SEED", "0"))


@pytest.mark.parametrize("write", [write_kv, write_kv_torch], ids=["cpp", "torch"])
def test_write_kv_stores_every_valid_slot_and_skips_padding(write):
    gen = torch.Generator().manual_seed(0)
    pages, groups, page, dim = 6, 2, 4, 8
    kv = torch.full((pages, groups, page, 2 * dim), float("nan"))
    key_cache, value_cache = split_kv_cache(kv, dim)
    slots = torch.tensor([5, 9, -1, 23, 13, -1, 14])  # block 0 is the null block: never a real slot
    key, value = torch.randn(7, groups, dim, generator=gen), torch.randn(7, groups, dim, generator=gen)
    write(key_cache, value_cache, key, value, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(key_cache[s // page, :, s % page], key[i])
            assert torch.equal(value_cache[s // page, :, s % page], value[i])
    written = {s for s in slots.tolist() if s >= 0} | {0}  # padding goes to block 0 (vLLM's null block)
    for s in range(pages * page):
        if s not in written:
            assert key_cache[s // page, :, s % page].isnan().all(), s


@pytest.mark.parametrize("groups,dim,page", [(2, 64, 16), (1, 32, 8), (4, 48, 128)])
def test_write_kv_cpp_matches_torch_twin(groups, dim, page):
    """The C++ write (float32 pages) against the PyTorch twin: same values at every valid slot, from key / value
    views of one fused projection (strided rows, as the models pass them); the C++ write skips padding slots,
    where the twin writes vLLM's null block 0; a slot past the cache is refused before anything is written."""
    assert cpu_ext.load("sparse") is not None, "the C++ CPU kernel must build here (see csrc_triton/cpu_ext.py)"
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    pages, tokens = 7, 40
    fused = torch.randn(tokens + 3, 3 * groups * dim, generator=gen)  # q | k | v of 3 more (padding) rows
    key = fused[:, groups * dim:2 * groups * dim].view(-1, groups, dim)
    value = fused[:, 2 * groups * dim:].view(-1, groups, dim)
    slots = torch.randperm((pages - 1) * page, generator=gen)[:tokens] + page  # distinct, none in block 0
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1
    caches = []
    for write in (write_kv, write_kv_torch):
        kv = torch.full((pages, groups, page, 2 * dim), float("nan"))
        write(*split_kv_cache(kv, dim), key, value, slots)
        caches.append(kv)
    cpp, twin = caches
    assert torch.equal(cpp[1:].nan_to_num(7.0), twin[1:].nan_to_num(7.0)), "pages 1.. differ"
    assert cpp[0].isnan().all(), "padding rows must not be written"
    valid = int((slots >= 0).sum())
    assert int((~cpp.isnan()).all(-1).sum()) == valid * groups, "written (slot, group) pairs"
    before = cpp.clone()
    bad = slots.clone()
    bad[-1] = pages * page
    with pytest.raises(RuntimeError, match="past the cache"):
        write_kv(*split_kv_cache(cpp, dim), key + 1, value + 1, bad)
    assert torch.equal(cpp.nan_to_num(7.0), before.nan_to_num(7.0)), "a refused write changed the cache"


def test_write_kv_quantises_into_an_fp8_cache():
    """vLLM allocates kv_cache_dtype="fp8" caches as uint8: viewed as e4m3, written as x / scale, saturated."""
    gen = torch.Generator().manual_seed(2)
    pages, groups, page, dim, dim_v = 5, 2, 4, 8, 16
    kv = torch.full((pages, groups, page, dim + dim_v), 0x7F, dtype=torch.uint8)  # 0x7F: e4m3 NaN
    key_cache, value_cache = split_kv_cache(kv, dim)
    assert key_cache.dtype == value_cache.dtype == FP8_KV_DTYPE
    assert value_cache.shape[-1] == dim_v and key_cache.data_ptr() == kv.data_ptr()
    k_scale, v_scale = 0.05, 0.3
    slots = torch.tensor([4, 7, -1, 19])
    key = torch.randn(4, groups, dim, generator=gen) * 5
    key[0, 0, 0] = 1e4  # past e4m3's range at this scale: saturates, no NaN / inf
    value = torch.randn(4, groups, dim_v, generator=gen)
    write_kv(key_cache, value_cache, key, value, slots, k_scale, v_scale)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        k = key_cache[s // page, :, s % page].float()
        v = value_cache[s // page, :, s % page].float()
        want_k = (key[i] / k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE).float()
        assert torch.equal(k, want_k) and torch.equal(v, (value[i] / v_scale).to(FP8_KV_DTYPE).float())
        # e4m3 keeps 3 mantissa bits: within 2^-4 relative (plus the subnormal step) of the exact value
        close = (k * k_scale - key[i]).abs() <= key[i].abs() / 16 + 2**-9 * k_scale
        assert (close | (k.abs() == FP8_MAX)).all()
    assert key_cache[1, 0, 0, 0].float() == FP8_MAX
    # unwritten slots keep their bytes
    assert key_cache[2, :, 0].float().isnan().all()


def plan_by_loop(q_lens: list[int], seq_lens: list[int], num_tokens: int) -> dict:
    """Every row of every request, one at a time: its position, request, and the decode / prefill split. A request's
    rows in the step are the last of its `seq_len` positions (also when `num_tokens` cuts them short)."""
    rows, start = [], 0
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        kept = [start + i for i in range(q) if start + i < num_tokens]
        rows += [(row, r, s - len(kept) + i) for i, row in enumerate(kept)]
        start += q
    per_req = {r: [x for x in rows if x[1] == r] for r in range(len(q_lens))}
    return {"pos": [x[2] for x in rows], "req": [x[1] for x in rows],
            "decodes": [(v[0][0], r, seq_lens[r]) for r, v in per_req.items() if len(v) == 1],
            "prefills": [(r, v[0][0], v[-1][0] + 1, v[0][2]) for r, v in per_req.items() if len(v) > 1]}


@pytest.mark.parametrize("seed", range(4))
def test_plan_matches_a_loop_over_rows(seed):
    """Random steps, with requests of no rows this step and a row budget that cuts the last ones short."""
    rng = random.Random(1000 * SEED + seed)
    print(f"seed {SEED}, case {seed}")
    for _ in range(200):
        q_lens = [rng.choice([0, 1, 1, 1, 2, 7]) for _ in range(rng.randint(0, 9))]
        seq_lens = [q + rng.randint(0, 50) for q in q_lens]
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        num_tokens = rng.randint(0, sum(q_lens) + 3)
        plan = make_plan(qsl, torch.tensor(seq_lens, dtype=torch.int32), num_tokens, torch.device("cpu"))
        want = plan_by_loop(q_lens, seq_lens, num_tokens)
        got_decodes = list(zip(plan.decode_rows.tolist(), plan.decode_reqs.tolist(), plan.decode_lens.tolist()))
        assert plan.num_tokens == len(want["pos"]), (q_lens, seq_lens, num_tokens)
        assert plan.row_pos.tolist() == want["pos"] and plan.row_req.tolist() == want["req"], (q_lens, num_tokens)
        assert got_decodes == want["decodes"], (q_lens, seq_lens, num_tokens)
        assert plan.max_decode_len == max((d[2] for d in want["decodes"]), default=0)
        assert [(p.req, p.start, p.end, p.first_pos) for p in plan.prefills] == want["prefills"]
        assert all(t.dtype == torch.long for t in (plan.row_pos, plan.row_req, plan.decode_rows))


def test_plan_and_gathers_match_loops():
    gen = torch.Generator().manual_seed(1)
    page, groups, dim = 4, 2, 3
    q_lens, seq_lens = [3, 1, 0, 1, 5], [7, 9, 4, 1, 5]
    cache = torch.randn(30, groups, page, dim, generator=gen)
    block_table = torch.randperm(30, generator=gen)[:5 * 3].view(5, 3).to(torch.int32)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)  # [0, 3, 4, 4, 5, 10]
    plan = make_plan(qsl, torch.tensor(seq_lens, dtype=torch.int32), 12, torch.device("cpu"))
    assert plan.num_tokens == 10
    assert plan.row_pos.tolist() == [4, 5, 6, 8, 0, 0, 1, 2, 3, 4]
    assert plan.decode_rows.tolist() == [3, 4] and plan.decode_reqs.tolist() == [1, 3]
    assert plan.decode_lens.tolist() == [9, 1] and plan.max_decode_len == 9
    assert [(p.req, p.start, p.end, p.first_pos) for p in plan.prefills] == [(0, 0, 3, 4), (4, 5, 10, 0)]

    def key(r, j):
        return cache[block_table[r, j // page].long(), :, j % page]

    req = gather_request(cache, block_table[0], 7)
    assert all(torch.equal(req[:, j], key(0, j)) for j in range(7))
    ctx = gather_context(cache, block_table, torch.tensor([1, 0]), 9)
    assert all(torch.equal(ctx[0, :, j], key(1, j)) for j in range(9))
    assert all(torch.equal(ctx[1, :, j], key(0, j)) for j in range(7))
    positions = torch.randint(0, 9, (2, groups, 5), generator=gen)
    rows = gather_rows(cache, block_table, torch.tensor([1, 4]), positions)
    for i, r in enumerate([1, 4]):
        for g in range(groups):
            for s in range(5):
                assert torch.equal(rows[i, g, s], key(r, int(positions[i, g, s]))[g])
