# SPDX-License-Identifier: Apache-2.0
"""The batched PyTorch twins (the CPU serving path) against the per-request naive twins, on every kernel test shape.

Both the gathered path (decode rows, long prefill runs) and the masked path
(short prefill runs) are run; outputs are poisoned with NaN first.
"""

import pytest
import torch

import csrc_triton.paged_batch as paged_batch
import csrc_triton.token_oracle.batched as token_oracle_batched
from csrc_triton import cpu_ext
from csrc_triton.block_sparse import block_sparse_attention_naive
from csrc_triton.block_sparse.batched import block_sparse_attention_batched
from csrc_triton.oracle import oracle_attention_naive
from csrc_triton.oracle.batched import oracle_attention_batched
from csrc_triton.paged_batch import make_plan
from csrc_triton.token_oracle import token_oracle_attention_naive
from csrc_triton.token_oracle.batched import select_tokens, token_oracle_attention_batched
from csrc_triton.token_oracle.naive import select_tokens as select_tokens_naive
from csrc_triton.token_sparse import token_sparse_attention_naive
from csrc_triton.token_sparse.batched import token_sparse_attention_batched
from tests.kernel_utils import DEVICE, dense_causal, nan_like, nan_out, share_pages
from tests.kernels import block_sparse_cases as bs
from tests.kernels import oracle_cases as orc
from tests.kernels import token_oracle_cases as tor
from tests.kernels import token_sparse_cases as ts


@pytest.fixture(params=["cpp", "masked", "gathered"])
def prefill_path(request, monkeypatch):
    """Sparse roles: the C++ kernel (every row, from the pages), or the PyTorch paths: short prefill runs
    take the masked path, and GATHER_FACTOR = 0 sends them down the gathered one (decode rows always are)."""
    if request.param == "cpp":
        assert cpu_ext.load("sparse") is not None, "the C++ CPU kernel must build here (see csrc_triton/cpu_ext.py)"
    else:
        monkeypatch.setattr(cpu_ext, "load", lambda name="sparse": None)
    if request.param == "gathered":
        monkeypatch.setattr(paged_batch, "GATHER_FACTOR", 0)
    return request.param


@pytest.fixture(params=["tiled", "onepass", "torch"])
def decode_path(request, monkeypatch):
    """Decode rows of the oracles: the C++ kernels (float32, interleaved pages), tiled (`oracle/cpu_tiled.cpp`)
    or, where that one is not built, one-pass (`oracle/cpu_decode.cpp`), or the gathered PyTorch path. With the
    tiled kernel, the token oracle runs every row (prefill too) through it and selects in C++
    (`token_oracle/cpu_select.cpp`); otherwise its prefill rows and its selection are PyTorch."""
    load = cpu_ext.load
    needed = {"tiled": ("oracle_tiled", "token_select"), "onepass": ("oracle_decode",), "torch": ()}
    for name in needed[request.param]:
        assert load(name) is not None, f"the C++ CPU kernel {name} must build here (see csrc_triton/cpu_ext.py)"
    if request.param == "onepass":
        monkeypatch.setattr(cpu_ext, "load",
                            lambda name="oracle_decode": None if name == "oracle_tiled" else load(name))
    elif request.param == "torch":
        monkeypatch.setattr(cpu_ext, "load", lambda name="oracle_decode": None)
    return request.param


def oracle_args(batch, q, case):
    return (q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t)


@pytest.mark.parametrize("case", orc.CASES + [orc.DECODE, orc.LONG], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_oracle(case, dtype, decode_path):
    batch, q = orc.make_inputs(case, dtype, seed=11)
    ref = orc.run(oracle_attention_naive, batch, q, case)
    out = nan_like(q)
    got = oracle_attention_batched(*oracle_args(batch, q, case), scale=case.head_dim ** -0.5,
                                   sparse_block_size=case.block_size, topk=case.topk, out=out)
    assert got[0] is out
    orc.check_against_naive(case, dtype, (*got, ref[2]), ref, batch)


def test_oracle_ties_go_to_smaller_blocks(decode_path):
    case = orc.Case([100, 1], [100, 37], block_size=16, topk=3)
    batch, q = orc.make_inputs(case, torch.float32)
    _, ids = oracle_attention_batched(*oracle_args(batch, torch.zeros_like(q), case), scale=case.head_dim ** -0.5,
                                      sparse_block_size=case.block_size, topk=case.topk)
    for t, pos in enumerate(batch.positions()):
        visible = pos // case.block_size + 1
        want = list(range(min(visible, case.topk))) + [-1] * max(0, case.topk - visible)
        assert ids[t].tolist() == [want] * case.num_kv_heads, (t, pos)


def test_oracle_with_plan_matches_without():
    case = orc.CASES[0]
    batch, q = orc.make_inputs(case, torch.float32, seed=5)
    kwargs = dict(scale=case.head_dim ** -0.5, sparse_block_size=case.block_size, topk=case.topk)
    plan = make_plan(batch.query_start_loc.cpu(), batch.seq_lens_t.cpu(), batch.num_tokens, q.device)
    a = oracle_attention_batched(*oracle_args(batch, q, case), **kwargs)
    b = oracle_attention_batched(*oracle_args(batch, q, case), plan=plan, **kwargs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("case", tor.CASES + [tor.LONG], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_oracle(case, dtype, reduce, decode_path):
    batch, q = tor.make_inputs(case, dtype, seed=12)
    ref = tor.run(token_oracle_attention_naive, batch, q, case, reduce)
    out = nan_like(q)
    got = tor.run(token_oracle_attention_batched, batch, q, case, reduce, out=out)
    assert got[0] is out
    tor.check_against_naive(case, dtype, reduce, got, ref, batch, q)


@pytest.mark.parametrize("case", tor.CASES + [tor.LONG], ids=str)
@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("one_pass_max_keys", [0, 1 << 30], ids=["two-passes", "one-pass"])
def test_token_oracle_prefill_passes(case, reduce, one_pass_max_keys, monkeypatch):
    """Prefill rows through the tiled kernel's second pass (R) or through its logits, whatever the run's length
    (as served, `ONE_PASS_MAX_KEYS` picks one by it): the same outputs and selections as the naive twin."""
    for name in ("oracle_tiled", "token_select"):
        assert cpu_ext.load(name) is not None, f"the C++ CPU kernel {name} must build here (see csrc_triton/cpu_ext.py)"
    monkeypatch.setattr(token_oracle_batched, "ONE_PASS_MAX_KEYS", one_pass_max_keys)
    batch, q = tor.make_inputs(case, torch.float32, seed=13)
    ref = tor.run(token_oracle_attention_naive, batch, q, case, reduce)
    got = tor.run(token_oracle_attention_batched, batch, q, case, reduce, out=nan_like(q))
    tor.check_against_naive(case, torch.float32, reduce, got, ref, batch, q)


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_oracle_shared_prefix(reduce, decode_path):
    """Decode rows whose block tables start with the same pages (vLLM's prefix cache): the tiled kernel walks
    the prefix once for all of them; the same outputs and selections as the naive twin."""
    case = tor.Case([1, 1, 1, 1, 1], [200, 180, 130, 97, 64], num_heads=6, num_kv_heads=2, head_dim=32,
                    page_size=16, topk=20, window=8)
    batch, q = tor.make_inputs(case, torch.float32, seed=31)
    share_pages(batch, {1: (0, 11), 2: (0, 8), 4: (0, 4)})  # request 4's context is the 4 shared pages: no tail
    ref = tor.run(token_oracle_attention_naive, batch, q, case, reduce)
    got = tor.run(token_oracle_attention_batched, batch, q, case, reduce, out=nan_like(q))
    tor.check_against_naive(case, torch.float32, reduce, got, ref, batch, q)


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_oracle_ties_go_to_smaller_positions(reduce, decode_path):
    case = tor.Case([40, 1, 1], [40, 30, 12], topk=5, window=4)
    batch, q = tor.make_inputs(case, torch.float32)
    _, ids = tor.run(token_oracle_attention_batched, batch, torch.zeros_like(q), case, reduce)
    for t, pos in enumerate(batch.positions()):
        start = max(0, pos - case.window + 1)
        want = list(range(min(case.topk, start))) + list(range(start, pos + 1))
        want += [-1] * (case.topk + case.window - len(want))
        assert ids[t].tolist() == [want] * case.num_kv_heads, (t, pos)


@pytest.mark.parametrize("topk,window", [(5, 4), (0, 6), (7, 0), (40, 3)])
def test_select_tokens_matches_sorting(topk, window):
    """Threshold-and-fill top-k equals the stable sort on scores full of exact ties (few distinct values)."""
    g = torch.Generator().manual_seed(topk * 31 + window)
    r = torch.randint(0, 4, (50, 3, 37), generator=g).float() / 4
    pos = torch.randint(0, 37, (50,), generator=g)
    got = select_tokens(r, pos, topk, window)
    want = select_tokens_naive(r, pos, topk, window)
    assert torch.equal(got, want.long())


@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("topk,window", [(5, 4), (0, 6), (7, 0), (40, 3), (1, 1)])
def test_cpp_token_select_matches_sorting(topk, window, reduce):
    """`cpu_select.cpp` from logits and lse equals the naive stable sort of R = reduce_h exp(z_h - lse_h), on
    logits of a few distinct values (exact ties everywhere, some -inf) and rows at every position; every slot of
    the poisoned output is written."""
    seed = int(torch.randint(1 << 30, ()))
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    n, groups, per_group, length = 60, 3, 2, 37
    z = torch.randint(-3, 1, (n, groups * per_group, length), generator=g).float()
    z[torch.rand(z.shape, generator=g) < 0.1] = float("-inf")
    lse = torch.randn(n, groups * per_group, generator=g)
    pos = torch.randint(0, length, (n,), generator=g)
    ids = torch.full((n, groups, topk + window), 1 << 20, dtype=torch.int32)
    cpu_ext.load("token_select").token_select(z, lse, pos, groups, topk, window, reduce == "sum", ids)
    p = torch.exp(z - lse[..., None]).view(n, groups, per_group, length)
    r = p.amax(dim=2) if reduce == "max" else p.sum(dim=2)
    want = select_tokens_naive(r, pos, topk, window)
    assert torch.equal(ids.long(), want.long()), f"{(ids.long() != want.long()).any(-1).sum()} of {n * groups} differ"


# family -> (its case module, random selection of a batch, naive twin, batched twin)
SPARSE = {
    "block": (bs, lambda b, c, seed: bs.random_blocks(b, c.num_kv_heads, c.block_size, c.topk, seed=seed),
              block_sparse_attention_naive, block_sparse_attention_batched),
    "token": (ts, lambda b, c, seed: ts.random_tokens(b, c.num_kv_heads, c.window, c.topk, seed=seed),
              token_sparse_attention_naive, token_sparse_attention_batched),
}


@pytest.mark.parametrize("family,case", [("block", c) for c in bs.CASES] + [("token", c) for c in ts.CASES],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sparse(family, case, use_sinks, dtype, prefill_path):
    module, selection, naive, batched = SPARSE[family]
    batch, q, sinks = module.make_inputs(case, dtype, seed=13)
    sinks = sinks if use_sinks else None
    ids = selection(batch, case, 13)
    ref = module.run(naive, batch, q, ids, case, sinks)
    out = nan_like(q)
    got = module.run(batched, batch, q, ids, case, sinks, out=out)
    assert got is out and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


# Prefill runs taller than the C++ sparse kernel's row tile (63 rows, a bit each in a 64-bit key mask): rows past
# bit 31 and a second tile of one request, with selections that differ from row to row.
TALL = {"block": bs.Case([150, 1], [200, 90], block_size=16, topk=3),
        "token": ts.Case([140, 1], [170, 60], window=6, topk=20)}


@pytest.mark.parametrize("family", list(TALL))
@pytest.mark.parametrize("use_sinks", [False, True])
def test_sparse_tall_prefill(family, use_sinks):
    module, selection, naive, batched = SPARSE[family]
    case = TALL[family]
    batch, q, sinks = module.make_inputs(case, torch.float32, seed=29)
    sinks = sinks if use_sinks else None
    ids = selection(batch, case, 29)
    ref = module.run(naive, batch, q, ids, case, sinks)
    got = module.run(batched, batch, q, ids, case, sinks, out=nan_like(q))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# Decode rows on shared prefixes (vLLM's prefix cache gives requests the same leading pages): request -> (the
# request whose pages it starts with, how many). The C++ kernel loads the keys they selected in the prefix once
# for all of them, and each row's keys past it from its own pages; one row's context ends with the prefix.
SHARED = {"block": (bs.Case([7, 1, 1, 1, 1, 1], [7, 300, 260, 290, 128, 40], num_heads=6, num_kv_heads=2,
                            block_size=16, topk=6), {2: (1, 12), 3: (1, 12), 4: (1, 8), 5: (1, 2)}),
          "token": (ts.Case([1, 1, 1, 1], [230, 200, 161, 90], window=6, topk=40), {1: (0, 12), 2: (0, 10)})}


@pytest.mark.parametrize("family", list(SHARED))
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("same_picks", [True, False], ids=["same-picks", "own-picks"])
def test_sparse_shared_prefix(family, use_sinks, same_picks):
    """`same_picks`: the rows on a prefix select what its first row does (where they can see it), so the kernel
    serves them as one task; with their own random picks they may overlap too little, and then run a task each."""
    assert cpu_ext.load("sparse") is not None, "the C++ CPU kernel must build here (see csrc_triton/cpu_ext.py)"
    module, selection, naive, batched = SPARSE[family]
    case, shares = SHARED[family]
    batch, q, sinks = module.make_inputs(case, torch.float32, seed=37)
    share_pages(batch, shares)
    sinks = sinks if use_sinks else None
    ids = selection(batch, case, 37)
    if same_picks:
        span = case.block_size if family == "block" else 1
        row = batch.query_start_loc[1:].long() - 1  # each request's last (here: its decode) row
        for req, (src, _) in shares.items():
            picks = ids[row[src]].clone()
            picks[picks * span > case.seq_lens[req] - 1] = -1  # what this row cannot see
            last = torch.iinfo(torch.int32).max  # -1 sorts after every id
            picks = torch.where(picks < 0, last, picks).sort(-1).values
            ids[row[req]] = torch.where(picks == last, -1, picks)
    ref = module.run(naive, batch, q, ids, case, sinks)
    got = module.run(batched, batch, q, ids, case, sinks, out=nan_like(q))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _cpp_takes(batch, prefill_path) -> None:
    """The `cpp` arm must reach the C++ kernel: vLLM's interleaved float32 pages with D_k == D_v."""
    if prefill_path == "cpp":
        assert paged_batch.cpu_kernel_pages(batch.k_cache, batch.v_cache) is not None, "not a C++ kernel case"


@pytest.mark.parametrize("case", [bs.CASES[0], bs.CASES[4]], ids=str)
def test_block_sparse_all_blocks_is_dense_causal(case, prefill_path):
    batch, q, sinks = bs.make_inputs(case, torch.float32, seed=3)
    if case is bs.CASES[0]:
        _cpp_takes(batch, prefill_path)
    ids = bs.all_blocks(batch, case.num_kv_heads, case.block_size)
    ref = dense_causal(batch, q, case.head_dim ** -0.5, sinks).float().to(DEVICE)
    got = bs.run(block_sparse_attention_batched, batch, q, ids, case, sinks, out=nan_like(q))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_block_sparse_into_a_strided_out(prefill_path):
    """An output buffer that is a strided view (every other half-row of a wider one): the rows land in it, and
    nothing around it is written (the C++ kernel writes contiguous buffers in place, others through a copy)."""
    case = bs.CASES[0]
    batch, q, sinks = bs.make_inputs(case, torch.float32, seed=5)
    _cpp_takes(batch, prefill_path)
    ids = bs.all_blocks(batch, case.num_kv_heads, case.block_size)
    ref = dense_causal(batch, q, case.head_dim ** -0.5, sinks).float().to(DEVICE)
    wide = torch.full((*q.shape[:2], 2 * q.shape[2]), float("nan"), device=q.device)
    out = wide[..., q.shape[2]:]
    assert not out.is_contiguous()
    got = bs.run(block_sparse_attention_batched, batch, q, ids, case, sinks, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert wide[..., :q.shape[2]].isnan().all(), "the kernel wrote outside its output view"


# ----------------------------------------------------------------------------- D_k != D_v (SPEC §2.6)


def test_cpu_kernels_fall_back_when_head_dims_differ():
    """The C++ kernels read V as wide as K; a D_k != D_v layout takes the PyTorch path (still one gather)."""
    case = orc.V_CASES[0]
    batch, _ = orc.make_inputs(case, torch.float32)
    assert paged_batch.interleaved(batch.k_cache, batch.v_cache) is not None
    assert paged_batch.cpu_kernel_pages(batch.k_cache, batch.v_cache) is None


@pytest.mark.parametrize("case", orc.V_CASES, ids=str)
def test_oracle_separate_v_head_dim(case, decode_path):
    batch, q = orc.make_inputs(case, torch.float32, seed=11)
    ref = orc.run(oracle_attention_naive, batch, q, case)
    out = nan_out(batch, q)
    got = oracle_attention_batched(*oracle_args(batch, q, case), scale=case.head_dim ** -0.5,
                                   sparse_block_size=case.block_size, topk=case.topk, out=out)
    assert got[0] is out
    orc.check_against_naive(case, torch.float32, (*got, ref[2]), ref, batch)


@pytest.mark.parametrize("case", tor.V_CASES, ids=str)
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_oracle_separate_v_head_dim(case, reduce, decode_path):
    batch, q = tor.make_inputs(case, torch.float32, seed=12)
    ref = tor.run(token_oracle_attention_naive, batch, q, case, reduce)
    got = tor.run(token_oracle_attention_batched, batch, q, case, reduce, out=nan_out(batch, q))
    tor.check_against_naive(case, torch.float32, reduce, got, ref, batch, q)


@pytest.mark.parametrize("family,case", [("block", c) for c in bs.V_CASES] + [("token", c) for c in ts.V_CASES],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("use_sinks", [False, True])
def test_sparse_separate_v_head_dim(family, case, use_sinks, prefill_path):
    """Masked (CPU flash with zero-padded head dims), gathered and, where asked, C++ (falls back) paths."""
    module, selection, naive, batched = SPARSE[family]
    batch, q, sinks = module.make_inputs(case, torch.float32, seed=13)
    sinks = sinks if use_sinks else None
    ids = selection(batch, case, 13)
    ref = module.run(naive, batch, q, ids, case, sinks)
    out = nan_out(batch, q)
    got = module.run(batched, batch, q, ids, case, sinks, out=out)
    assert got is out and not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
