# SPDX-License-Identifier: Apache-2.0
"""Sliding-window sink attention on the CPU (`csrc_triton/window.py`, the tiled window walk of
`oracle/cpu_tiled.cpp`) against float64 attention per row, and against the `window` role's PyTorch twin (the
token-sparse path over each row's window positions).

Windows of one key, a few keys, and wider than some contexts; prefill runs taller than a tile, decode rows,
padding rows, MQA and GQA, pages shorter and longer than a window, requests on shared pages; sinks drawn per head.
Outputs poisoned first, inputs drawn from a printed seed.
"""

import pytest
import torch

from csrc_triton.paged_batch import make_plan
from csrc_triton.token_sparse.batched import token_sparse_attention_batched
from csrc_triton.window import bind_window
from tests.kernel_utils import dense_causal, nan_out, share_prefix
from tests.kernels import oracle_cases as orc
from tests.kernels.test_oracle_tiled import CASES, SHARED
from vllm_hysparse.attention.backend import window_positions

SEED = 4700
WINDOWS = [1, 5, 33, 128]


def run_window(case, batch, q, sinks, window):
    n = sum(batch.q_lens)
    plan = make_plan(batch.query_start_loc, batch.seq_lens_t, n, q.device)
    run = bind_window(q, batch.k_cache, batch.v_cache, scale=case.head_dim ** -0.5, sinks=sinks, window=window)
    assert run is not None, "the C++ window walk must run on this case"
    out = nan_out(batch, q)
    run(q[:n], batch.block_table, plan, out[:n])
    assert out[n:].isnan().all(), "padding rows are the caller's (the backend zeroes them)"
    return out[:n]


def check(out, ref):
    assert not out.isnan().any(), "every row must be written"
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    close = ((out.double() - ref).abs() <= 1e-4 + 1e-4 * ref.abs()).float().mean().item()
    print(f"elements within tolerance: {close:.4f} of {out.numel()}")


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_window_matches_reference(case, window):
    seed = SEED + CASES.index(case) * len(WINDOWS) + WINDOWS.index(window)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    sinks = torch.randn(case.num_heads, generator=torch.Generator().manual_seed(seed))
    n = sum(batch.q_lens)
    check(run_window(case, batch, q, sinks, window), dense_causal(batch, q, case.head_dim ** -0.5, sinks, window)[:n])


@pytest.mark.parametrize("case, shares", SHARED[:3], ids=[str(c) for c, _ in SHARED[:3]])
def test_window_on_shared_pages(case, shares):
    """Decode rows on another request's pages read their own block table's keys (no prefix walk for a window)."""
    seed = SEED + 500 + [c for c, _ in SHARED].index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    share_prefix(batch, shares)  # the reference reads what the shared pages hold: the other request's keys
    sinks = torch.randn(case.num_heads, generator=torch.Generator().manual_seed(seed))
    n = sum(batch.q_lens)
    for window in (64, 300):
        check(run_window(case, batch, q, sinks, window),
              dense_causal(batch, q, case.head_dim ** -0.5, sinks, window)[:n])


@pytest.mark.parametrize("case", CASES[-2:], ids=str)
def test_window_matches_the_roles_pytorch_twin(case):
    """The C++ walk and the role's fallback (token-sparse attention over `window_positions`) agree."""
    seed = SEED + 700 + CASES.index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    sinks = torch.randn(case.num_heads, generator=torch.Generator().manual_seed(seed))
    n, window = sum(batch.q_lens), 48
    plan = make_plan(batch.query_start_loc, batch.seq_lens_t, n, q.device)
    ids = window_positions(plan.row_pos, n, case.num_kv_heads, window)
    twin = token_sparse_attention_batched(q[:n], batch.k_cache, batch.v_cache, batch.block_table,
                                          batch.query_start_loc, batch.seq_lens_t, ids, scale=case.head_dim ** -0.5,
                                          sinks=sinks, plan=plan)
    check(run_window(case, batch, q, sinks, window), twin.double())
