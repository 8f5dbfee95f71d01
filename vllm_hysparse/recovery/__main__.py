# SPDX-License-Identifier: Apache-2.0
"""Recover a converted student: stage 1 (layer-local transfer), stage 2 (end-to-end KL), then a delta.

    python -m vllm_hysparse.recovery train --teacher dense/ --student converted/ --delta delta/ \\
        [--out recovered/] [--stage1-minutes 15] [--stage2-minutes 30]
    python -m vllm_hysparse.recovery apply --base converted/ --delta delta/ --out recovered/
    python -m vllm_hysparse.recovery export-peft --base converted/ --delta delta/ --out adapter/
    python -m vllm_hysparse.recovery carry --delta delta/ --base converted-more-full/ --out carried/
    python -m vllm_hysparse.recovery init --teacher dense/ --student converted/ --out initialised/ \\
        [--calibrate TEXT] [--tokens 4096]
    python -m vllm_hysparse.recovery distill --teacher dense/ --student converted/ --text train.txt \\
        --out distilled/ [--steps 100]

`init` is stage 0 (`recovery.init`): closed-form fits from teacher
activations, folded into the converted checkpoint's own tensors; its report
goes to `initialised/init.json`. Train from the initialised checkpoint as the
delta's base.

`distill` is plain KL distillation of the whole student on a text, a fixed
number of steps, written as a full checkpoint (`recovery.distill`; formerly
`python -m vllm_hysparse.distill`, which still forwards here).

`carry` moves a HySparse delta onto a base converted with more full layers
(`recovery.carry`): the promoted layers' tensors are dropped, the rest kept.

`train --init` runs stage 0 in memory first and the delta carries its record,
so the delta's base stays the converted checkpoint.

`train` writes `delta/delta.safetensors` (LoRA factors, sinks and bridge
norms in bf16, with the rank and a digest of the base weights) and
`delta/recovery.json` (settings, stages and the held-out KL per CPU-minute),
plus `delta/curve.png`; with `--out` it also writes the recovered checkpoint,
rebuilt from the delta exactly as `apply` does. Training text is the Python
standard library and installed package descriptions, held-out text the Python
reference documentation (`recovery.corpus`). Both stages run on `--device
cuda` when one is there.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import vllm_hysparse  # noqa: F401  (registers our configs and models)
from vllm_hysparse.recovery import carry, corpus, distill
from vllm_hysparse.recovery.corpus import windows_of
from vllm_hysparse.recovery.delta_io import BASE_CONFIG, DELTA_FILE, INIT_REPORT, REPORT_FILE, read_delta
from vllm_hysparse.recovery.distill import HeldOut, load_student
from vllm_hysparse.recovery.distill import save as save_checkpoint
from vllm_hysparse.recovery.init import INIT_PREFIX, STEP_ORDER, initialise, initialise_checkpoint
from vllm_hysparse.recovery.lora import (
    apply_delta,
    attach_lora,
    base_digest,
    check_base,
    converted_linears,
    delta_state,
    peft_adapter,
    resume_from_delta,
)
from vllm_hysparse.recovery.train import Clock, end_to_end, local_transfer
from vllm_hysparse.tools.staging import check_replaceable, latch_interrupts, staged_output


def rebuild(base: str, delta: Path, out: Path, force: bool) -> None:
    """The recovered checkpoint: `base` plus the delta, written through a temporary directory."""
    model = load_student(base, "cpu")
    apply_delta(model, *read_delta(delta))
    save_checkpoint(model, base, out, force)


def export_peft(base: str, delta: Path, out: Path, force: bool) -> None:
    """The delta as a PEFT adapter for `base` (checked to be the delta's base), written through a temporary
    directory."""
    check_replaceable(out, force)
    tensors, meta = read_delta(delta)
    factors, config = peft_adapter(tensors, meta)
    check_base(load_student(base, "cpu"), tensors, meta)
    config["base_model_name_or_path"] = str(Path(base).resolve())
    with staged_output(out) as tmp:
        save_file(factors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))


def plot_curve(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in dict.fromkeys(p["stage"] for p in curve):
        pts = [p for p in curve if p["stage"] == stage]
        ax.plot([p["cpu_minutes"] for p in pts], [p["heldout_kl"] for p in pts], marker="o", label=stage)
    ax.set(xlabel="CPU minutes (all threads)", ylabel="held-out KL(teacher ‖ student)", yscale="log",
           title="recovery: quality per CPU-minute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(args) -> dict:
    if args.resume and args.init:
        raise ValueError("--resume and --init: a delta carries its stage 0 already")
    if args.lora_only and args.init:
        raise ValueError("--lora-only and --init: a stage-0 record has no place in a LoRA-only delta")
    device = args.device
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).to(device).eval()
    teacher.requires_grad_(False)
    student = load_student(args.student, device)
    text = corpus.training_text(args.train_chars, args.seed)
    heldout = HeldOut.build(teacher, [w.to(device) for w in windows_of(
        tokenizer, corpus.heldout_text(), args.heldout_seq_len, args.heldout_windows)])
    digest = base_digest(student, converted_linears(student))
    clock, curve, stages = Clock(), [], []
    curve.append({"stage": "converted", "step": 0, "train_minutes": 0.0, "wall_minutes": 0.0, "cpu_minutes": 0.0,
                  **heldout.evaluate(student)})
    record = None
    if args.resume:
        # Go on from a delta's end (its stage-0 record, factors and whole parameters), at its rank and alpha.
        params, record = resume_from_delta(student, *read_delta(Path(args.resume)), full_rank=args.full_rank,
                                           lora_only=args.lora_only, mlp=args.mlp_lora)
        wall, cpu = clock.minutes()
        stages.append({"stage": f"resumed from {args.resume}", "minutes": wall})
        curve.append({"stage": "resumed", "step": 0, "train_minutes": wall, "wall_minutes": wall, "cpu_minutes": cpu,
                      **heldout.evaluate(student)})
    elif args.init:
        # Stage 0 on the training text (never the held-out text); the delta carries what it did.
        calib = windows_of(tokenizer, text, args.init_seq_len, max(1, args.init_tokens // args.init_seq_len))
        init_report, record = initialise(teacher, student, [w.to(device) for w in calib],
                                         steps=tuple(args.init_steps.split(",")))
        wall, cpu = clock.minutes()
        stages.append({"stage": "stage 0: closed-form initialisation", "minutes": wall,
                       "tokens": init_report["tokens"], "steps": init_report["steps"]})
        curve.append({"stage": "stage 0: closed-form initialisation", "step": 0, "train_minutes": wall,
                      "wall_minutes": wall, "cpu_minutes": cpu, **heldout.evaluate(student)})
    if not args.resume:
        params = attach_lora(student, args.rank, args.alpha, full_rank=args.full_rank, lora_only=args.lora_only,
                             mlp=args.mlp_lora)
    # Projections trained whole move at `--full-rank-lr-scale` times the rate of LoRA factors and small vectors.
    whole = {id(p) for p in params if p.ndim == 2} - {id(p) for n, p in student.named_parameters()
                                                     if n.endswith((".lora_A", ".lora_B"))}
    params = [{"params": [p for p in params if id(p) not in whole]},
              {"params": [p for p in params if id(p) in whole], "lr_scale": args.full_rank_lr_scale}]
    common = dict(clock=clock, heldout=heldout, curve=curve, seed=args.seed)

    def write_delta(stage: str | None = None) -> dict:
        """The delta and its report as they stand, published as a whole (`staged_output`); `stage`: the one
        still running, for the copies written along the way."""
        tensors, meta = delta_state(student, digest, record)
        report = {"teacher": args.teacher, "student": args.student, "settings": {
            k: v for k, v in vars(args).items() if k not in ("func", "teacher", "student", "delta", "out", "force")},
            "trainable_parameters": sum(t.numel() for k, t in tensors.items() if not k.startswith(INIT_PREFIX)),
            "init_record_parameters": sum(t.numel() for k, t in tensors.items() if k.startswith(INIT_PREFIX)),
            "stages": stages, "curve": curve, "torch": torch.__version__, "threads": torch.get_num_threads(),
            **({"unfinished": f"written during {stage}"} if stage else {})}
        with staged_output(Path(args.delta)) as tmp:
            # Trained tensors in bf16; the stage-0 record as it was fitted (its maps and their inverses must agree).
            save_file({k: (v if k.startswith(INIT_PREFIX) else v.to(torch.bfloat16)).contiguous().cpu()
                       for k, v in tensors.items()}, str(tmp / DELTA_FILE), metadata=meta)
            (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2))
            # The base's layout, so the delta can be checked against it without the base's weights.
            shutil.copyfile(Path(args.student) / "config.json", tmp / BASE_CONFIG)
            plot_curve(curve, tmp / "curve.png")
        return report

    # A long run keeps what it has learnt: the delta is rewritten at every held-out evaluation (a run killed at
    # step 44, about minute 48 of 60, lost all of it once, 2026-12-05).
    common["checkpoint"] = write_delta
    if args.stage1_minutes > 0:
        w1 = [w.to(device) for w in windows_of(tokenizer, text, args.seq_len, args.windows)]
        stages.append(local_transfer(teacher, student, w1, params, minutes=args.stage1_minutes, lr=args.lr1,
                                     **common))
    if args.stage2_minutes > 0:
        w2 = [w.to(device) for w in windows_of(tokenizer, text, args.stage2_seq_len,
                                               args.stage2_windows or args.windows)]
        stages.append(end_to_end(teacher, student, w2, params, coverage_weight=args.coverage_weight,
                                 temperature=args.temperature, hidden_weight=args.hidden_weight,
                                 minutes=args.stage2_minutes, lr=args.lr2, **common))
    report = write_delta()
    if args.out:
        rebuild(args.student, Path(args.delta), Path(args.out), args.force)
    return report


def init(args) -> dict:
    """Stage 0: fit the student on calibration windows of the teacher, write it to `args.out` with its report."""
    torch.manual_seed(args.seed)
    if args.calibrate:
        text = Path(args.calibrate).read_text(encoding="utf-8", errors="replace")
    else:
        text = corpus.training_text(args.train_chars, args.seed)
    student, report = initialise_checkpoint(args.teacher, args.student, text, tokens=args.tokens,
                                            seq_len=args.seq_len, ridge=args.ridge, steps=tuple(args.steps.split(",")))
    report.update(teacher=args.teacher, student=args.student, calibration=args.calibrate or "recovery.corpus")
    out = Path(args.out)
    save_checkpoint(student, args.student, out, args.force)
    (out / INIT_REPORT).write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    latch_interrupts()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run stage 1 and stage 2, write the delta")
    t.add_argument("--teacher", required=True, help="dense teacher checkpoint")
    t.add_argument("--student", required=True, help="converted HySparse / HySparse2 checkpoint (the delta's base)")
    t.add_argument("--delta", required=True, help="output directory for the delta and its report")
    t.add_argument("--out", help="also write the recovered checkpoint here")
    t.add_argument("--force", action="store_true", help="replace an existing --out")
    t.add_argument("--stage1-minutes", type=float, default=15.0)
    t.add_argument("--stage2-minutes", type=float, default=30.0)
    t.add_argument("--rank", type=int, default=16)
    t.add_argument("--alpha", type=float, default=32.0)
    t.add_argument("--lr1", type=float, default=2e-3, help="stage 1 peak learning rate")
    t.add_argument("--lr2", type=float, default=3e-4, help="stage 2 peak learning rate")
    t.add_argument("--seq-len", type=int, default=1024, help="stage 1 window length")
    t.add_argument("--stage2-seq-len", type=int, default=512)
    t.add_argument("--windows", type=int, default=64,
                   help="training windows per stage (stage 1 caches the teacher's activations on each)")
    t.add_argument("--stage2-windows", type=int, help="stage 2 windows (default: --windows); nothing is cached")
    t.add_argument("--train-chars", type=int, default=2_000_000)
    t.add_argument("--coverage-weight", type=float, default=0.0, help="stage 2: weight of the coverage term 1 - M")
    t.add_argument("--temperature", type=float, default=1.0, help="stage 2: KL temperature (SwiftKV: 2)")
    t.add_argument("--hidden-weight", type=float, default=0.0,
                   help="stage 2: weight of the last hidden state's relative squared error")
    t.add_argument("--full-rank", action="store_true",
                   help="train the projections conversion guessed (SWA / bridged K/V, gates) in full, not LoRA")
    t.add_argument("--full-rank-lr-scale", type=float, default=0.1,
                   help="learning rate of the projections trained whole, relative to --lr1 / --lr2")
    t.add_argument("--resume", metavar="DELTA", help="go on training from this delta (trained on the same "
                   "--student; its rank, alpha and stage-0 record are kept)")
    t.add_argument("--mlp-lora", action="store_true", help="LoRA on the MLPs of the converted layers too (they "
                   "can compensate for their lossy attention); adds to a --resume'd delta that had none")
    t.add_argument("--lora-only", action="store_true", help="train LoRA factors alone (sinks and bridge norms "
                   "frozen), so that `export-peft` can write the delta as a PEFT adapter")
    t.add_argument("--init", action="store_true",
                   help="stage 0 first (closed-form fits on the training text); the delta carries its record")
    t.add_argument("--init-steps", default=",".join(STEP_ORDER), help="stage 0: comma-separated steps")
    t.add_argument("--init-tokens", type=int, default=4096, help="stage 0: calibration tokens")
    t.add_argument("--init-seq-len", type=int, default=2048, help="stage 0: calibration window length")
    t.add_argument("--heldout-windows", type=int, default=2)
    t.add_argument("--heldout-seq-len", type=int, default=1024)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("export-peft", help="write a LoRA-only delta as a PEFT adapter (serve base + adapter)")
    e.add_argument("--base", required=True, help="the converted checkpoint the delta was trained on")
    e.add_argument("--delta", required=True)
    e.add_argument("--out", required=True, help="the adapter directory to write")
    e.add_argument("--force", action="store_true", help="replace an existing --out")
    a = sub.add_parser("apply", help="rebuild the recovered checkpoint from its base and a delta")
    a.add_argument("--base", required=True, help="the converted checkpoint the delta was trained on")
    a.add_argument("--delta", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--force", action="store_true")
    c = sub.add_parser("carry", help="carry a HySparse delta over to a base with more full layers",
                       description=carry.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--delta", required=True, help="the trained delta")
    c.add_argument("--base", required=True, help="the teacher converted again, with more full layers")
    c.add_argument("--out", required=True, help="the carried delta's directory")
    c.add_argument("--force", action="store_true", help="replace an existing --out")
    i = sub.add_parser("init", help="stage 0: closed-form initialisation from teacher activations")
    i.add_argument("--teacher", required=True, help="dense teacher checkpoint")
    i.add_argument("--student", required=True, help="converted HySparse / HySparse2 checkpoint")
    i.add_argument("--out", required=True, help="output directory for the initialised checkpoint")
    i.add_argument("--force", action="store_true", help="replace an existing --out")
    i.add_argument("--calibrate", help="calibration text file (default: the recovery training corpus)")
    i.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    i.add_argument("--seq-len", type=int, default=2048, help="calibration window length")
    i.add_argument("--ridge", type=float, default=1e-4, help="ridge strength, relative to the input's power")
    i.add_argument("--steps", default="bridges,kv_maps,gates", help="comma-separated init steps, in order")
    i.add_argument("--train-chars", type=int, default=400_000)
    i.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("distill", help="KL distillation of the whole student on a text, for a number of steps",
                       description=distill.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    distill.add_arguments(d)
    args = parser.parse_args(argv)
    if args.command == "distill":
        # As `python -m vllm_hysparse.distill` always ran: its own errors, transformers' loading bars left on.
        return distill.run(args)
    # Errors are one line on stderr; transformers' per-checkpoint loading bars would bury them.
    hf_logging.disable_progress_bar()
    try:
        if args.command == "apply":
            rebuild(args.base, Path(args.delta), Path(args.out), args.force)
            print(f"wrote {args.out} ({args.base} + {args.delta})")
            return 0
        if args.command == "export-peft":
            export_peft(args.base, Path(args.delta), Path(args.out), args.force)
            print(f"wrote {args.out} (PEFT adapter of {args.delta} for {args.base})")
            return 0
        if args.command == "carry":
            report = carry.carry(Path(args.delta), args.base, Path(args.out), args.force)
            moved = report["oracle_moved"]
            print(f"wrote {args.out}: layers {report['promoted']} now full, {report['tensors_dropped']} of their "
                  f"tensors dropped, {report['tensors_kept']} kept"
                  + (f"; sparse layers reading a new oracle (train them again): {sorted(moved)}" if moved else
                     "; no sparse layer reads a new oracle"))
            return 0
        if args.command == "init":
            report = init(args)
            print(f"wrote {args.out} (stage 0 on {report['tokens']} calibration tokens; report {INIT_REPORT})")
            return 0
        report = train(args)
    except (OSError, ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first, last = report["curve"][0], report["curve"][-1]
    print(f"held-out KL {first['heldout_kl']:.4f} -> {last['heldout_kl']:.4f}, top-1 {first['heldout_top1']:.3f} -> "
          f"{last['heldout_top1']:.3f} in {last['cpu_minutes']:.1f} CPU-min; wrote {args.delta}"
          + (f" and {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
