# SPDX-License-Identifier: Apache-2.0
"""Stage 1 of recovery: layer-local attention transfer on cached teacher activations.

Each converted attention layer learns to reproduce the teacher's attention
output at the same depth from the teacher's own residual stream, so no
gradient crosses a layer boundary (the LoLCATs recipe). The student runs its
real architecture, with everything a layer reads from elsewhere (the oracle
layer's K/V and block ids, HySparse2's bridged K/V and token selection)
computed by the student's own modules, but every decoder layer's output is
replaced by the teacher's: all layers see teacher inputs. MLPs are skipped,
since their output would be replaced anyway.
"""

from dataclasses import dataclass

import torch
from torch import nn

from vllm_hysparse.recovery.lora import converted_attention


@dataclass
class TeacherActivations:
    """One window of the teacher: residual stream entering each layer, and converted layers' attention outputs."""

    ids: torch.Tensor  # [1, T]
    hidden: list[torch.Tensor]  # L x [1, T, hidden]: input of layer i
    attn_out: dict[int, torch.Tensor]  # layer -> [1, T, hidden]


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _layer_of(path: str) -> int:
    return int(path.split(".")[2])


@torch.no_grad()
def teacher_activations(teacher, ids: torch.Tensor, layers: list[int]) -> TeacherActivations:
    """Run the dense teacher once on `ids [1, T]` and keep what stage 1 trains on."""
    hidden, attn_out, handles = {}, {}, []
    for i, layer in enumerate(teacher.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: hidden.__setitem__(i, a[0].detach())))
        if i in layers:
            handles.append(layer.self_attn.register_forward_hook(
                lambda m, a, out, i=i: attn_out.__setitem__(i, _first(out).detach())))
    try:
        teacher.model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return TeacherActivations(ids, [hidden[i] for i in range(len(teacher.model.layers))], attn_out)


class _SkippedMLP(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


class TeacherForced:
    """Runs the student with every layer taking the teacher's residual stream; records converted attention outputs.

    The hooks and skipped MLPs are in place only inside `run`, so the student
    stays an ordinary model in between (for held-out evaluation).
    """

    def __init__(self, student):
        self.student, self.outputs, self.acts = student, {}, None
        self.layers = [_layer_of(p) for p in converted_attention(student)]

    def __enter__(self):
        layers = self.student.model.layers
        self.mlps = [layer.mlp for layer in layers]
        self.handles = []
        for i, layer in enumerate(layers):
            layer.mlp = _SkippedMLP()
            if i + 1 < len(layers):
                # The next layer's input is the teacher's, whatever this layer computed.
                self.handles.append(layer.register_forward_hook(lambda m, a, out, i=i: self.acts.hidden[i + 1]))
            if i in self.layers:
                self.handles.append(layer.self_attn.register_forward_hook(
                    lambda m, a, out, i=i: self.outputs.__setitem__(i, out)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        for layer, mlp in zip(self.student.model.layers, self.mlps):
            layer.mlp = mlp

    def run(self, acts: TeacherActivations) -> dict[int, torch.Tensor]:
        """Converted layers' attention outputs `{layer: [1, T, hidden]}` on the teacher's stream."""
        self.acts, self.outputs = acts, {}
        model, t = self.student.model, acts.ids.shape[1]
        positions = torch.arange(t, device=acts.ids.device)
        with self:
            # Every row is a "logits row", so HySparse2 early exit keeps the whole cross-decoder.
            model(acts.hidden[0], positions, None, positions, self.student.switches, False)
        return self.outputs


def relative_mse(outputs: dict[int, torch.Tensor], targets: dict[int, torch.Tensor]) -> torch.Tensor:
    """Mean over layers of `‖out - target‖² / ‖target‖²`: every layer counts the same whatever its scale."""
    losses = [(outputs[i].float() - targets[i].float()).pow(2).sum() / targets[i].float().pow(2).sum().clamp_min(1e-12)
              for i in targets]
    return torch.stack(losses).mean()
