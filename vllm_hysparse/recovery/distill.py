# SPDX-License-Identifier: Apache-2.0
"""Adapt a converted student to its dense teacher: KL(teacher ‖ student) on logits (SPEC §5).

    python -m vllm_hysparse.recovery distill --teacher teacher/ --student student/ --text train.txt --out distilled/

The student is the reference model with every switch on (the real
architecture) and autograd; the teacher is frozen. Runs on CPU for tiny
models and on a GPU when one is present (`--device`). The held-out KL is
printed before and after, and the adapted checkpoint is written like any
other (config, safetensors, tokenizer), ready for `python -m vllm_hysparse.validate`.

The KL (`kl_divergence`), the held-out evaluation (`HeldOut`) and `save` are
also those of recovery training (`recovery.train`, `recovery.__main__`).
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_hysparse  # noqa: F401  (registers our configs and models)
from vllm_hysparse.reference.evaluation import cut_windows, kl_rows
from vllm_hysparse.tools.staging import check_replaceable, staged_output


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(teacher ‖ student); logits `[B, T, V]`."""
    t = torch.log_softmax(teacher_logits.float(), -1)
    s = torch.log_softmax(student_logits.float(), -1)
    return kl_rows(t, s).mean()


@dataclass
class HeldOut:
    """Held-out windows and the teacher's log-probabilities on them, computed once."""

    windows: list[torch.Tensor]
    teacher_logp: list[torch.Tensor]

    @classmethod
    @torch.no_grad()
    def build(cls, teacher, windows: list[torch.Tensor]) -> "HeldOut":
        return cls(windows, [torch.log_softmax(teacher(w, use_cache=False).logits.float(), -1) for w in windows])

    @torch.no_grad()
    def evaluate(self, student) -> dict:
        """KL(teacher ‖ student) and top-1 agreement averaged over every held-out row."""
        kl = top1 = rows = 0.0
        for w, t in zip(self.windows, self.teacher_logp):
            s = torch.log_softmax(student(w, use_cache=False).logits.float(), -1)
            kl += float(kl_rows(t, s).sum())
            top1 += float((t.argmax(-1) == s.argmax(-1)).sum())
            rows += t.shape[0] * t.shape[1]
        return {"heldout_kl": kl / rows, "heldout_top1": top1 / rows}


def split_windows(ids: list[int], seq_len: int, heldout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[N, seq_len]` training windows, `[heldout, seq_len]` evaluation windows from the end)."""
    windows = cut_windows(ids, seq_len)
    n = len(windows)
    if n < heldout + 1:
        raise ValueError(f"the text gives {n} windows of {seq_len} tokens; need at least {heldout + 1}")
    return windows[: n - heldout], windows[n - heldout:]


def distill(teacher, student, train: torch.Tensor, heldout: torch.Tensor, *, steps: int, lr: float,
            batch_size: int, device, seed: int = 0) -> dict:
    """Train `student` in place; returns the held-out KL before and after and the loss curve."""
    gen = torch.Generator().manual_seed(seed)
    held = HeldOut.build(teacher, [w[None].to(device) for w in heldout])
    student.eval()
    before = held.evaluate(student)["heldout_kl"]
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for step in tqdm(range(steps), desc="distill", unit="step"):
        student.train()
        batch = train[torch.randint(len(train), (batch_size,), generator=gen)].to(device)
        with torch.no_grad():
            target = teacher(batch).logits
        loss = kl_divergence(target, student(batch, use_cache=False).logits)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        # Warm-up free cosine decay: short runs on small models.
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + torch.cos(torch.tensor((step + 1) / steps * torch.pi)).item())
        losses.append(float(loss))
    student.eval()
    return {"heldout_kl_before": before, "heldout_kl_after": held.evaluate(student)["heldout_kl"],
            "steps": steps, "losses": losses}


def save(student, tokenizer_dir: str, out: Path, force: bool) -> None:
    """Write through a temporary directory (`tools.staging`); never replaces a non-empty `out` without `force`."""
    check_replaceable(out, force)
    with staged_output(out) as tmp:
        student.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)


def load_student(path: str, device):
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    if student.config.model_type not in ("hysparse", "hysparse2"):
        raise ValueError(f"{path} is a {student.config.model_type} checkpoint, not a hysparse or hysparse2 one")
    return student


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m vllm_hysparse.recovery distill`."""
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True, help="converted HySparse / HySparse2 checkpoint")
    parser.add_argument("--text", required=True, help="training text; its last windows are held out")
    parser.add_argument("--out", required=True, help="directory for the adapted student")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--heldout-windows", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true")


def run(args) -> int:
    """The `distill` command on parsed `args`: 0, or 2 with a one-line error on stderr."""
    try:
        torch.manual_seed(args.seed)
        tokenizer = AutoTokenizer.from_pretrained(args.student)
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
        train, heldout = split_windows(tokenizer(text, add_special_tokens=False).input_ids, args.seq_len,
                                       args.heldout_windows)
        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).to(args.device).eval()
        student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32).to(args.device)
        if getattr(student.config, "model_type", None) not in ("hysparse", "hysparse2"):
            raise ValueError(f"--student must be a hysparse or hysparse2 checkpoint (got {student.config.model_type})")
        result = distill(teacher, student, train, heldout, steps=args.steps, lr=args.lr,
                         batch_size=args.batch_size, device=args.device, seed=args.seed)
        save(student, args.student, Path(args.out), args.force)
    except (OSError, ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"held-out KL(teacher ‖ student): {result['heldout_kl_before']:.4f} -> {result['heldout_kl_after']:.4f} "
          f"after {args.steps} steps; wrote {args.out}")
    return 0
