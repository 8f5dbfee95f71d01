# SPDX-License-Identifier: Apache-2.0
"""`v_head_dim != head_dim` (SPEC §2.6) in the real vLLM engine (CPU, float32) against the reference model.

The tiny presets with q/k head dim 64 and v head dim 32, on both
architectures. One engine per architecture (the module fixture is
parametrised, so only one runs at a time). Every cache is our backend's and
stores K and V at their own widths: vLLM 0.32's CPU backend cannot
(`vllm_hysparse.models.layers.window_attention` says why, and why padding V
would cost the full-length caches too), so the test also checks the bytes
vLLM allocated per token.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import (
    check_logprobs_close,
    kv_cache_layout,
    make_llm,
    random_prompts,
    reference_greedy,
    shutdown,
    vllm_greedy,
)
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

HEAD_DIM, V_HEAD_DIM = 64, 32
# around the tiny presets' blocks (16), windows (16 / 32) and the 64-token steps
LENGTHS = [1, 15, 17, 33, 64, 65, 150, 300]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["hysparse", "hysparse2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(arch) / "tiny-vdim", arch, "tiny", seed=11,
                            overrides={"head_dim": HEAD_DIM, "v_head_dim": V_HEAD_DIM})


@pytest.fixture(scope="module")
def reference(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(ckpt):
    # 64-token steps: long prompts are prefilled in chunks, batched with the decodes of the short ones
    engine = make_llm(ckpt, enforce_eager=True, block_size=32, max_num_batched_tokens=64, max_num_seqs=16)
    yield engine
    shutdown(engine)


def test_greedy_matches_reference(llm, reference):
    assert reference.config.v_head_dim == V_HEAD_DIM != reference.config.head_dim
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=1)
    check_logprobs_close(reference_greedy(reference, prompts, MAX_TOKENS), vllm_greedy(llm, prompts, MAX_TOKENS))


def test_caches_store_k_and_v_at_their_own_widths(llm, reference):
    """Every cache group costs G * (head_dim + v_head_dim) float32 per token and layer: nothing padded."""
    cfg = reference.config
    layout = llm.collective_rpc(kv_cache_layout)[0]
    per_token = cfg.num_key_value_heads * (HEAD_DIM + V_HEAD_DIM) * 4
    assert {g["page_size_bytes"] // g["block_size"] for g in layout["groups"]} == {per_token}
    windowed = [g for g in layout["groups"] if g["type"] == "SlidingWindowSpec"]
    assert windowed and all(g["sliding_window"] == cfg.swa_window for g in windowed)


def test_concurrent_requests_match_reference(llm, reference):
    lengths = [int(n) for n in torch.randint(1, 120, (12,), generator=torch.Generator().manual_seed(5))]
    prompts = random_prompts(lengths, reference.config.vocab_size, seed=2)
    check_logprobs_close(reference_greedy(reference, prompts, 4), vllm_greedy(llm, prompts, 4))
