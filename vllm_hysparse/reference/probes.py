# SPDX-License-Identifier: Apache-2.0
"""Selection probes: how much of a sparse layer's own dense attention its selection keeps.

For one sparse attention layer, from the inputs of its forward: the oracle
coverage `M` (probability mass that the layer's own dense attention puts on
the keys its selection uses) and the recall of the used selection against the
layer's own dense top-k. Validation reports them per layer (`validate`);
recovery trains on `1 - M` (`recovery.train.CoverageTerm`).
"""

import torch

from vllm_hysparse.reference import ops
from vllm_hysparse.reference.modeling_hysparse import HySparseSparseAttention
from vllm_hysparse.reference.modeling_hysparse2 import CrossSparseAttention


def _coverage(p: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Mass `[B, H, T]` that probabilities p `[B, H, T, Tk]` put on the selected keys (bool, same shape)."""
    return (p * selected).sum(-1)


def _recall(used: torch.Tensor, own: torch.Tensor, size: int) -> torch.Tensor:
    """Share `[B, T, G]` of `own` ids (-1 padded) also in `used` ids."""
    used_mask, own_mask = ops.ids_to_mask(used, size), ops.ids_to_mask(own, size)
    return (used_mask & own_mask).sum(-1) / own_mask.sum(-1).clamp_min(1)


def hysparse_selection(attn: HySparseSparseAttention, args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(coverage `[B, H, T]`, recall `[B, T, G]`) of one HySparse sparse layer, from its forward's inputs.

    Coverage is the mass the layer's own dense attention (its query against its own `swa_k_proj` keys) puts
    on the blocks its global branch uses; differentiable, so recovery can train on it. None without selection.
    """
    x, positions, rope, _cache, shared, switches = args
    if not switches.sparse_selection:
        return None
    cfg, d = attn.config, attn.config.head_dim
    q = attn.q_proj(x).view(*x.shape[:2], -1, d)
    k = attn.swa_k_proj(x).view(*x.shape[:2], -1, d)
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.swa_k_norm(k)
    q, k = rope(q, positions), rope(k, positions)
    with torch.no_grad():
        own = ops.oracle_block_topk(q, k, attn.scale, cfg.sparse_block_size, cfg.sparse_topk_blocks)
    used = shared["block_ids"] if switches.kv_sharing else own
    nb = -(-k.shape[1] // cfg.sparse_block_size)
    keys = ops.ids_to_mask(used, nb).repeat_interleave(cfg.sparse_block_size, -1)[..., :k.shape[1]]
    keys = keys.repeat_interleave(q.shape[2] // k.shape[2], dim=2).permute(0, 2, 1, 3)
    p = ops.sink_softmax(ops.attention_logits(q, k, attn.scale), None)
    return _coverage(p, keys), _recall(used, own, nb)


def hysparse2_selection(attn: CrossSparseAttention, args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(coverage `[B, H, T]`, recall `[B, T, G]`) of one HySparse2 cross sparse layer over its cross full
    layer's cache (its own K/V with cross KV sharing off); None without token selection."""
    x, positions, ctx = args
    if not ctx.switches.token_selection:
        return None
    cfg = attn.config
    q = ctx.rope(attn.query(x), positions)
    k = ctx.shared["k"] if ctx.switches.cross_kv_sharing else attn.project_own_kv(x, positions, ctx)[0]
    used = ctx.shared["token_ids"]
    with torch.no_grad():
        own = ops.token_topk(q, k, attn.scale, cfg.sparse_topk_tokens, cfg.recent_window, cfg.score_head_reduce,
                             positions=positions)
    keys = ops.ids_to_mask(used, k.shape[1]).repeat_interleave(q.shape[2] // k.shape[2], dim=2).permute(0, 2, 1, 3)
    p = ops.sink_softmax(ops.attention_logits(q, k, attn.scale, positions), None)
    return _coverage(p, keys), _recall(used, own, k.shape[1])


SELECTION = {HySparseSparseAttention: hysparse_selection, CrossSparseAttention: hysparse2_selection}
