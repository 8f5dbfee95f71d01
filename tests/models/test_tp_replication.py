# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism with replicated KV heads (CPU, two ranks) against the reference model.

HySparse2's presets are MQA (one KV head): at TP=2 both ranks hold that head,
and the token oracle gathers the whole group's queries so that both publish
the selection of all four query heads (`HeadSplit.group_query`). Prompts are
longer than `recent_window + sparse_topk_tokens` (32) and HySparse's block
budget (2 blocks of 16), so the selections are real choices.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import check_logprobs_close, make_llm, random_prompts, reference_greedy, shutdown, vllm_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

LENGTHS = [1, 24, 45, 90, 170]
MAX_TOKENS = 8

# name -> (architecture, preset, overrides): one engine each.
MODELS = {
    # HySparse2 MQA with MoE and a shared expert, and V narrower than Q/K (SPEC §2.6). (Its dense-MLP preset adds
    # nothing here: dense MLPs at TP=2 run in test_hysparse.py and below.)
    "hysparse2_moe_v32": ("hysparse2", "tiny_moe", {"v_head_dim": 32}),
    # HySparse with its two KV heads made one: the block oracle's group is split over the ranks.
    "hysparse_mqa_v32": ("hysparse", "tiny", {"num_key_value_heads": 1, "v_head_dim": 32}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_tensor_parallel_replicated_kv_matches_reference(tmp_path, name):
    arch, preset, overrides = MODELS[name]
    ckpt = write_checkpoint(tmp_path / name, arch, preset, seed=41, overrides=overrides)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert reference.config.num_key_value_heads == 1
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=13)
    expected = reference_greedy(reference, prompts, MAX_TOKENS)
    llm = make_llm(ckpt, enforce_eager=True, block_size=32, max_model_len=512, tensor_parallel_size=2)
    try:
        got = vllm_greedy(llm, prompts, MAX_TOKENS)
    finally:
        shutdown(llm)
    check_logprobs_close(expected, got)


def test_tensor_parallel_not_multiple_of_kv_heads_is_one_line_error(tmp_path):
    ckpt = write_checkpoint(tmp_path / "g2", "hysparse2", "tiny",
                            overrides={"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
                                       "swa_rotary_dim": 16})
    # Raised by our config hook in the API process, before any worker starts; vLLM reports
    # every `VllmConfig` error inside pydantic's `ValidationError`, our line verbatim.
    with pytest.raises(ValueError) as e:
        make_llm(ckpt, enforce_eager=True, block_size=32, max_model_len=512, tensor_parallel_size=3)
    message = "tensor_parallel_size=3 must be a multiple of num_key_value_heads=2 to replicate KV heads (or divide it)"
    assert message in str(e.value)
