# SPDX-License-Identifier: Apache-2.0
"""The two recovery stages, each on a time budget, and the quality-per-CPU-minute curve they record.

Stage 1 (`local_transfer`): relative MSE of every converted attention layer
against the teacher's, on cached teacher activations (`recovery.local`).
Stage 2 (`end_to_end`): KL(teacher ‖ student) on logits through the whole
student, optionally plus `coverage_weight * (1 - M)`, the mass each sparse
layer's own dense attention puts outside the keys its selection uses.
Both train the same parameters (`recovery.lora.attach_lora`).
"""

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from vllm_hysparse.recovery.distill import HeldOut, kl_divergence
from vllm_hysparse.recovery.local import TeacherForced, _layer_of, relative_mse, teacher_activations
from vllm_hysparse.recovery.lora import converted_attention
from vllm_hysparse.reference.fast_ops import fast_reference_ops
from vllm_hysparse.reference.probes import SELECTION


@dataclass
class Clock:
    """Wall and process CPU time (all threads) since the start of recovery."""

    wall0: float = field(default_factory=time.perf_counter)
    cpu0: float = field(default_factory=time.process_time)

    def minutes(self) -> tuple[float, float]:
        return (time.perf_counter() - self.wall0) / 60, (time.process_time() - self.cpu0) / 60


WARMUP = 0.05  # share of a stage's budget over which the learning rate ramps up linearly


def cosine_lr(step_fraction: float, lr: float) -> float:
    """Linear warm-up over the first WARMUP of the budget, then a cosine to 0.

    Without warm-up, Adam's first steps at the peak rate undo much of a closed-form
    initialisation (SmolLM2 HySparse, stage 0 then stage 1: held-out KL 0.47 -> 0.82 after 10 steps).
    """
    f = min(step_fraction, 1.0)
    return lr * min(1.0, (f + 1e-3) / WARMUP) * 0.5 * (1 + math.cos(math.pi * f))


def run_stage(name: str, loss_fn, windows: list, params: list, *, minutes: float, lr: float, clock: Clock,
              heldout: HeldOut, student, curve: list, evals: int = 4, seed: int = 0,
              max_steps: int | None = None, checkpoint: Callable[[str], object] | None = None) -> dict:
    """Minimise `loss_fn(window)` over random `windows` for `minutes` of wall time (or `max_steps` steps).

    `params`: parameters, or param groups whose `lr_scale` multiplies `lr`.
    The learning rate follows a cosine over the budget (by elapsed time, since
    the number of steps is not known in advance). The held-out KL is measured
    `evals` times, evenly over the budget, into `curve` (outside the budget); after each but the last,
    `checkpoint(name)` saves what the run has so far.
    """
    gen = torch.Generator().manual_seed(seed)
    groups = [g for g in params if g["params"]] if params and isinstance(params[0], dict) else [{"params": params}]
    flat = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    budget_s, spent, step, losses = minutes * 60, 0.0, 0, []
    next_eval = budget_s / evals
    bar = tqdm(desc=name, unit="step")

    def progress() -> float:
        return step / max_steps if max_steps else spent / budget_s

    while progress() < 1:
        t0 = time.perf_counter()
        student.train()
        with fast_reference_ops():
            loss = loss_fn(windows[int(torch.randint(len(windows), (1,), generator=gen))])
            opt.zero_grad()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(flat, 1.0)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(progress(), lr) * group.get("lr_scale", 1.0)
        opt.step()
        step, spent = step + 1, spent + time.perf_counter() - t0
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if progress() >= next_eval / budget_s or progress() >= 1:
            next_eval += budget_s / evals
            wall, cpu = clock.minutes()
            point = {"stage": name, "step": step, "train_minutes": spent / 60, "wall_minutes": wall,
                     "cpu_minutes": cpu, **heldout.evaluate(student)}
            curve.append(point)
            tqdm.write(f"[{name}] step {step}, {spent / 60:.1f} min: held-out KL {point['heldout_kl']:.4f}, "
                       f"top-1 {point['heldout_top1']:.3f}")
            if checkpoint is not None and progress() < 1:  # the last one is the caller's to write
                checkpoint(name)
    bar.close()
    return {"stage": name, "steps": step, "minutes": spent / 60, "lr": lr, "loss_first": losses[0],
            "loss_last": sum(losses[-10:]) / len(losses[-10:])}


def local_transfer(teacher, student, windows: list[torch.Tensor], params: list, **kw) -> dict:
    """Stage 1 on `windows` (`[1, T]` token ids): caches the teacher's activations once, then trains."""
    layers = [_layer_of(p) for p in converted_attention(student)]
    cached = [teacher_activations(teacher, w, layers) for w in tqdm(windows, desc="teacher activations")]
    forced = TeacherForced(student)
    return run_stage("stage 1: layer-local transfer", lambda acts: relative_mse(forced.run(acts), acts.attn_out),
                     cached, params, student=student, **kw)


class CoverageTerm:
    """Context: sums `1 - M` (mass outside the used selection) over the student's sparse layers' forwards."""

    def __init__(self, student):
        self.student, self.terms = student, []

    def __enter__(self):
        self.handles = [layer.self_attn.register_forward_pre_hook(self._record)
                        for layer in self.student.model.layers if type(layer.self_attn) in SELECTION]
        return self

    def _record(self, attn, args):
        measured = SELECTION[type(attn)](attn, args)
        if measured is not None:
            self.terms.append(1 - measured[0].mean())

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def take(self) -> torch.Tensor:
        terms, self.terms = self.terms, []
        return torch.stack(terms).mean() if terms else torch.zeros(())


def distillation_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0,
                      teacher_hidden: torch.Tensor | None = None, student_hidden: torch.Tensor | None = None,
                      hidden_weight: float = 0.0) -> torch.Tensor:
    """`T^2 KL(softmax(t / T) ‖ softmax(s / T))` over logits `[B, T, V]`, plus `hidden_weight` times the
    relative squared error of the last hidden states `[B, T, E]` (SwiftKV's loss at T = 2)."""
    loss = kl_divergence(teacher_logits / temperature, student_logits / temperature) * temperature**2
    if hidden_weight:
        loss = loss + hidden_weight * relative_mse({0: student_hidden}, {0: teacher_hidden})
    return loss


def end_to_end(teacher, student, windows: list[torch.Tensor], params: list, coverage_weight: float = 0.0,
               temperature: float = 1.0, hidden_weight: float = 0.0, **kw) -> dict:
    """Stage 2: KL (at `temperature`) on the logits of every row of a window, plus the optional hidden-state
    and coverage terms."""
    hidden = hidden_weight > 0

    def loss(ids):
        with torch.no_grad():
            target = teacher(ids, use_cache=False, output_hidden_states=hidden)
        out = student(ids, use_cache=False, output_hidden_states=hidden)
        value = distillation_loss(target.logits, out.logits, temperature,
                                  target.hidden_states[-1] if hidden else None,
                                  out.hidden_states[-1] if hidden else None, hidden_weight)
        return value + coverage_weight * coverage.take() if coverage_weight else value

    with CoverageTerm(student) if coverage_weight else nullcontext() as coverage:
        return run_stage("stage 2: end-to-end KL", loss, windows, params, student=student, **kw)

