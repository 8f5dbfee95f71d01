# SPDX-License-Identifier: Apache-2.0
"""Served question set: greedy answers of a dense teacher and its students through `vllm serve` + the OpenAI client.

    python benchmarks/smollm2_questions.py --teacher checkpoints/smollm2-135m-instruct \\
        --students checkpoints/smollm2-hysparse checkpoints/smollm2-hysparse2

One server at a time (CPU, float32), 32 chat questions (facts, arithmetic, short code), temperature 0.
For every student: the share of answers identical to the teacher's, and the share whose first 8 words
match. Writes `benchmarks/results/smollm2/questions_<date>_<HHMM>.{json,md}` and prints the table.
"""

import argparse
import datetime
import sys
from pathlib import Path

from vllm_hysparse.tools.harness import VLLM, free_port, running_server, save_report, serve_env

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results" / "smollm2"
QUESTIONS = [
    "What is the capital of France?", "What is the capital of Japan?", "What is the capital of Italy?",
    "Who wrote Romeo and Juliet?", "What is the largest planet in the solar system?",
    "What is the chemical symbol for gold?", "How many continents are there?",
    "What is the boiling point of water in Celsius?", "Which ocean is the largest?",
    "What language is spoken in Brazil?", "Who painted the Mona Lisa?", "What gas do plants absorb?",
    "What is the fastest land animal?", "How many days are in a leap year?",
    "What is the square root of 81?", "What is 7 times 8?", "What is 15 plus 27?", "What is 100 minus 37?",
    "What is 12 divided by 4?", "What is 2 to the power of 10?", "What is half of 50?",
    "Write a Python function that returns the square of a number.",
    "Write a Python one-liner that reverses a string s.",
    "How do you print hello world in Python?", "What does the len function do in Python?",
    "Write a Python list comprehension for the even numbers below 10.",
    "What keyword defines a function in Python?", "How do you open a file for reading in Python?",
    "Name three primary colors.", "What is the opposite of hot?", "Translate 'thank you' into Spanish.",
    "What is the freezing point of water in Fahrenheit?",
]


def ask_all(ckpt: Path, kv_gib: int, max_tokens: int, work: Path) -> list[str]:
    from openai import OpenAI

    port = free_port()
    cmd = [str(VLLM), "serve", str(ckpt), "--dtype", "float32", "--host",
           "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    log = work / f"serve_{ckpt.name}.log"
    print(f"[{ckpt.name}] {' '.join(cmd)}  (log: {log})", flush=True)
    with running_server(cmd, serve_env(kv_gib), log, start_timeout_s=600) as (_, root):
        client = OpenAI(base_url=f"{root}/v1", api_key="unused")
        answers = []
        for q in QUESTIONS:
            r = client.chat.completions.create(model=str(ckpt), messages=[{"role": "user", "content": q}],
                                               temperature=0.0, max_tokens=max_tokens)
            answers.append(r.choices[0].message.content.strip())
    return answers


def first_words(text: str, n: int = 8) -> list[str]:
    return text.split()[:n]


def markdown(result: dict) -> str:
    names = list(result["answers"])
    teacher = names[0]
    lines = [f"# Served question set ({len(QUESTIONS)} questions, greedy, `vllm serve` + OpenAI client)", "",
             f"`{result['command']}`", "", "| model | identical to the teacher | first 8 words match |",
             "| --- | ---: | ---: |"]
    for name in names[1:]:
        s = result["agreement"][name]
        lines.append(f"| {name} | {s['identical']:.0%} | {s['first_words']:.0%} |")
    lines += ["", "| # | question | " + " | ".join(names) + " |", "| ---: | --- |" + " --- |" * len(names)]
    for i, q in enumerate(QUESTIONS):
        cells = [result["answers"][n][i].replace("\n", " ").replace("|", "\\|")[:120] for n in names]
        lines.append(f"| {i + 1} | {q} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Teacher: `{teacher}`.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--students", type=Path, nargs="*", default=[])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--kv-space-gib", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    stem = args.results / f"questions_{datetime.datetime.now():%Y-%m-%d_%H%M}"
    work = args.results / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    result = {"command": "python benchmarks/smollm2_questions.py " + " ".join(argv or sys.argv[1:]),
              "questions": QUESTIONS, "answers": {}, "agreement": {}}
    for ckpt in [args.teacher, *args.students]:
        result["answers"][ckpt.name] = ask_all(ckpt, args.kv_space_gib, args.max_tokens, work)
    ref = result["answers"][args.teacher.name]
    for ckpt in args.students:
        got = result["answers"][ckpt.name]
        result["agreement"][ckpt.name] = {
            "identical": sum(a == b for a, b in zip(got, ref)) / len(ref),
            "first_words": sum(first_words(a) == first_words(b) for a, b in zip(got, ref)) / len(ref)}
    save_report(stem, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
