# SPDX-License-Identifier: Apache-2.0
"""TPOT with and without n-gram speculative decoding, on a repetitive workload (copying code).

    python benchmarks/spec_decode_bench.py --models checkpoints/smollm2-hysparse-recovered \
        checkpoints/smollm2-hysparse2-recovered [--drafts 4] [--tokens 96] [--prompts 4]

Each model answers `--prompts` chat requests, one at a time, that ask it to repeat a snippet of the
Python reference documentation word for word: the kind of output (edits, code, quotes) where n-gram
drafts from the prompt pay off. Greedy decoding, so both engines must give the same tokens, which is
checked. Each request runs twice, with 1 output token (prefill only) and with `--tokens`; TPOT is the
difference over `--tokens - 1`. Each engine runs in its own process (offline `LLM`, float32, vLLM's
defaults otherwise). Writes `benchmarks/results/spec_decode_<date>_<HHMM>.{json,md}`.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SNIPPET_CHARS = 700


def prompts(tokenizer_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_hysparse.recovery.corpus import heldout_text

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = heldout_text()
    out = []
    for i in range(n):
        snippet = text[i * 5 * SNIPPET_CHARS:][:SNIPPET_CHARS]
        messages = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{snippet}"}]
        out.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def spec_counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens), by short name."""
    return {m.name.removeprefix("vllm:spec_decode_num_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and isinstance(getattr(m, "value", None), (int, float))}


def run_one(model: str, drafts: int, tokens: int, n: int) -> dict:
    """In this process: one engine, every prompt at 1 and at `tokens` output tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": drafts, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 5}} if drafts else {}
    llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0, disable_log_stats=False, **spec)
    ids = prompts(model, n)

    def timed(p, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)

    timed(ids[0], 4)  # warm-up (compilation)
    before = spec_counters(llm)
    rows = []
    for p in ids:
        t1, _ = timed(p, 1)
        tn, out = timed(p, tokens)
        rows.append({"prompt_tokens": len(p), "ttft_s": t1, "tpot_ms": 1e3 * (tn - t1) / (tokens - 1),
                     "token_ids": out})
    after = spec_counters(llm)
    counts = {k: after[k] - before.get(k, 0) for k in after}
    return {"model": model, "drafts": drafts, "rows": rows, "spec_counts": counts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--drafts", type=int, default=4, help="n-gram draft tokens per step")
    ap.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "DRAFTS"), help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], int(args.one[1]), args.tokens, args.prompts)))
        return 0
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    results = []
    for model in args.models:
        pair = []
        for drafts in (0, args.drafts):
            cmd = [sys.executable, __file__, "--one", model, str(drafts), "--tokens", str(args.tokens),
                   "--prompts", str(args.prompts)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"{model} with {drafts} drafts failed (exit {proc.returncode})")
            pair.append(json.loads(line.removeprefix("RESULT ")))
        plain, spec = pair
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(plain["rows"], spec["rows"]))
        tpot = [sum(r["tpot_ms"] for r in x["rows"]) / len(x["rows"]) for x in pair]
        c = spec["spec_counts"]
        results.append({"model": model, "plain": plain, "spec": spec, "identical_outputs": same,
                        "tpot_ms_plain": tpot[0], "tpot_ms_spec": tpot[1], "tpot_ratio": tpot[1] / tpot[0],
                        "acceptance": c.get("accepted_tokens", 0) / max(c.get("draft_tokens", 0), 1)})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    import torch
    import vllm

    meta = {"command": " ".join(["python", "benchmarks/spec_decode_bench.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "torch": torch.__version__, "vllm": vllm.__version__, "threads": torch.get_num_threads(),
            "load": os.getloadavg(), "drafts": args.drafts, "tokens": args.tokens, "prompts": args.prompts}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"spec_decode_{stamp}{args.tag}"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"# TPOT with and without n-gram speculative decoding ({stamp} UTC)", "",
             f"`{meta['command']}`; torch {meta['torch']}, vLLM {meta['vllm']}, {meta['threads']} threads, load "
             f"before {' '.join(f'{x:.2f}' for x in meta['load'])}. {args.prompts} requests, one at a time, each "
             f"asking to repeat ~{SNIPPET_CHARS} characters of held-out text; {args.tokens} greedy output tokens; "
             f"{args.drafts} n-gram drafts.", "",
             "| model | TPOT plain (ms) | TPOT n-gram (ms) | ratio | drafts accepted | identical outputs |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| `{Path(r['model']).name}` | {r['tpot_ms_plain']:.1f} | {r['tpot_ms_spec']:.1f} | "
                     f"{r['tpot_ratio']:.2f}x | {r['acceptance']:.0%} | {r['identical_outputs']} / {args.prompts} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
