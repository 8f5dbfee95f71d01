# SPDX-License-Identifier: Apache-2.0
"""Re-rotation of stored keys to a segment's new start: `K_b = R(a) K_0` (SPEC §4)."""

import torch


def rotate_by(rope, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate each row of `x` by its own `shift` with the pure rotation of vLLM rotary embedding `rope`.

    RoPE composes, so rotating a key stored at local position j by the
    segment's start a gives the key at a + j. Only the angle is taken from
    `rope.cos_sin_cache`: scaled variants (YaRN) fold a magnitude factor
    into it, which the stored key already carries once. Returns a new tensor
    (vLLM's own CPU op rotates in place).

    Args:
        x: `[T, n * head_size]` keys (any number of heads n).
        shift: `[T]` integer rotation per row.
    """
    t = x.shape[0]
    heads = x.view(t, -1, rope.head_size).float()
    cos, sin = rope.cos_sin_cache.index_select(0, shift.long()).float().chunk(2, dim=-1)
    norm = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-30)
    cos, sin = (cos / norm).unsqueeze(1), (sin / norm).unsqueeze(1)  # [T, 1, rotary_dim / 2]
    rot = heads[..., :rope.rotary_dim]
    if rope.is_neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    out = torch.cat([rotated, heads[..., rope.rotary_dim:]], dim=-1)
    return out.to(x.dtype).view(x.shape)
