# SPDX-License-Identifier: Apache-2.0
"""Training twins of the reference attention ops: same signatures and math, on fused attention.

The reference ops (`reference.ops`) materialise every score matrix in several
float32 copies, which makes backpropagation through a 30-layer model slow on
a CPU. These twins compute the same outputs with
`torch.nn.functional.scaled_dot_product_attention` and a boolean key mask.
A per-head sink (a logit with no value) becomes one extra key: every query
gets an extra dimension equal to 1, every real key a 0 there, and the sink key
`sink / scale` there and 0 elsewhere, with a zero value; its logit is then
exactly `sink`. `fast_reference_ops()` swaps them into `reference.ops` for a
block of code (recovery training, `validate --fused-attention`); tests check them against the originals,
outputs and gradients.
"""

import contextlib

import torch
import torch.nn.functional as F

from vllm_hysparse.reference import ops


def _attend(q, k, v, keep: torch.Tensor, scale: float, sink) -> torch.Tensor:
    """q `[B, Tq, H, D]`, k/v `[B, Tk, G, D]`, keep `[B|1, H|1, Tq, Tk]` bool -> `[B, Tq, H, D]` float32."""
    h = q.shape[2]
    q, k, v = (x.float().transpose(1, 2) for x in (q, ops.expand_kv_heads(k, h), ops.expand_kv_heads(v, h)))
    if sink is not None:
        b, _, tq, d = q.shape
        q = torch.cat([q, q.new_ones(b, h, tq, 1)], dim=-1)
        k = torch.cat([k, k.new_zeros(*k.shape[:3], 1)], dim=-1)
        sink_key = torch.cat([q.new_zeros(h, d), sink.float().view(h, 1) / scale], dim=-1)
        k = torch.cat([k, sink_key.view(1, h, 1, d + 1).expand(b, h, 1, d + 1)], dim=2)
        v = torch.cat([v, v.new_zeros(b, h, 1, v.shape[-1])], dim=2)
        keep = torch.cat([keep, keep.new_ones(*keep.shape[:-1], 1).expand(*keep.shape[:-1], 1)], dim=-1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    # A query with no visible key (possible only without a sink) gets zeros, as in the reference.
    o = torch.where(keep.any(-1, keepdim=True), o, torch.zeros((), dtype=o.dtype))
    return o.transpose(1, 2)


def _causal(q, k, positions) -> torch.Tensor:
    t = ops.query_positions(q.shape[1], k.shape[1], q.device, positions)
    return torch.arange(k.shape[1], device=q.device)[None, :] <= t[:, None]  # [Tq, Tk]


def dense_attention(q, k, v, scale, sink=None, window=None, positions=None):
    """Same as `reference.ops.dense_attention`."""
    keep = _causal(q, k, positions)
    if window is not None:
        keep = keep & ops.window_mask(q.shape[1], k.shape[1], window, q.device, positions)
    return _attend(q, k, v, keep[None, None], scale, sink).to(q.dtype)


def _per_head(mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[B, Tq, G, Tk]` -> `[B, H, Tq, Tk]`."""
    return mask.repeat_interleave(num_heads // mask.shape[2], dim=2).permute(0, 2, 1, 3)


def block_sparse_attention(q, k, v, block_ids, block_size, scale, sink=None, positions=None):
    """Same as `reference.ops.block_sparse_attention`."""
    tk = k.shape[1]
    blocks = ops.ids_to_mask(block_ids, -(-tk // block_size))
    keys = blocks.repeat_interleave(block_size, dim=-1)[..., :tk]
    keep = _per_head(keys, q.shape[2]) & _causal(q, k, positions)
    return _attend(q, k, v, keep, scale, sink).to(q.dtype)


def token_sparse_attention(q, k, v, token_ids, scale, sink=None, positions=None):
    """Same as `reference.ops.token_sparse_attention`."""
    keep = _per_head(ops.ids_to_mask(token_ids, k.shape[1]), q.shape[2]) & _causal(q, k, positions)
    return _attend(q, k, v, keep, scale, sink).to(q.dtype)


TWINS = {"dense_attention": dense_attention, "block_sparse_attention": block_sparse_attention,
         "token_sparse_attention": token_sparse_attention}


@contextlib.contextmanager
def fast_reference_ops():
    """Inside the block, `reference.ops` runs these twins (every caller looks them up at call time)."""
    saved = {name: getattr(ops, name) for name in TWINS}
    try:
        for name, fn in TWINS.items():
            setattr(ops, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
