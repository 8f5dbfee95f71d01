# SPDX-License-Identifier: Apache-2.0
"""KV pages per decode query at a 4k context, for the served SmolLM2 students (`vllm serve`, `/metrics`).

    python benchmarks/smollm2_pages.py [--students checkpoints/smollm2-hysparse-recovered ...] [--context 4096]

Each student is served with prefix caching off. It gets one prompt of `--context` tokens of real text
(the Python reference documentation) twice: once with 1 output token (prefill only) and once with
1 + `--decode` tokens. The difference of the `vllm:hysparse_*` counters between the two runs is
exactly the decode queries at that context: pages their selection touched, and pages dense attention
over the same context would touch. Writes `benchmarks/results/smollm2/pages_<date>_<HHMM>.{json,md}`.
"""

import argparse
import datetime
import sys
from pathlib import Path

from vllm_hysparse.tools.harness import (
    VLLM,
    free_port,
    http_get,
    pages_per_query,
    parse_metrics,
    running_server,
    save_report,
    serve_env,
)

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results" / "smollm2"


def prompt_ids(tokenizer_dir: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from vllm_hysparse.recovery.corpus import heldout_text

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(heldout_text(), add_special_tokens=False).input_ids
    return ids[:n]


def measure(ckpt: Path, ids: list[int], decode: int, work: Path) -> dict:
    from openai import OpenAI

    port = free_port()
    cmd = [str(VLLM), "serve", str(ckpt), "--dtype", "float32", "--host",
           "127.0.0.1", "--port", str(port), "--max-model-len", str(len(ids) + decode + 16),
           "--no-enable-prefix-caching"]
    with running_server(cmd, serve_env(3), work / f"pages_{ckpt.name}.log", start_timeout_s=600) as (_, root):
        client = OpenAI(base_url=f"{root}/v1", api_key="unused")

        def run(max_tokens):
            before = parse_metrics(http_get(f"{root}/metrics"))
            client.completions.create(model=str(ckpt), prompt=ids, max_tokens=max_tokens, temperature=0.0,
                                      extra_body={"ignore_eos": True})
            return before, parse_metrics(http_get(f"{root}/metrics"))

        prefill = run(1)
        both = run(1 + decode)
    p, b = pages_per_query(*prefill), pages_per_query(*both)
    queries = b["queries"] - p["queries"]
    pages = b["pages_per_query"] * b["queries"] - p["pages_per_query"] * p["queries"]
    dense = b["dense_pages_per_query"] * b["queries"] - p["dense_pages_per_query"] * p["queries"]
    return {"decode_queries": queries, "pages_per_query": pages / queries, "dense_pages_per_query": dense / queries,
            "prefill": p}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=Path, nargs="+",
                        default=[REPO / "checkpoints" / "smollm2-hysparse-recovered",
                                 REPO / "checkpoints" / "smollm2-hysparse2-recovered"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args(argv)
    work = RESULTS_DIR / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    ids = prompt_ids(args.students[0], args.context)
    result = {"command": "python benchmarks/smollm2_pages.py " + " ".join(argv or sys.argv[1:]),
              "context": len(ids), "decode": args.decode, "students": {}}
    for ckpt in args.students:
        result["students"][ckpt.name] = r = measure(ckpt, ids, args.decode, work)
        print(f"{ckpt.name}: {r['pages_per_query']:.1f} pages per decode query vs {r['dense_pages_per_query']:.1f} "
              f"dense ({r['pages_per_query'] / r['dense_pages_per_query']:.2f}) over {r['decode_queries']:.0f} "
              "queries", flush=True)
    stem = RESULTS_DIR / f"pages_{datetime.datetime.now():%Y-%m-%d_%H%M}"
    lines = [f"# KV pages per decode query at {len(ids)} tokens of context", "", f"`{result['command']}`", "",
             "Counter deltas of `vllm:hysparse_pages_touched_total` / `vllm:hysparse_dense_pages_total` / "
             "`vllm:hysparse_sparse_queries_total` between a prefill-only request and the same prompt with "
             f"{args.decode} more output tokens (prefix caching off): decode queries only, every sparse layer.", "",
             "| student | pages per decode query | dense attention would touch | ratio | queries counted |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in result["students"].items():
        lines.append(f"| {name} | {r['pages_per_query']:.1f} | {r['dense_pages_per_query']:.1f} | "
                     f"{r['pages_per_query'] / r['dense_pages_per_query']:.2f} | {r['decode_queries']:.0f} |")
    save_report(stem, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
