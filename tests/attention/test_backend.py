# SPDX-License-Identifier: Apache-2.0
"""The backend's CPU serving path: every role's forward, with its C++ kernel bound to the layer's cache, against
the naive twins; and the page layout the backend asks vLLM for.

The forwards run outside an engine, on paged batches of the kernel tests (prefill, chunked prefill and decode
rows, padding rows past the last request), with the metadata vLLM's builder would hand them.
"""

import os

import pytest
import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_layout import KVCacheLayout

from csrc_triton.block_sparse import block_sparse_attention_naive
from csrc_triton.oracle import oracle_attention_naive
from csrc_triton.token_oracle.batched import token_oracle_attention_batched
from csrc_triton.token_sparse import token_sparse_attention_naive
from tests.kernel_utils import Case, dense_causal, make_case_inputs, random_blocks
from vllm_hysparse.attention.backend import (
    BlockSelection,
    HySparseAttentionBackend,
    HySparseAttentionImpl,
    HySparseMetadata,
    TokenSelection,
    WindowSelection,
    make_plan,
    window_positions,
)

SEED = int(os.environ.get("HYSPARSE_TEST_SEED", "0"))

# prefill, chunked prefill and decode rows; two padding rows; 3 heads per group; blocks of two pages
CASE = Case([7, 1, 1, 4, 1], [40, 33, 16, 64, 97], num_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
            block_size=32, topk=2, pad_tokens=2)
WINDOW = 12


class Layer:
    """What the forward reads of vLLM's `Attention` layer: the host K/V scales (1.0 for a float32 cache)."""

    _k_scale_float = 1.0
    _v_scale_float = 1.0


def metadata(batch) -> HySparseMetadata:
    """The step metadata `HySparseMetadataBuilder.build` makes of this batch."""
    n = batch.num_tokens
    return HySparseMetadata(num_actual_tokens=n, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens_t,
                            block_table=batch.block_table, max_seq_len=max(batch.seq_lens),
                            plan=make_plan(batch.query_start_loc, batch.seq_lens_t, n, torch.device("cpu")))


def impl(role: str, index_buffer=None, selection=None, sinks=None, window=None) -> HySparseAttentionImpl:
    return HySparseAttentionImpl(CASE.num_heads, CASE.head_dim, CASE.head_dim**-0.5, CASE.num_kv_heads, None, window,
                                 "auto", hysparse_role=role, index_buffer=index_buffer, selection=selection,
                                 sinks=sinks)


def run_forward(layer_impl, batch, q, steps=2):
    """`steps` forwards into NaN-poisoned outputs (the second on the bound kernel); returns the last output."""
    for _ in range(steps):
        out = torch.full_like(q, float("nan"))
        layer_impl.forward(Layer, q, None, None, batch.kv, metadata(batch), out)
    assert layer_impl._bound is not None and layer_impl._bound[1] is not None, "the C++ kernel was not bound"
    return out


@pytest.fixture
def inputs():
    print(f"seed {SEED}")
    return make_case_inputs(CASE, torch.float32, seed=SEED, sinks=True)


def assert_rows(out, ref, batch):
    n = sum(batch.q_lens)
    assert not out.isnan().any()
    torch.testing.assert_close(out[:n], ref[:n].to(out.dtype), atol=1e-4, rtol=1e-4)
    assert (out[n:] == 0).all(), "padding rows must be 0"


def test_oracle_forward(inputs):
    batch, q, _ = inputs
    buffer = torch.full((batch.num_tokens + 3, CASE.num_kv_heads, CASE.topk), 7, dtype=torch.int32)
    layer = impl("oracle", buffer, BlockSelection(CASE.block_size, CASE.topk))
    out = run_forward(layer, batch, q)
    ref_out, ref_ids = oracle_attention_naive(*batch.args(q), scale=CASE.head_dim**-0.5,
                                              sparse_block_size=CASE.block_size, topk=CASE.topk)[:2]
    assert_rows(out, ref_out, batch)
    n = sum(batch.q_lens)
    assert torch.equal(buffer[:n], ref_ids[:n]), "the followers' block ids"
    assert (buffer[n:batch.num_tokens] == -1).all() and (buffer[batch.num_tokens:] == 7).all()


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_oracle_forward(inputs, reduce):
    """HySparse2's oracle: its output is plain causal attention (the float64 reference); its selection, written
    straight into the index buffer by the bound kernels, equals the batched twin's (tested against the naive twin
    in tests/kernels), and padding rows get -1."""
    batch, q, _ = inputs
    topk, window = 9, 5
    buffer = torch.full((batch.num_tokens + 3, CASE.num_kv_heads, topk + window), 7, dtype=torch.int32)
    layer = impl("token_oracle", buffer, TokenSelection(topk, window, reduce))
    out = run_forward(layer, batch, q)
    assert_rows(out, dense_causal(batch, q, CASE.head_dim**-0.5, None), batch)
    _, ref_ids = token_oracle_attention_batched(*batch.args(q), scale=CASE.head_dim**-0.5, topk_tokens=topk,
                                                recent_window=window, score_head_reduce=reduce)
    n = sum(batch.q_lens)
    assert torch.equal(buffer[:n], ref_ids[:n])
    assert (buffer[:n] >= 0).sum() > 0 and (buffer[n:batch.num_tokens] == -1).all()
    assert (buffer[batch.num_tokens:] == 7).all()


def test_block_sparse_forward(inputs):
    batch, q, sinks = inputs
    ids = random_blocks(batch, CASE.num_kv_heads, CASE.block_size, CASE.topk, seed=SEED)
    layer = impl("block_sparse", ids, BlockSelection(CASE.block_size, CASE.topk), sinks)
    out = run_forward(layer, batch, q)
    ref = block_sparse_attention_naive(*batch.args(q), ids, scale=CASE.head_dim**-0.5,
                                       sparse_block_size=CASE.block_size, sinks=sinks)
    assert_rows(out, ref, batch)


def test_window_forward(inputs):
    batch, q, sinks = inputs
    layer = impl("window", selection=WindowSelection(WINDOW), sinks=sinks, window=WINDOW)
    out = run_forward(layer, batch, q)
    row_pos = torch.tensor(batch.positions()[:sum(batch.q_lens)])
    positions = window_positions(row_pos, batch.num_tokens, CASE.num_kv_heads, WINDOW)
    ref = token_sparse_attention_naive(*batch.args(q), positions, scale=CASE.head_dim**-0.5, sinks=sinks)
    assert_rows(out, ref, batch)
    # the window itself, independently: a row attends exactly its last WINDOW positions
    for pos, row in zip(row_pos.tolist(), positions):
        assert row[0][row[0] >= 0].tolist() == list(range(max(0, pos - WINDOW + 1), pos + 1))


def test_dense_forward(inputs):
    batch, q, _ = inputs
    out = run_forward(impl("dense"), batch, q)
    assert_rows(out, dense_causal(batch, q, CASE.head_dim**-0.5, None), batch)


def test_kv_cache_update_writes_the_bound_pages(inputs):
    """`do_kv_cache_update` on the bound C++ writer: every valid slot, nothing else (padding slots skipped)."""
    batch, _, _ = inputs
    kv = torch.full_like(batch.kv, float("nan"))
    gen = torch.Generator().manual_seed(SEED + 5)
    key = torch.randn(6, CASE.num_kv_heads, CASE.head_dim, generator=gen)
    value = torch.randn(6, CASE.num_kv_heads, CASE.head_dim, generator=gen)
    slots = torch.tensor([17, -1, 3 * 16 + 5, 40, -1, 5 * 16 + 15])
    layer = impl("oracle", torch.zeros(8, CASE.num_kv_heads, CASE.topk, dtype=torch.int32),
                 BlockSelection(CASE.block_size, CASE.topk))
    layer.do_kv_cache_update(Layer, key, value, kv, slots)
    layer.do_kv_cache_update(Layer, key, value, kv, slots)  # again, on the writer bound by the first call
    page = CASE.page_size
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kv[s // page, :, s % page], torch.cat([key[i], value[i]], dim=-1))
    written = torch.zeros(kv.shape[0], kv.shape[2], dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            written[s // page, s % page] = True
    assert kv.transpose(1, 2)[~written].isnan().all(), "a slot that was not asked for was written"
    assert int(written.sum()) == 4


def test_layout_cpu_prefers_head_major_pages():
    """vLLM resolves one layout for all backends: ours alone must give the head-major pages our C++ kernels read
    (vLLM's default would be token-major LBNHC), and beside vLLM's CPU backend the same."""
    assert get_supported_kv_cache_layouts([HySparseAttentionBackend])[0] == KVCacheLayout.LBHNC
    assert get_supported_kv_cache_layouts([HySparseAttentionBackend, CPUAttentionBackend]) == [KVCacheLayout.LBHNC]
    assert set(HySparseAttentionBackend.supported_kv_cache_layouts()) == set(KVCacheLayout)


def test_gated_paths_name_kernels_that_take_a_gate():
    """`Role.gated_paths` hands a sparse layer's gates to those kernels (`gate=`, `accumulate=`); every other
    kernel of a gated role gets them applied after it. A path listed for a kernel that takes no gate would fail at
    the first gated call on a GPU, which no CPU engine test reaches."""
    import inspect

    from vllm_hysparse.attention.backend import ROLE_TABLE, load_kernel

    gated = {name: role.gated_paths for name, role in ROLE_TABLE.items() if role is not None and role.gated_paths}
    assert set(gated) == {"block_sparse", "token_sparse", "window"}, gated  # a sparse layer's branches
    for name, role in ROLE_TABLE.items():
        for path, spec in (role.kernels.items() if role is not None else ()):
            params = inspect.signature(load_kernel(spec)).parameters
            takes = {"gate", "accumulate"} <= set(params)
            assert takes == (path in role.gated_paths), f"{name}/{path}: {spec} takes a gate: {takes}"
