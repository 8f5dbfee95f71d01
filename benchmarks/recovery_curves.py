# SPDX-License-Identifier: Apache-2.0
"""Recovery runs side by side: held-out KL and top-1 per CPU-minute, from their `recovery.json` reports.

    python benchmarks/recovery_curves.py --out benchmarks/results/smollm2/recovery/curves_2026-12-02 \\
        --run "HySparse, LoRA 512 (copy)=benchmarks/results/smollm2/recovery/hysparse_2026-12-01_lora512.json" \\
        --run "HySparse, stage 0 + full rank + T2 + hidden, 2k windows=deltas/smollm2-hysparse/recovery.json"

Every point is a held-out evaluation the run recorded (`recovery.distill.HeldOut`: the same Python-docs windows in
every run), against process CPU minutes (all threads) since the run began. Writes `<out>.md` (a table: first and
last point of each stage, and the KL reached by a few CPU budgets), `<out>.json` and `<out>.png`.
"""

import argparse
import json
from pathlib import Path

BUDGETS = (5, 10, 20, 40, 80)


def load(spec: str) -> tuple[str, list[dict], dict]:
    name, _, path = spec.partition("=")
    if not path:
        raise SystemExit(f"error: --run wants NAME=PATH, got {spec!r}")
    report = json.loads(Path(path).read_text())
    return name, report["curve"], report.get("settings", {})


def best_within(curve: list[dict], cpu_minutes: float) -> dict | None:
    """The last point recorded within `cpu_minutes` (None when the run had none by then)."""
    inside = [p for p in curve if p["cpu_minutes"] <= cpu_minutes]
    return inside[-1] if inside else None


def table(runs) -> str:
    lines = ["| run | stage | CPU min | held-out KL | top-1 |", "| --- | --- | ---: | ---: | ---: |"]
    for name, curve, _ in runs:
        for stage in dict.fromkeys(p["stage"] for p in curve):
            pts = [p for p in curve if p["stage"] == stage]
            for p in ([pts[0], pts[-1]] if len(pts) > 1 else pts):
                lines.append(f"| {name} | {stage} | {p['cpu_minutes']:.1f} | {p['heldout_kl']:.4f} | "
                             f"{p['heldout_top1']:.3f} |")
    lines += ["", "KL reached within a CPU budget (the last evaluation inside it):", "",
              "| run | " + " | ".join(f"{b} min" for b in BUDGETS) + " |", "| --- |" + " ---: |" * len(BUDGETS)]
    for name, curve, _ in runs:
        cells = [best_within(curve, b) for b in BUDGETS]
        lines.append(f"| {name} | " + " | ".join(f"{c['heldout_kl']:.3f}" if c else "" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve, _ in runs:
        x = [p["cpu_minutes"] for p in curve]
        axes[0].plot(x, [p["heldout_kl"] for p in curve], marker="o", label=name)
        axes[1].plot(x, [p["heldout_top1"] for p in curve], marker="o", label=name)
    axes[0].set(xlabel="CPU minutes (all threads)", ylabel="held-out KL(teacher ‖ student)", yscale="log")
    axes[1].set(xlabel="CPU minutes (all threads)", ylabel="held-out top-1 agreement")
    axes[0].legend(fontsize=7)
    fig.suptitle("recovery runs: quality per CPU-minute")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, help="NAME=path/to/recovery.json (repeat)")
    parser.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = parser.parse_args(argv)
    runs = [load(spec) for spec in args.run]
    md = "# Recovery runs per CPU-minute\n\n`python benchmarks/recovery_curves.py " + " ".join(
        f'--run "{s}"' for s in args.run) + f" --out {args.out}`\n\n" + table(runs)
    md += "\nSettings:\n\n" + "\n".join(f"- {name}: `{json.dumps(s, sort_keys=True)}`" for name, _, s in runs) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(md)
    args.out.with_suffix(".json").write_text(json.dumps({name: curve for name, curve, _ in runs}, indent=2))
    plot(runs, args.out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
