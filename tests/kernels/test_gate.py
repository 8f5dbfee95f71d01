# SPDX-License-Identifier: Apache-2.0
"""Gated rows of the C++ sparse and window kernels (`csrc_triton/cpu_gate.h`) and of the Triton block-sparse and
token-sparse kernels (`store_rows`) against float64 attention through float64 gates, and against each kernel's
ungated rows through `gated_store`, the PyTorch twin.

Elementwise gates and headwise ones (one per head, expanded over the head dim); a kernel storing its gated rows
over poisoned outputs, or adding them to rows already there; the two branches of a HySparse sparse layer chained
as its op runs them (window first, then the global branch adding its own). Gates drawn wide enough to saturate the
sigmoid both ways. Inputs drawn from a printed seed.
"""

import pytest
import torch

from csrc_triton.block_sparse.batched import bind_block_sparse
from csrc_triton.paged_batch import gated_store, make_plan
from csrc_triton.window import bind_window
from tests.kernel_utils import dense_causal, nan_out
from tests.kernels import oracle_cases as orc
from tests.kernels.block_sparse_cases import CASES as BS_CASES
from tests.kernels.block_sparse_cases import all_blocks
from tests.kernels.test_oracle_tiled import CASES

SEED = 5100
MODES = ["elementwise", "headwise"]


def draw(case, seed, mode):
    """Inputs, sinks and a gate `[T, H, Dv]` (headwise: `[T, H, 1]` expanded, its last stride 0)."""
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(case.num_heads, generator=g)
    width = batch.v_cache.shape[-1] if mode == "elementwise" else 1
    gate = 6 * torch.randn(q.shape[0], case.num_heads, width, generator=g)  # sigmoid near 0 and near 1 too
    return batch, q, sinks, gate.expand(-1, -1, batch.v_cache.shape[-1])


def kernels(case, batch, q, sinks, window):
    """(window run, block-sparse run over every visible block, plan, block ids)."""
    n = sum(batch.q_lens)
    scale = case.head_dim ** -0.5
    plan = make_plan(batch.query_start_loc, batch.seq_lens_t, n, q.device)
    win = bind_window(q, batch.k_cache, batch.v_cache, scale=scale, sinks=sinks, window=window)
    glob = bind_block_sparse(q, batch.k_cache, batch.v_cache, scale=scale, sparse_block_size=case.block_size,
                             sinks=sinks)
    assert win is not None and glob is not None, "both C++ kernels must run on this case"
    ids = all_blocks(batch, case.num_kv_heads, case.block_size)[:n].contiguous()
    return win, glob, plan, ids


def check(out, ref, what):
    assert not out.isnan().any(), f"{what}: every row must be written"
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    close = ((out.double() - ref).abs() <= 1e-4 + 1e-4 * ref.abs()).float().mean().item()
    print(f"{what}: elements within tolerance: {close:.4f} of {out.numel()}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES[-4:], ids=str)
def test_gated_rows_match_reference(case, mode):
    """Each kernel's gated rows: stored over poison, and added to rows already there."""
    seed = SEED + CASES.index(case) * len(MODES) + MODES.index(mode)
    print(f"seed {seed}")
    batch, q, sinks, gate = draw(case, seed, mode)
    n, window = sum(batch.q_lens), 48
    win, glob, plan, ids = kernels(case, batch, q, sinks, window)
    s = torch.sigmoid(gate[:n].double())
    prior = torch.randn(n, case.num_heads, batch.v_cache.shape[-1], generator=torch.Generator().manual_seed(seed))
    scale = case.head_dim ** -0.5
    for name, run, ref in (("window", lambda o, **kw: win(q[:n], batch.block_table, plan, o, **kw),
                            dense_causal(batch, q, scale, sinks, window)[:n]),
                           ("block-sparse", lambda o, **kw: glob(q[:n], batch.block_table, plan, o, ids, **kw),
                            dense_causal(batch, q, scale, sinks)[:n])):
        stored = nan_out(batch, q)[:n]
        run(stored, gate=gate[:n])
        check(stored, s * ref, f"{name}, stored")
        added = prior.clone()
        run(added, gate=gate[:n], accumulate=True)
        check(added, prior.double() + s * ref, f"{name}, added")
        plain = nan_out(batch, q)[:n]
        run(plain)
        twin = gated_store(prior.clone(), plain, gate[:n], accumulate=True)
        torch.testing.assert_close(added, twin, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES[-4:], ids=str)
def test_sparse_layer_mix(case, mode):
    """A sparse layer's two branches in one buffer, as its op runs them: sigmoid(g_sparse) * global +
    sigmoid(g_swa) * window."""
    seed = SEED + 100 + CASES.index(case) * len(MODES) + MODES.index(mode)
    print(f"seed {seed}")
    batch, q, sinks, g_swa = draw(case, seed, mode)
    g_sparse = draw(case, seed + 1, mode)[3]
    n, window = sum(batch.q_lens), 33
    win, glob, plan, ids = kernels(case, batch, q, sinks, window)
    out = nan_out(batch, q)[:n]
    win(q[:n], batch.block_table, plan, out, gate=g_swa[:n])
    glob(q[:n], batch.block_table, plan, out, ids, gate=g_sparse[:n], accumulate=True)
    scale = case.head_dim ** -0.5
    ref = (torch.sigmoid(g_sparse[:n].double()) * dense_causal(batch, q, scale, sinks)[:n]
           + torch.sigmoid(g_swa[:n].double()) * dense_causal(batch, q, scale, sinks, window)[:n])
    check(out, ref, "both branches")


def test_bad_gates_are_refused():
    case = CASES[-1]
    batch, q, sinks, gate = draw(case, SEED + 200, "elementwise")
    n = sum(batch.q_lens)
    win, glob, plan, ids = kernels(case, batch, q, sinks, 16)
    out = nan_out(batch, q)[:n]
    with pytest.raises(RuntimeError, match="accumulate: only with a gate"):
        glob(q[:n], batch.block_table, plan, out, ids, accumulate=True)
    with pytest.raises(RuntimeError, match="gate: expected"):
        win(q[:n], batch.block_table, plan, out, gate=gate[: n - 1])
    with pytest.raises(RuntimeError, match="gate: expected"):
        glob(q[:n], batch.block_table, plan, out, ids, gate=gate[:n].double())


# ---------------------------------------------------------------- the Triton twins (`store_rows`)
def triton_kernel(name, case, batch, q, sinks):
    """`run(out, **kw)`: the Triton kernel `name` over every visible key of each row (all blocks, all positions)."""
    from csrc_triton.block_sparse import block_sparse_attention
    from csrc_triton.token_sparse import token_sparse_attention

    args = (q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t)
    scale = case.head_dim ** -0.5
    if name == "block_sparse":
        ids = all_blocks(batch, case.num_kv_heads, case.block_size)
        return lambda out, **kw: block_sparse_attention(*args, ids, scale=scale, sparse_block_size=case.block_size,
                                                        sinks=sinks, out=out, **kw)
    ids = all_blocks(batch, case.num_kv_heads, 1)  # blocks of one position: every position up to each row's
    return lambda out, **kw: token_sparse_attention(*args, ids, scale=scale, sinks=sinks, out=out, **kw)


TRITON_KERNELS = ["block_sparse", "token_sparse"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", TRITON_KERNELS)
@pytest.mark.parametrize("case", [BS_CASES[0], BS_CASES[4]], ids=str)
def test_triton_gated_rows(case, name, mode):
    """The Triton kernels' gated rows, padding rows included: stored over poison, added to rows already there,
    and the same as their plain rows through `gated_store`."""
    seed = SEED + 300 + BS_CASES.index(case) * 4 + TRITON_KERNELS.index(name) * 2 + MODES.index(mode)
    print(f"seed {seed}")
    batch, q, sinks, gate = draw(case, seed, mode)
    run = triton_kernel(name, case, batch, q, sinks)
    ref = dense_causal(batch, q, case.head_dim ** -0.5, sinks)  # 0 past the last request's rows
    s = torch.sigmoid(gate.double())
    prior = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
    stored = nan_out(batch, q)
    assert run(stored, gate=gate) is stored
    check(stored, s * ref, f"{name}, stored")
    added = prior.clone()
    run(added, gate=gate, accumulate=True)
    check(added, prior.double() + s * ref, f"{name}, added")
    n = sum(batch.q_lens)
    assert n < q.shape[0] and torch.equal(added[n:], prior[n:]), "padding rows: a gated term of 0 adds nothing"
    twin = gated_store(prior.clone(), run(nan_out(batch, q)), gate, accumulate=True)
    torch.testing.assert_close(added, twin, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", TRITON_KERNELS)
def test_triton_gate_with_v_scale(name):
    """`kv_scaled`'s v_scale multiplies the attention, not the rows a gated store adds to."""
    case = BS_CASES[0]
    batch, q, sinks, gate = draw(case, SEED + 400, "elementwise")
    run = triton_kernel(name, case, batch, q, sinks)
    ref = dense_causal(batch, q, case.head_dim ** -0.5, sinks)
    prior = torch.randn(ref.shape, generator=torch.Generator().manual_seed(SEED + 400))
    added = prior.clone()
    run(added, gate=gate, accumulate=True, v_scale=2.5)
    check(added, prior.double() + torch.sigmoid(gate.double()) * 2.5 * ref, f"{name}, v_scale 2.5, added")


@pytest.mark.parametrize("name", TRITON_KERNELS)
def test_triton_bad_gates_are_refused(name):
    case = BS_CASES[0]
    batch, q, sinks, gate = draw(case, SEED + 500, "elementwise")
    run = triton_kernel(name, case, batch, q, sinks)
    with pytest.raises(AssertionError, match="accumulate: only with a gate"):
        run(nan_out(batch, q), accumulate=True)
    with pytest.raises(AssertionError, match="gate: expected"):
        run(nan_out(batch, q), gate=gate[:-1])
