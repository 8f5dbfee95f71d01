# SPDX-License-Identifier: Apache-2.0
"""FP8 (e4m3) KV caches: every kernel path against its naive twin on the dequantised cache, and the error bound.

An FP8 cache holds `K / k_scale` and `V / v_scale` as float8_e4m3fn (vLLM's
`kv_cache_dtype="fp8"`). Each kernel, given the FP8 cache and the scales, must
give what its naive twin gives on the float32 cache `fp8 * scale`: the same
math, so the oracle selections are compared as tightly as on float caches.
Scales are random (log-uniform), unwritten slots stay NaN (e4m3 has a NaN), outputs
are poisoned. Triton runs under the interpreter here, which loads e4m3; on sm_90 the same
launches are compiled by tests/kernels_aot.
"""

import dataclasses
import math

import pytest
import torch

from csrc_triton.block_sparse import block_sparse_attention, block_sparse_attention_naive
from csrc_triton.block_sparse.batched import block_sparse_attention_batched
from csrc_triton.oracle import oracle_attention, oracle_attention_naive
from csrc_triton.oracle.batched import oracle_attention_batched
from csrc_triton.paged_args import FP8_KV_DTYPE, check_paged_batch
from csrc_triton.token_oracle import token_oracle_attention, token_oracle_attention_naive
from csrc_triton.token_oracle.batched import token_oracle_attention_batched
from csrc_triton.token_sparse import token_sparse_attention, token_sparse_attention_naive
from csrc_triton.token_sparse.batched import token_sparse_attention_batched
from tests.kernel_utils import nan_out
from tests.kernels import block_sparse_cases as bs
from tests.kernels import oracle_cases as orc
from tests.kernels import token_oracle_cases as tor
from tests.kernels import token_sparse_cases as ts
from vllm_hysparse.attention.paged import FP8_MAX, to_cache


def random_scale(g: torch.Generator) -> float:
    """Log-uniform in [0.01, 0.6]: randn data / 0.01 reaches e4m3's saturation (448), / 0.6 its subnormals."""
    return math.exp(math.log(0.01) + float(torch.rand((), generator=g)) * math.log(60.0))


def quantise(x: torch.Tensor, scale: float) -> torch.Tensor:
    return to_cache(x, FP8_KV_DTYPE, scale)


def fp8_batch(batch, seed):
    """(FP8 batch, its dequantised twin in the batch's dtype, k_scale, v_scale) of a float batch, same page layout."""
    g = torch.Generator().manual_seed(seed + 7)
    k_scale, v_scale = random_scale(g), random_scale(g)
    d, dv = batch.k_cache.shape[-1], batch.v_cache.shape[-1]
    full = torch.as_strided(batch.k_cache, (*batch.k_cache.shape[:3], d + dv), batch.k_cache.stride())
    stored = torch.empty_strided(full.shape, full.stride(), dtype=FP8_KV_DTYPE, device=full.device)
    stored[..., :d] = quantise(full[..., :d], k_scale)  # NaN (unwritten) stays NaN
    stored[..., d:] = quantise(full[..., d:], v_scale)
    deq = stored.float()
    deq[..., :d] *= k_scale
    deq[..., d:] *= v_scale
    deq = deq.to(full.dtype)
    quant = dataclasses.replace(batch, k_cache=stored[..., :d], v_cache=stored[..., d:])
    ref = dataclasses.replace(
        batch, k_cache=deq[..., :d], v_cache=deq[..., d:],
        keys=[(quantise(k, k_scale).float() * k_scale).to(k.dtype) for k in batch.keys],
        values=[(quantise(v, v_scale).float() * v_scale).to(v.dtype) for v in batch.values])
    return quant, ref, k_scale, v_scale


@pytest.fixture(params=["triton", "torch"])
def path(request):
    """The Triton kernels (interpreter on CPU) or the batched PyTorch twins (the CPU serving path)."""
    return request.param


def scaled(fn, k_scale, v_scale):
    def call(*args, **kwargs):
        return fn(*args, k_scale=k_scale, v_scale=v_scale, **kwargs)
    return call


ORACLE_CASES = [orc.CASES[0], orc.DECODE, orc.V_CASES[0]]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=str)
def test_oracle(case, path):
    batch, q = orc.make_inputs(case, torch.float32, seed=21)
    quant, ref_batch, k_scale, v_scale = fp8_batch(batch, 21)
    ref = orc.run(oracle_attention_naive, ref_batch, q, case)
    out = nan_out(batch, q)
    if path == "triton":
        got = orc.run(scaled(oracle_attention, k_scale, v_scale), quant, q, case, out=out)
    else:
        got = oracle_attention_batched(q, quant.k_cache, quant.v_cache, quant.block_table, quant.query_start_loc,
                                       quant.seq_lens_t, scale=case.head_dim ** -0.5, k_scale=k_scale,
                                       v_scale=v_scale, sparse_block_size=case.block_size, topk=case.topk, out=out)
        got = (*got, ref[2])
    assert got[0] is out
    orc.check_against_naive(case, torch.float32, got, ref, ref_batch)


TOKEN_ORACLE_CASES = [tor.CASES[0], tor.CASES[2], tor.V_CASES[0]]


@pytest.mark.parametrize("case", TOKEN_ORACLE_CASES, ids=str)
def test_token_oracle(case, path):
    batch, q = tor.make_inputs(case, torch.float32, seed=22)
    quant, ref_batch, k_scale, v_scale = fp8_batch(batch, 22)
    ref = tor.run(token_oracle_attention_naive, ref_batch, q, case)
    fn = token_oracle_attention if path == "triton" else token_oracle_attention_batched
    out = nan_out(batch, q)
    got = tor.run(scaled(fn, k_scale, v_scale), quant, q, case, out=out)
    assert got[0] is out
    tor.check_against_naive(case, torch.float32, "max", got, ref, ref_batch, q)


# family -> (case module, selection, naive, Triton, batched)
SPARSE = {
    "block": (bs, lambda b, c: bs.random_blocks(b, c.num_kv_heads, c.block_size, c.topk, seed=23),
              block_sparse_attention_naive, block_sparse_attention, block_sparse_attention_batched),
    "token": (ts, lambda b, c: ts.random_tokens(b, c.num_kv_heads, c.window, c.topk, seed=23),
              token_sparse_attention_naive, token_sparse_attention, token_sparse_attention_batched),
}
SPARSE_CASES = [("block", bs.CASES[0]), ("block", bs.V_CASES[1]), ("token", ts.CASES[0]), ("token", ts.V_CASES[0])]


@pytest.mark.parametrize("family,case", SPARSE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sparse(family, case, dtype, path):
    """With sinks; the PyTorch path's short prefills take the masked path, decode rows the gathered one.
    fp16 queries take the Triton kernels' GPU branch (e4m3 widened to fp16, dot in fp16)."""
    module, selection, naive, triton_fn, batched = SPARSE[family]
    batch, q, sinks = module.make_inputs(case, dtype, seed=23)
    quant, ref_batch, k_scale, v_scale = fp8_batch(batch, 23)
    ids = selection(batch, case)
    ref = module.run(naive, ref_batch, q, ids, case, sinks)
    out = nan_out(batch, q)
    got = module.run(scaled(triton_fn if path == "triton" else batched, k_scale, v_scale), quant, q, ids, case,
                     sinks, out=out)
    assert got is out and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_cpu_kernels_take_the_pytorch_path_for_fp8():
    """The C++ kernels read float32 pages: an FP8 cache never reaches them (see `paged_batch.cpu_kernel_pages`)."""
    from csrc_triton.paged_batch import cpu_kernel_pages

    batch, _ = orc.make_inputs(orc.CASES[0], torch.float32)
    quant, _, _, _ = fp8_batch(batch, 0)
    assert cpu_kernel_pages(batch.k_cache, batch.v_cache) is not None
    assert cpu_kernel_pages(quant.k_cache, quant.v_cache) is None


@pytest.mark.parametrize("path_", ["triton", "torch"])
def test_error_bound_against_the_float_cache(path_):
    """FP8 vs the unquantised float32 cache, at unit scales' worst and a calibrated scale.

    e4m3 keeps 3 mantissa bits: each stored element is off by at most 2^-4 of itself
    (saturation aside). The output mixes values with weights from perturbed logits, so its
    error stays of that order; at `scale = max|x| / 448` (calibrated, no saturation) the relative
    error of the whole output must be under 5% and every row within 0.25 of the float result.
    """
    case = bs.CASES[0]
    batch, q, sinks = bs.make_inputs(case, torch.float32, seed=24)
    ids = bs.random_blocks(batch, case.num_kv_heads, case.block_size, case.topk, seed=24)
    fn = block_sparse_attention if path_ == "triton" else block_sparse_attention_batched
    exact = bs.run(fn, batch, q, ids, case, sinks)
    finite = batch.k_cache.nan_to_num(0.0).abs().amax(), batch.v_cache.nan_to_num(0.0).abs().amax()
    k_scale, v_scale = (float(m) / FP8_MAX for m in finite)
    quant = dataclasses.replace(batch, k_cache=quantise(batch.k_cache, k_scale),
                                v_cache=quantise(batch.v_cache, v_scale))
    got = bs.run(scaled(fn, k_scale, v_scale), quant, q, ids, case, sinks, out=nan_out(batch, q))
    err = (got - exact).norm() / exact.norm()
    assert 0 < err < 0.05, f"relative error {err:.4f}"
    assert (got - exact).abs().amax() < 0.25
    # and the scales matter: ignoring them is far off
    wrong = bs.run(fn, quant, q, ids, case, sinks)
    assert (wrong - exact).norm() / exact.norm() > 0.5


def test_mixed_or_other_fp8_caches_are_refused():
    batch, q = orc.make_inputs(orc.CASES[0], torch.float32)
    quant, _, _, _ = fp8_batch(batch, 0)
    args = (batch.block_table, batch.query_start_loc, batch.seq_lens_t, None)
    with pytest.raises(AssertionError, match="k_cache/v_cache must both have"):
        check_paged_batch(q, quant.k_cache, batch.v_cache, *args)
    with pytest.raises(AssertionError, match="k_cache/v_cache must both have"):
        check_paged_batch(q, *(c.view(torch.float8_e5m2) for c in (quant.k_cache, quant.v_cache)), *args)
    check_paged_batch(q, quant.k_cache, quant.v_cache, *args)
