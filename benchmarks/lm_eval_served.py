# SPDX-License-Identifier: Apache-2.0
"""lm-eval against `vllm serve`: a dense teacher and its converted students, on local task files.

    pip install -e ".[eval]"     # lm-eval 0.4.13 with its API models
    python benchmarks/lm_eval_served.py --teacher checkpoints/smollm2-135m-instruct \\
        --students checkpoints/smollm2-hysparse-recovered checkpoints/smollm2-hysparse2-recovered

For each checkpoint, one server at a time (CPU, float32), lm-eval runs the tasks of
`benchmarks/lm_eval/tasks` (read from this repository, nothing is downloaded):
* `hysparse_questions`: chat questions, generated greedily through `local-chat-completions`
  and scored against expected answers (regular expressions), not against the teacher;
* `hysparse_facts_mc`: multiple-choice continuations scored by log-likelihood through
  `local-completions`, which asks the server for prompt logprobs (`echo` + `logprobs`).
  HySparse2 servers keep early exit on: the requests that ask for prompt logprobs get all
  their prompt rows through the cross-decoder (docs/serving.md).

Writes `<results>/lm_eval_<date>_<HHMM>.{json,md}` and prints the table: each score, and each
student's distance from the teacher in questions.

The same tasks run on any pair of servers with lm-eval's own CLI, e.g.
    lm_eval --model local-chat-completions --apply_chat_template --include_path benchmarks/lm_eval/tasks \\
        --tasks hysparse_questions --model_args model=M,base_url=http://127.0.0.1:8000/v1/chat/completions
"""

import argparse
import datetime
import sys
from pathlib import Path

import vllm_hysparse  # noqa: F401  (lm-eval's tokenizer loads HySparse configs through transformers)
from vllm_hysparse.tools.harness import VLLM, free_port, running_server, save_report, serve_env

BENCH_DIR = Path(__file__).resolve().parent

TASKS_DIR = BENCH_DIR / "lm_eval" / "tasks"
RESULTS_DIR = BENCH_DIR / "results" / "smollm2"
QUESTIONS, FACTS = "hysparse_questions", "hysparse_facts_mc"


def evaluate_served(ckpt: Path, kv_gib: int, work: Path, limit: int | None) -> dict:
    """Serve `ckpt`, run both tasks against it; returns {task: {metric: value}, "answers": [...]}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    port = free_port()
    cmd = [str(VLLM), "serve", str(ckpt), "--dtype", "float32", "--host",
           "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    log = work / f"serve_{ckpt.name}.log"
    print(f"[{ckpt.name}] {' '.join(cmd)}  (log: {log})", flush=True)
    tasks = TaskManager(include_path=str(TASKS_DIR))
    common = dict(task_manager=tasks, limit=limit, log_samples=True, random_seed=0, numpy_random_seed=0,
                  torch_random_seed=0, fewshot_random_seed=0)
    with running_server(cmd, serve_env(kv_gib), log, start_timeout_s=600) as (_, root):
        chat = simple_evaluate(model="local-chat-completions", apply_chat_template=True, tasks=[QUESTIONS],
                               model_args={"model": str(ckpt), "base_url": f"{root}/v1/chat/completions",
                                           "num_concurrent": 1, "max_retries": 2}, **common)
        mc = simple_evaluate(model="local-completions", tasks=[FACTS],
                             model_args={"model": str(ckpt), "base_url": f"{root}/v1/completions",
                                         "tokenizer_backend": "huggingface", "tokenizer": str(ckpt),
                                         "num_concurrent": 1, "max_retries": 2}, **common)
    samples = sorted(chat["samples"][QUESTIONS], key=lambda s: s["doc_id"])
    return {QUESTIONS: {"answer_match": chat["results"][QUESTIONS]["answer_match,none"]},
            FACTS: {"acc": mc["results"][FACTS]["acc,none"], "acc_norm": mc["results"][FACTS]["acc_norm,none"]},
            "answers": [{"question": s["doc"]["question"], "answer": s["filtered_resps"][0],
                         "match": s["answer_match"]} for s in samples],
            "n": {QUESTIONS: len(samples), FACTS: len(mc["samples"][FACTS])}}


def markdown(result: dict) -> str:
    names = list(result["models"])
    teacher = result["models"][names[0]]
    nq = teacher["n"][QUESTIONS]
    lines = ["# lm-eval against `vllm serve` (local tasks, greedy)", "", f"`{result['command']}`", "",
             f"| model | questions matched (of {nq}) | vs teacher | facts MC acc | acc_norm |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name in names:
        m = result["models"][name]
        right = round(m[QUESTIONS]["answer_match"] * nq)
        delta = "" if name == names[0] else f"{right - round(teacher[QUESTIONS]['answer_match'] * nq):+d}"
        lines.append(f"| {name} | {right} | {delta} | {m[FACTS]['acc']:.3f} | {m[FACTS]['acc_norm']:.3f} |")
    lines += ["", "| # | question | " + " | ".join(names) + " |", "| ---: | --- |" + " --- |" * len(names)]
    for i, row in enumerate(teacher["answers"]):
        cells = []
        for n in names:
            a = result["models"][n]["answers"][i]
            text = a["answer"].replace("\n", " ").replace("|", "\\|")[:100]
            cells.append(f"{'✓' if a['match'] else '✗'} {text}")
        lines.append(f"| {i + 1} | {row['question']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--students", type=Path, nargs="*", default=[])
    parser.add_argument("--kv-space-gib", type=int, default=2)
    parser.add_argument("--limit", type=int, help="only the first N documents of each task (a quick check)")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    for ckpt in [args.teacher, *args.students]:
        if not (ckpt / "config.json").is_file():
            print(f"error: {ckpt} is not a checkpoint directory (no config.json)", file=sys.stderr)
            return 2
    stem = args.results / f"lm_eval_{datetime.datetime.now():%Y-%m-%d_%H%M}"
    work = args.results / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    result = {"command": "python benchmarks/lm_eval_served.py " + " ".join(argv or sys.argv[1:]), "models": {}}
    for ckpt in [args.teacher, *args.students]:
        result["models"][ckpt.name] = evaluate_served(ckpt, args.kv_space_gib, work, args.limit)
    save_report(stem, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
