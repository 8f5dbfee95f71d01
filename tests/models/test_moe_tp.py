# SPDX-License-Identifier: Apache-2.0
"""MoE (SPEC §2.6) under tensor parallelism (CPU, two ranks) against the reference model.

HySparse `tiny_moe` plus a shared expert: each rank holds half of every
expert's and of the shared expert's intermediate dims, and the routed and
shared outputs are summed across ranks once. HySparse2's MoE preset (MQA, so
with replicated KV heads) runs at TP=2 in `test_tp_replication.py`.
"""

import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import check_logprobs_close, make_llm, random_prompts, reference_greedy, shutdown, vllm_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint


def test_tensor_parallel_moe_matches_reference(tmp_path):
    ckpt = write_checkpoint(tmp_path / "tiny_moe", "hysparse", "tiny_moe", seed=31,
                            overrides={"shared_expert_intermediate_size": 96})
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompts = random_prompts([1, 17, 33, 65, 150], reference.config.vocab_size, seed=12)
    expected = reference_greedy(reference, prompts, 8)
    llm = make_llm(ckpt, enforce_eager=True, block_size=32, max_model_len=512, tensor_parallel_size=2)
    try:
        got = vllm_greedy(llm, prompts, 8)
    finally:
        shutdown(llm)
    check_logprobs_close(expected, got)
