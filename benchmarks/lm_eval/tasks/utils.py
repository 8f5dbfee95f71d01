# SPDX-License-Identifier: Apache-2.0
"""Local data and scoring for the lm-eval tasks in this folder (nothing is downloaded at run time).

`questions.jsonl`: chat questions, each with the regular expressions an acceptable answer matches
(case-insensitive, any one of them); scored against those, not against a teacher's words.
`facts_mc.jsonl`: multiple-choice continuations, scored by log-likelihood (prompt logprobs).
"""

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def _dataset(name: str):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_records(name))})


def load_questions(**kwargs):
    return _dataset("questions.jsonl")


def load_facts(**kwargs):
    return _dataset("facts_mc.jsonl")


def answer_matches(answer: str, patterns: list[str]) -> bool:
    return any(re.search(p, answer, flags=re.IGNORECASE) for p in patterns)


def process_questions(doc: dict, results: list[str]) -> dict:
    """lm-eval `process_results`: 1.0 when the generated answer matches one of the doc's patterns."""
    return {"answer_match": float(answer_matches(results[0], doc["patterns"]))}
