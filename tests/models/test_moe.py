# SPDX-License-Identifier: Apache-2.0
"""MoE (SPEC §2.6) in the real vLLM engine (CPU, float32, compiled) against the reference model.

`tiny_moe` of each architecture: 8 experts, 2 active. HySparse's is Qwen3-MoE
style (renormalised top-k, layer 0 dense); HySparse2's is Qwen2-MoE style (not
renormalised, a sigmoid-gated shared expert), with its prefill early exit on,
so the cross-decoder's MoE runs on the logits rows only. One engine per
architecture, 64-token steps: long prompts are prefilled in chunks batched
with the decodes of short ones.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import check_logprobs_close, make_llm, random_prompts, reference_greedy, shutdown, vllm_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

LENGTHS = [1, 15, 16, 17, 33, 64, 65, 150, 400]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["hysparse", "hysparse2"])
def ckpt(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param) / "tiny_moe", request.param, "tiny_moe", seed=21)


@pytest.fixture(scope="module")
def reference(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(reference):
    return random_prompts(LENGTHS, reference.config.vocab_size, seed=4)


@pytest.fixture(scope="module")
def expected(reference, prompts):
    return reference_greedy(reference, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(ckpt):
    # Compiled with inductor, as served: vLLM's fused-MoE custom op traced into the graph. Not dynamo-only
    # (`make_llm(inductor=False)`): that engine core dies at its first forward with "free(): invalid size" in vLLM
    # 0.32's CPU MoE path (seen 2026-12-03; it skips the warm-up), and `LLM.generate` then waits forever.
    llm = make_llm(ckpt, block_size=32, max_num_batched_tokens=64, max_num_seqs=16)
    yield llm
    shutdown(llm)


def mlp_layout(worker) -> list[dict]:
    """Runs inside the worker: per layer, the MLP class, its expert count and whether it has a shared expert."""
    out = []
    for layer in worker.model_runner.model.model.layers:
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        out.append({"type": type(mlp).__name__,
                    "experts": experts.moe_config.num_experts if experts is not None else 0,
                    "top_k": experts.moe_config.experts_per_token if experts is not None else 0,
                    "shared": getattr(mlp, "shared_expert", None) is not None})
    return out


def test_layers_use_vllm_fused_moe(llm, reference):
    cfg = reference.config
    layout = llm.collective_rpc(mlp_layout)[0]
    want = [{"type": "SparseMoeBlock", "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
             "shared": cfg.shared_expert_intermediate_size > 0} if cfg.is_moe_layer(i)
            else {"type": "Qwen2MLP", "experts": 0, "top_k": 0, "shared": False}
            for i in range(cfg.num_hidden_layers)]
    assert layout == want


def test_greedy_matches_reference_with_chunked_prefill(llm, prompts, expected):
    check_logprobs_close(expected, vllm_greedy(llm, prompts, MAX_TOKENS))


def test_many_concurrent_requests(llm, reference):
    lengths = torch.randint(1, 200, (24,), generator=torch.Generator().manual_seed(9)).tolist()
    many = random_prompts(lengths, reference.config.vocab_size, seed=10)
    check_logprobs_close(reference_greedy(reference, many, 4), vllm_greedy(llm, many, 4))


def test_routing_changes_what_is_compared(reference, prompts):
    """Rolling every router's expert rows moves the reference's logprobs by far more than the
    tolerance: the comparisons above see the routing, not only attention and dense layers."""
    gates = [layer.mlp.gate.weight for layer in reference.model.layers if hasattr(layer.mlp, "gate")]
    assert gates
    ids = torch.tensor([prompts[-1]])

    def logprobs():
        with torch.no_grad():
            return torch.log_softmax(reference(ids, use_cache=False).logits.double(), dim=-1)

    before, saved = logprobs(), [g.detach().clone() for g in gates]
    try:
        with torch.no_grad():
            for g in gates:
                g.copy_(g.roll(1, dims=0))
        after = logprobs()
    finally:
        with torch.no_grad():
            for g, s in zip(gates, saved):
                g.copy_(s)
    assert (before - after).abs().max() > 25 * 2e-3  # check_logprobs_close's atol
