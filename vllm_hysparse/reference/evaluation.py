# SPDX-License-Identifier: Apache-2.0
"""What a student is measured on against its teacher: token windows of a text, and KL(teacher ‖ student) per row.

Validation (`validate`) and recovery (`recovery`: training, held-out
evaluation, distillation) cut their text and compare logits with these, each
at its own precision (validation in float64, training in float32).
"""

import torch


def cut_windows(ids: list[int], seq_len: int) -> torch.Tensor:
    """Every complete non-overlapping window of `ids`, from the start: `[len(ids) // seq_len, seq_len]`."""
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def kl_rows(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) of every row `[..., V] -> [...]`, from log-probabilities (in their own dtype)."""
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
