# SPDX-License-Identifier: Apache-2.0
"""Switch-by-switch validation of the SmolLM2 students before and after recovery, at 2k and 4k tokens.

    python benchmarks/smollm2_validation.py --arch hysparse [--lengths 2048 4096] [--windows 2 1]

For `--arch A` it validates `checkpoints/smollm2-A` (converted) and `checkpoints/smollm2-A-recovered`
(or the `--variants` given: `checkpoints/smollm2-A-<variant>`)
against `checkpoints/smollm2-135m-instruct` on the Python reference documentation (held out from
recovery's training text), with `validate --fused-attention`. Each run's full report goes to
`benchmarks/results/smollm2/validation/<arch>-<variant>-<len>/`, and a summary table to
`benchmarks/results/smollm2/validation_<arch>_<date>.md` (+ `.json`).
"""

import argparse
import datetime
import json
import time
from pathlib import Path

from vllm_hysparse import validate
from vllm_hysparse.recovery.corpus import heldout_text

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "smollm2"


def run_one(teacher: Path, student: Path, seq_len: int, windows: int, out: Path, final_only: bool) -> dict:
    t0 = time.perf_counter()
    report = validate.validate(str(teacher), str(student), heldout_text(), seq_len, windows, fused=True,
                               final_only=final_only)
    report["seconds"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(validate.markdown_report(report))
    validate.plot_report(report, out / "plots.png")
    return report


def summary(arch: str, runs: dict, command: str) -> str:
    lines = [f"# SmolLM2-135M-Instruct → {arch}: validation before and after recovery", "",
             f"`{command}`", "",
             "Held-out text: Python reference documentation (`pydoc_data`), not in the training text. "
             "Final stage = the real architecture (every switch on). Full per-stage, per-layer reports: "
             "`validation/<arch>-<variant>-<len>/report.md`.", "",
             "| variant | tokens | windows | teacher ppl | student ppl | ppl ratio | KL | top-1 | coverage M by position |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (variant, seq_len), r in runs.items():
        final = r["stages"][-1]
        cov = ", ".join(f"{k}: {v:.3f}" for k, v in r["coverage_by_position"].items())
        lines.append(f"| {variant} | {seq_len} | {r['windows']} | {r['teacher_perplexity']:.2f} | "
                     f"{final['perplexity']:.2f} | {final['perplexity'] / r['teacher_perplexity']:.3f} | "
                     f"{final['kl']:.4f} | {final['top1']:.3f} | {cov} |")
    lines += ["", "## Stage by stage", ""]
    for (variant, seq_len), r in runs.items():
        lines += [f"### {variant}, {seq_len} tokens", "", "| stage | KL | top-1 | perplexity |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {s['stage']} | {s['kl']:.4f} | {s['top1']:.3f} | {s['perplexity']:.2f} |" for s in r["stages"]]
        spans = r["stages"][-1].get("by_position", [])
        if spans:
            lines += ["", "By position (final stage):", "", "| positions | KL | top-1 |", "| --- | ---: | ---: |"]
            lines += [f"| {p['start']}-{p['end'] - 1} | {p['kl']:.4f} | {p['top1']:.3f} |" for p in spans]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["hysparse", "hysparse2"], required=True)
    parser.add_argument("--teacher", type=Path, default=REPO / "checkpoints" / "smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 1], help="windows per length")
    parser.add_argument("--final-only-lengths", type=int, nargs="*", default=[4096],
                        help="lengths at which only the real architecture (last stage) is evaluated")
    parser.add_argument("--variants", nargs="+", default=["converted", "recovered"])
    parser.add_argument("--from-reports", action="store_true",
                        help="run nothing: summarise the per-run reports already in results/smollm2/validation/")
    args = parser.parse_args(argv)
    # Variant v of arch A is checkpoints/smollm2-A-v; "converted" is checkpoints/smollm2-A itself
    # (e.g. "init": the closed-form initialisation, `recovery init`).
    paths = {v: REPO / "checkpoints" / (f"smollm2-{args.arch}" if v == "converted" else f"smollm2-{args.arch}-{v}")
             for v in args.variants}
    runs = {}
    for variant in args.variants:
        for seq_len, windows in zip(args.lengths, args.windows):
            out = RESULTS / "validation" / f"{args.arch}-{variant}-{seq_len}"
            if args.from_reports:
                runs[(variant, seq_len)] = r = json.loads((out / "report.json").read_text())
            else:
                runs[(variant, seq_len)] = r = run_one(args.teacher, paths[variant], seq_len, windows, out,
                                                       seq_len in args.final_only_lengths)
            print(f"{variant} {seq_len}: KL {r['stages'][-1]['kl']:.4f}, ppl {r['stages'][-1]['perplexity']:.2f} "
                  f"(teacher {r['teacher_perplexity']:.2f}), {r['seconds']:.0f} s", flush=True)
    command = "python benchmarks/smollm2_validation.py " + " ".join(argv or __import__("sys").argv[1:])
    stem = RESULTS / f"validation_{args.arch}_{datetime.datetime.now():%Y-%m-%d_%H%M}"
    stem.with_suffix(".md").write_text(summary(args.arch, runs, command))
    stem.with_suffix(".json").write_text(json.dumps(
        {f"{v}-{n}": {k: r[k] for k in ("stages", "teacher_perplexity", "coverage_by_position", "windows", "seconds")}
         for (v, n), r in runs.items()}, indent=1))
    print(summary(args.arch, runs, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
