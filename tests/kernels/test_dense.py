# SPDX-License-Identifier: Apache-2.0
"""Plain causal attention on the HySparse kernels (`csrc_triton/dense.py`) against float64 attention per row.

The CPU path (the tiled oracle kernel with one block and an empty top-k, then its PyTorch fallback), shared
prefixes included, and the Triton path; outputs poisoned first, inputs drawn from a printed seed.
"""

import pytest
import torch

from csrc_triton.dense import dense_attention, dense_attention_batched
from csrc_triton.oracle.batched import tiled_kernel
from tests.kernel_utils import Case, dense_causal, nan_out, share_prefix
from tests.kernels import oracle_cases as orc
from tests.kernels.test_oracle_tiled import CASES as TILED_CASES
from tests.kernels.test_oracle_tiled import SHARED

SEED = 4200


def check(case, batch, q, out):
    """`out` against float64 attention over each request's own keys; padding rows are zero."""
    ref = dense_causal(batch, q, case.head_dim ** -0.5, None)
    n = sum(batch.q_lens)
    assert not out.isnan().any(), "every row must be written"
    torch.testing.assert_close(out[:n].double(), ref[:n], atol=1e-4, rtol=1e-4)
    close = ((out[:n].double() - ref[:n]).abs() <= 1e-4 + 1e-4 * ref[:n].abs()).float().mean().item()
    print(f"elements within tolerance: {close:.4f} of {out[:n].numel()}")
    assert (out[n:] == 0).all()


def run(fn, case, batch, q, **kwargs):
    out = nan_out(batch, q)
    got = fn(q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t,
             scale=case.head_dim ** -0.5, out=out, **kwargs)
    assert got is out, "the output goes straight into the given buffer"
    return out


@pytest.mark.parametrize("case", TILED_CASES, ids=str)
def test_tiled_dense_matches_reference(case):
    seed = SEED + TILED_CASES.index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    assert tiled_kernel(q, batch.k_cache, batch.v_cache) is not None, "the C++ tiled kernel must run on this case"
    check(case, batch, q, run(dense_attention_batched, case, batch, q))


@pytest.mark.parametrize("case, shares", SHARED, ids=[str(c) for c, _ in SHARED])
def test_tiled_dense_shared_prefix(case, shares):
    """Decode rows on shared pages: walked once for the prefix, then per row, as if each read its own pages."""
    seed = SEED + 100 + [c for c, _ in SHARED].index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    share_prefix(batch, shares)  # the reference reads what the shared pages hold: the other request's keys
    check(case, batch, q, run(dense_attention_batched, case, batch, q))


FALLBACK = [
    # SPEC §2.6: V narrower than K, which the C++ kernel does not read
    Case([64, 20, 1, 1], [64, 47, 17, 33], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([5, 1, 1], [300, 97, 2], num_heads=8, num_kv_heads=2, head_dim=64),
]


@pytest.mark.parametrize("case", FALLBACK, ids=str)
def test_fallback_dense_matches_reference(case, monkeypatch):
    """Where the tiled kernel does not apply, the oracle's PyTorch path gives the same attention."""
    monkeypatch.setattr("csrc_triton.oracle.batched.tiled_kernel", lambda *args: None)
    seed = SEED + 200 + FALLBACK.index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    check(case, batch, q, run(dense_attention_batched, case, batch, q))


@pytest.mark.parametrize("case", [orc.CASES[0], orc.DECODE, FALLBACK[0]], ids=str)
def test_triton_dense_matches_reference(case):
    seed = SEED + 300 + [orc.CASES[0], orc.DECODE, FALLBACK[0]].index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    check(case, batch, q, run(dense_attention, case, batch, q, max_seq_len=max(case.seq_lens)))
