# SPDX-License-Identifier: Apache-2.0
"""Small random reference HySparse / HySparse2 models for the reference tests (configs, weights, tokens)."""

import torch

from vllm_hysparse.configs import HySparse2Config, HySparseConfig
from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM

FULL, SPARSE, SLIDING = "full_attention", "sparse_attention", "sliding_attention"
VOCAB = 97

HS_LAYERS = [FULL, SPARSE, SPARSE, FULL, SPARSE, SPARSE]
H2_LAYERS = [SLIDING, FULL, SLIDING, FULL, SPARSE, SPARSE, FULL, SPARSE]
# Two self full layers, each bridged by one cross full layer (in crossed order).
H2_TWO_SOURCES = dict(layer_types=[FULL, SLIDING, FULL, FULL, SPARSE, FULL, SPARSE],
                      num_self_decoder_layers=3, bridge_sources=[2, 0])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, std=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std


def hs_config(**kw) -> HySparseConfig:
    base = dict(layer_types=HS_LAYERS, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, sparse_block_size=4,
                sparse_topk_blocks=2, swa_window=5, rope_theta=1000.0)
    base.update(kw)
    return HySparseConfig(**base)


def h2_config(**kw) -> HySparse2Config:
    base = dict(layer_types=H2_LAYERS, num_self_decoder_layers=3, bridge_sources=[1, 1], vocab_size=VOCAB,
                hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                sparse_topk_tokens=3, recent_window=5, swa_window=5, swa_rotary_dim=4, swa_rope_theta=500.0,
                rope_theta=1000.0)
    base.update(kw)
    return HySparse2Config(**base)


def randomize(model, seed: int):
    """Non-trivial random weights: unit-ish linears, random sinks, norms and biases."""
    g = gen(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(randn(g, *p.shape))
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * randn(g, *p.shape))
            elif "embed_tokens" in name:
                p.copy_(randn(g, *p.shape))
            elif p.dim() == 2:
                p.copy_(randn(g, *p.shape, std=p.shape[1] ** -0.5))
            else:
                p.copy_(0.2 * randn(g, *p.shape))
    return model.eval()


def make_hs(seed=0, **kw):
    torch.manual_seed(seed)
    return randomize(HySparseForCausalLM(hs_config(**kw)), seed)


def make_h2(seed=0, **kw):
    torch.manual_seed(seed)
    return randomize(HySparse2ForCausalLM(h2_config(**kw)), seed)


def tokens(seed, bsz, t):
    return torch.randint(0, VOCAB, (bsz, t), generator=gen(seed))


def state(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


def close(a, b, atol=1e-4):
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=1e-4)


def differs(a, b, by=1e-3) -> bool:
    return (a.double() - b.double()).abs().max().item() > by


@torch.no_grad()
def logits(model, ids, **kw):
    return model(ids, use_cache=False, **kw).logits
