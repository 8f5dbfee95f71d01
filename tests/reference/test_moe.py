# SPDX-License-Identifier: Apache-2.0
"""The reference MoE MLP (SPEC §2.6) against the token-by-token loop oracle, and where it is used."""

import pytest
import torch

from tests.reference._reference_math import moe
from vllm_hysparse.configs import HySparse2Config, HySparseConfig
from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM
from vllm_hysparse.reference.layers import MLP, SparseMoeBlock, make_mlp

FULL, SPARSE, SLIDING = "full_attention", "sparse_attention", "sliding_attention"
MOE = dict(layer_types=[FULL, SPARSE, SPARSE], vocab_size=97, hidden_size=32, intermediate_size=64,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
           moe_intermediate_size=16)


def random_block(seed: int, **kw) -> SparseMoeBlock:
    """A float64 block with unit-scale router logits on unit-scale inputs (routing far from uniform)."""
    config = HySparseConfig(**{**MOE, **kw})
    torch.manual_seed(seed)
    block = SparseMoeBlock(config).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[-1] ** -0.5)
    return block


def oracle(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    config = {"num_experts_per_tok": block.top_k, "norm_topk_prob": block.norm_topk_prob}
    sd = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    return moe(sd, config, "model.layers.0.", x)


@pytest.mark.parametrize("shared", [0, 24])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_block_matches_loop_oracle(top_k, norm_topk_prob, shared):
    block = random_block(3, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                         shared_expert_intermediate_size=shared)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(top_k * 10 + shared), dtype=torch.float64)
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got, oracle(block, x), rtol=1e-6, atol=1e-6)


def test_every_expert_is_used_and_routing_matters():
    block = random_block(5)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with torch.no_grad():
        _, ids = block.route(x)
        before = block(x)
        # Swap two experts' router rows: tokens go elsewhere, so the output changes.
        block.gate.weight[[0, 1]] = block.gate.weight[[1, 0]]
        after = block(x)
    assert set(ids.flatten().tolist()) == set(range(6))
    assert (before - after).abs().max() > 1e-2
    torch.testing.assert_close(after, oracle(block, x), rtol=1e-6, atol=1e-6)


def test_renormalised_weights_sum_to_one():
    block = random_block(7, norm_topk_prob=True, num_experts_per_tok=3)
    weights, ids = block.route(torch.randn(10, 32, generator=torch.Generator().manual_seed(8), dtype=torch.float64))
    torch.testing.assert_close(weights.sum(-1), torch.ones(10, dtype=torch.float64))
    assert all(len(set(row)) == 3 for row in ids.tolist())


def test_dense_and_mlp_only_layers_keep_the_dense_mlp():
    config = HySparseConfig(**{**MOE, "mlp_only_layers": [1]})
    assert [type(make_mlp(config, i)) for i in range(3)] == [SparseMoeBlock, MLP, SparseMoeBlock]
    dense = HySparseConfig(**{**MOE, "num_experts": 0})
    assert all(type(make_mlp(dense, i)) is MLP for i in range(3))


@pytest.mark.parametrize("make", [
    lambda: HySparseForCausalLM(HySparseConfig(**{**MOE, "mlp_only_layers": [0]})),
    lambda: HySparse2ForCausalLM(HySparse2Config(
        **{**MOE, "layer_types": [SLIDING, FULL, FULL, SPARSE], "num_self_decoder_layers": 2,
           "bridge_sources": [1], "shared_expert_intermediate_size": 24, "swa_rotary_dim": 4})),
])
def test_model_state_dict_uses_spec_names(make):
    """SPEC §2.6 tensor names and shapes, the same as `expected_tensors` (what vLLM loads)."""
    from vllm_hysparse.configs.tensors import expected_tensors

    model = make()
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sd == expected_tensors(model.config)
    layer = "model.layers.1.mlp."
    assert sd[layer + "gate.weight"] == (6, 32)
    assert sd[layer + "experts.5.down_proj.weight"] == (32, 16)
    if model.config.shared_expert_intermediate_size:
        assert sd[layer + "shared_expert.up_proj.weight"] == (24, 32)
        assert sd[layer + "shared_expert_gate.weight"] == (1, 32)
