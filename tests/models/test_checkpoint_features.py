# SPDX-License-Identifier: Apache-2.0
"""Config features that real checkpoints use, through the vLLM engine, against the reference model.

Each variant (tests/feature_variants.py) turns on several features at once in one tiny checkpoint, so one
engine start covers them:
* `a`: `qk_norm`, `attention_bias`, tied embeddings, headwise gates and yarn RoPE scaling;
* `b`: no sinks (`use_sinks=False`) and llama3 RoPE scaling.
`rope_scaling` scales the RoPE of HySparse's layers and of HySparse2's full and sparse layers, which have RoPE
only with `full_rope=True`: the HySparse2 variants set it (its sliding layers keep `swa_rope_theta`, unscaled).
(Variant `a` split over two pipeline stages, the embedding on the first and the tied LM head on the last, is in
tests/models/test_pipeline_parallel.py.) Prompt lengths cross the window, block and selection sizes and reach far past the RoPE
scalings' original context (64 positions), where yarn and llama3 differ from plain RoPE; the checkpoints'
`max_position_embeddings` is yarn's covered length, 64 x 8 (the config refuses more: vLLM's YaRN table ends
there, and positions past it gave NaN before the config check).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.feature_variants import VARIANTS, variant_overrides
from tests.vllm_utils import check_logprobs_close, make_llm, random_prompts, reference_greedy, shutdown, vllm_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

LENGTHS = [5, 33, 70, 150, 300]
MAX_TOKENS = 6
ENGINE = dict(enforce_eager=True, block_size=32, max_model_len=512, max_num_batched_tokens=64)
CASES = [(arch, variant) for arch in ("hysparse", "hysparse2") for variant in VARIANTS]


def _ids(case):
    return "-".join(case)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    return {(arch, v): write_checkpoint(root / f"{arch}-{v}", arch, "tiny",
                                        overrides=variant_overrides(arch, v), seed=61 + i)
            for i, (arch, v) in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_features_match_reference(checkpoints, case):
    arch, variant = case
    ckpt = checkpoints[(arch, variant)]
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for name, value in variant_overrides(arch, variant).items():
        got = getattr(reference.config, name)
        if name == "rope_scaling":  # the config adds rope_theta to it
            got = {k: v for k, v in got.items() if k in value}
        assert got == value, name  # the feature reached the model
    if variant == "a":
        assert "lm_head.weight" not in {n for n, _ in reference.named_parameters()}  # tied: one tensor
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=7)
    expected = reference_greedy(reference, prompts, MAX_TOKENS)
    llm = make_llm(ckpt, **ENGINE)
    try:
        got = vllm_greedy(llm, prompts, MAX_TOKENS)
    finally:
        shutdown(llm)
    matched = check_logprobs_close(expected, got, min_matched=0.9)
    print(f"\n[{_ids(case)}] {matched} of {len(prompts) * MAX_TOKENS} positions matched")
