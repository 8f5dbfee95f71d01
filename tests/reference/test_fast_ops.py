# SPDX-License-Identifier: Apache-2.0
"""The training twins of the reference attention ops give the reference's outputs and gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.recovery_utils import fixed_seed  # noqa: F401  (autouse: the recovery tests' per-test seeds)
from vllm_hysparse.reference import fast_ops, ops

SHAPES = [(1, 40, 4, 2, 8), (2, 57, 6, 3, 16), (1, 33, 4, 1, 8)]  # B, T, H, G, D: GQA, batch, MQA


def _inputs(b, t, h, g, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(b, t, h, d, generator=gen)).requires_grad_()
    k = (2 * torch.randn(b, t, g, d, generator=gen)).requires_grad_()
    v = torch.randn(b, t, g, d, generator=gen).requires_grad_()
    sink = torch.randn(h, generator=gen).requires_grad_()
    return q, k, v, sink


def _same(reference, twin, inputs, seed):
    """Outputs and the gradients of a random projection of them agree."""
    r, f = reference(), twin()
    assert not torch.isnan(f).any()
    torch.testing.assert_close(f, r, atol=2e-5, rtol=1e-4)
    w = torch.randn(r.shape, generator=torch.Generator().manual_seed(seed))
    used = [x for x in inputs if x is not None]
    g_ref = torch.autograd.grad((r * w).sum(), used, allow_unused=True)
    g_twin = torch.autograd.grad((f * w).sum(), used, allow_unused=True)
    for a, b in zip(g_ref, g_twin):
        torch.testing.assert_close(b, a, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("window", [None, 7])
def test_dense_attention(shape, with_sink, window):
    seed = int(torch.randint(1 << 30, ()))
    q, k, v, sink = _inputs(*shape, seed)
    sink = sink if with_sink else None
    _same(lambda: ops.dense_attention(q, k, v, 0.4, sink, window=window),
          lambda: fast_ops.dense_attention(q, k, v, 0.4, sink, window=window), (q, k, v, sink), seed)


@pytest.mark.parametrize("shape", SHAPES)
def test_dense_attention_on_a_subset_of_rows(shape):
    """HySparse2 early exit passes `positions`: queries at chosen positions over all keys."""
    seed = int(torch.randint(1 << 30, ()))
    q, k, v, sink = _inputs(*shape, seed)
    positions = torch.tensor([0, 5, shape[1] - 1])
    _same(lambda: ops.dense_attention(q[:, positions], k, v, 0.4, sink, window=9, positions=positions),
          lambda: fast_ops.dense_attention(q[:, positions], k, v, 0.4, sink, window=9, positions=positions),
          (q, k, v, sink), seed)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_sink", [True, False])
def test_block_sparse_attention(shape, with_sink):
    seed = int(torch.randint(1 << 30, ()))
    q, k, v, sink = _inputs(*shape, seed)
    sink = sink if with_sink else None
    ids = ops.oracle_block_topk(q.detach(), k.detach(), 0.4, 8, 2)
    # The selection is real: the result is not dense attention.
    assert not torch.allclose(ops.block_sparse_attention(q, k, v, ids, 8, 0.4, sink), ops.dense_attention(q, k, v, 0.4, sink))
    _same(lambda: ops.block_sparse_attention(q, k, v, ids, 8, 0.4, sink),
          lambda: fast_ops.block_sparse_attention(q, k, v, ids, 8, 0.4, sink), (q, k, v, sink), seed)


def test_rows_without_keys_are_zero_as_in_the_reference():
    """No sink and no selected block: the reference gives zeros; a fused kernel alone would give NaN."""
    q, k, v, _ = _inputs(1, 24, 4, 2, 8, 1)
    ids = ops.oracle_block_topk(q.detach(), k.detach(), 0.4, 8, 2).clone()
    ids[:, 10:14] = -1
    ref = ops.block_sparse_attention(q, k, v, ids, 8, 0.4)
    twin = fast_ops.block_sparse_attention(q, k, v, ids, 8, 0.4)
    assert ref[:, 10:14].abs().max() == 0
    torch.testing.assert_close(twin, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_token_sparse_attention(shape):
    seed = int(torch.randint(1 << 30, ()))
    q, k, v, sink = _inputs(*shape, seed)
    ids = ops.token_topk(q.detach(), k.detach(), 0.4, 6, 4)
    _same(lambda: ops.token_sparse_attention(q, k, v, ids, 0.4, sink),
          lambda: fast_ops.token_sparse_attention(q, k, v, ids, 0.4, sink), (q, k, v, sink), seed)


def test_the_swap_is_undone_even_on_error():
    before = ops.dense_attention
    with pytest.raises(RuntimeError):
        with fast_ops.fast_reference_ops():
            assert ops.dense_attention is fast_ops.dense_attention
            raise RuntimeError
    assert ops.dense_attention is before


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_whole_model_logits_and_gradients(checkpoints, arch):
    """Every call site of the models goes through the swap, and the models compute the same thing."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32)
    with torch.no_grad():  # converted gates and sinks are at their neutral init: make them matter
        for name, p in model.named_parameters():
            if "gate_proj" in name or name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    called = []
    original = fast_ops._attend
    fast_ops._attend = lambda *a: called.append(1) or original(*a)
    try:
        ref = model(ids, use_cache=False).logits
        g_ref = torch.autograd.grad(ref.logsumexp(-1).sum(), list(model.parameters()), allow_unused=True)
        with fast_ops.fast_reference_ops():
            twin = model(ids, use_cache=False).logits
            g_twin = torch.autograd.grad(twin.logsumexp(-1).sum(), list(model.parameters()), allow_unused=True)
    finally:
        fast_ops._attend = original
    layers = model.config.num_hidden_layers
    assert len(called) >= layers, "some attention layer did not run the twins"
    torch.testing.assert_close(twin, ref, atol=1e-4, rtol=1e-4)
    for a, b in zip(g_ref, g_twin):
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_validation_report_is_the_same_with_fused_attention(checkpoints, arch):
    from vllm_hysparse import validate
    from vllm_hysparse.recovery.corpus import heldout_text

    text = heldout_text()[:20000]
    plain = validate.validate(str(checkpoints["teacher"]), str(checkpoints[arch]), text, seq_len=96, max_windows=1)
    fused = validate.validate(str(checkpoints["teacher"]), str(checkpoints[arch]), text, seq_len=96, max_windows=1,
                              fused=True)
    assert fused["fused_attention"] and not plain["fused_attention"]
    assert len(plain["stages"]) == len(fused["stages"]) > 2
    for a, b in zip(plain["stages"], fused["stages"]):
        assert a["stage"] == b["stage"]
        for key in ("kl", "top1", "perplexity"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (a["stage"], key)
        for i, row in a["layers"].items():
            for key, value in row.items():
                assert b["layers"][i][key] == pytest.approx(value, rel=1e-3, abs=1e-4), (a["stage"], i, key)
