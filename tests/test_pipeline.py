# SPDX-License-Identifier: Apache-2.0
"""The README's path end to end: train a teacher -> convert -> validate -> distil -> validate."""

import json
import subprocess
import sys
from pathlib import Path

from vllm_hysparse import distill, validate
from vllm_hysparse.tools import train_teacher

REPO = Path(__file__).resolve().parents[1]


def test_teacher_convert_validate_distil(tmp_path):
    teacher, student, distilled = tmp_path / "teacher", tmp_path / "student", tmp_path / "distilled"
    assert train_teacher.main(["--size", "micro", "--out", str(teacher)]) == 0
    metrics = json.loads((teacher / "teacher_metrics.json").read_text())
    assert metrics["perplexity"] < metrics["unigram_perplexity"]
    # The script as a user runs it; its identity check compares logits with the teacher.
    subprocess.run([sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "--src", str(teacher),
                    "--dst", str(student), "--arch", "hysparse", "--full-layers", "0", "--block-size", "16",
                    "--topk-blocks", "2", "--swa-window", "32", "--verify"], check=True)
    heldout = teacher / "heldout.txt"
    before = validate.validate(str(teacher), str(student), heldout.read_text(), seq_len=128, max_windows=2)
    assert [s["stage"] for s in before["stages"]] == ["dense", "oracle indices (own KV)", "KV sharing", "SWA branch"]
    assert before["stages"][0]["kl"] < 1e-9
    assert before["stages"][-1]["kl"] > before["stages"][0]["kl"]
    assert distill.main(["--teacher", str(teacher), "--student", str(student), "--text", str(heldout), "--out",
                         str(distilled), "--steps", "30", "--lr", "1e-3", "--seq-len", "128"]) == 0
    after = validate.validate(str(teacher), str(distilled), heldout.read_text(), seq_len=128, max_windows=2)
    assert after["stages"][-1]["kl"] < before["stages"][-1]["kl"]
