# SPDX-License-Identifier: Apache-2.0
"""The command line (`python -m vllm_hysparse.tools.convert`, `scripts/convert_checkpoint.py`): `build_parser`
(its description is the package docstring), `main` (plan, describe, convert; exit code 2 with one line on
bad input), the `--calibrate` step on the staged checkpoint, and a `.gguf` `--src`, imported to a dense
checkpoint first by `vllm_hysparse.tools.import_gguf` (imported only then: that tool imports this package).
"""

import argparse
import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from vllm_hysparse.tools.checkpoint_io import parse_size
from vllm_hysparse.tools.convert.conversion import describe, plan_conversion
from vllm_hysparse.tools.convert.plan import CONFIG_CLASSES, plan_options, read_plan
from vllm_hysparse.tools.convert.write import convert
from vllm_hysparse.tools.staging import latch_interrupts


def calibrator(src: str, text_path: str, tokens: int, max_shard_size: str):
    """`--calibrate`: stage 0 of recovery (`vllm_hysparse.recovery.init`) on the staged checkpoint, in place."""
    text = Path(text_path).read_text(encoding="utf-8", errors="replace")

    def run(tmp: Path) -> None:
        from vllm_hysparse.recovery.init import initialise_checkpoint

        student, report = initialise_checkpoint(src, tmp, text, tokens=tokens, seq_len=min(tokens, 2048))
        for old in [*tmp.glob("*.safetensors"), *tmp.glob("*.safetensors.index.json")]:
            old.unlink()
        student.save_pretrained(tmp, max_shard_size=max_shard_size)
        report["calibration"] = text_path
        (tmp / "init.json").write_text(json.dumps(report, indent=2))
        print(f"calibrate: stage 0 on {report['tokens']} tokens of {text_path} (report init.json)")

    return run


def _layer_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, e.g. 0,4,8 (got {text!r})")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    # The description is the package docstring (the converter's module docstring before the split).
    p = argparse.ArgumentParser(prog=prog, description=importlib.import_module(__package__).__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="HF checkpoint (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, "
                   "Qwen2-MoE), or a .gguf file of one (imported first, see vllm_hysparse.tools.import_gguf)")
    p.add_argument("--dst", required=True, help="directory to create")
    p.add_argument("--arch", choices=sorted(CONFIG_CLASSES), required=True)
    full = p.add_mutually_exclusive_group()
    full.add_argument("--full-period", type=int, help="hysparse: full layer every N layers, plus the last "
                      "(default 4 below 48 layers, else 12)")
    full.add_argument("--full-layers", type=_layer_list, help="hysparse: explicit full layers, e.g. 0,4,8")
    p.add_argument("--block-size", type=int, help="hysparse: sparse_block_size (default 64)")
    p.add_argument("--topk-blocks", type=int, help="hysparse: sparse_topk_blocks (default 16)")
    p.add_argument("--swa-window", type=int, help="SWA branch / sliding layer window (default 128)")
    p.add_argument("--gate-type", choices=["elementwise", "headwise"], help="default elementwise")
    p.add_argument("--num-self-layers", type=int, help="hysparse2: self-decoder depth (default: half, rounded up)")
    p.add_argument("--self-full-layers", type=_layer_list, help="hysparse2: full self-decoder layers "
                   "(default: the middle one); the others are sliding")
    p.add_argument("--cross-full-layers", type=_layer_list, help="hysparse2: full cross-decoder layers "
                   "(default: blocks of [full, sparse x 5], x 2 below 16 layers); the others are sparse")
    p.add_argument("--bridge-sources", type=_layer_list, help="hysparse2: self full layer per cross full layer "
                   "(default: all the self full layer nearest the self-decoder's middle)")
    p.add_argument("--topk-tokens", type=int, help="hysparse2: sparse_topk_tokens (default 1024)")
    p.add_argument("--recent-window", type=int, help="hysparse2: recent_window (default 128)")
    p.add_argument("--plan", metavar="PLAN_JSON", help="take the layer plan from a report of python -m "
                   "vllm_hysparse.recovery.plan (measured on the teacher); options given here win over it")
    p.add_argument("--dry-run", action="store_true", help="print the plan, parameters and KV bytes; write nothing")
    p.add_argument("--verify", action="store_true", help="compare logits with the teacher before publishing "
                   "(loads both models in float32)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --dst")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size, e.g. 500MB")
    p.add_argument("--calibrate", metavar="TEXT", help="text file: fit the converted layers on the teacher's "
                   "activations over it (recovery stage 0, see docs/recovery.md) instead of copying only")
    p.add_argument("--calibrate-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    return p


@contextmanager
def _dense_source(src: str, dst: Path):
    """`src`, or for a `.gguf` file its dense import in a temporary directory beside `dst` (removed after)."""
    if not src.lower().endswith(".gguf"):
        yield src
        return
    from vllm_hysparse.tools.import_gguf import dense_source

    with dense_source(src, dst.parent) as dense:
        yield dense


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; `prog` names the command in `--help` (default: the script's file name)."""
    latch_interrupts()
    args = build_parser(prog).parse_args(argv)
    try:
        # The plan file is checked before a GGUF source is imported; its layers once the source is known.
        plan = read_plan(args.plan, args.arch) if args.plan else None
        with _dense_source(args.src, Path(args.dst)) as src:
            conv = plan_conversion(src, args.arch, plan_options(args, src, plan))
            print(describe(conv))
            for warning in conv.warnings:
                print(f"warning: {warning}", file=sys.stderr)
            if args.dry_run:
                return 0
            calibrate = (calibrator(src, args.calibrate, args.calibrate_tokens, args.max_shard_size)
                         if args.calibrate else None)
            out = convert(conv, args.dst, force=args.force, max_shard_bytes=parse_size(args.max_shard_size),
                          check=args.verify, calibrate=calibrate)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
