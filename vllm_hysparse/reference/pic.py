# SPDX-License-Identifier: Apache-2.0
"""Plain PyTorch reference for position-independent caching (PIC, SPEC §4).

A PIC prompt is segments `s_0 .. s_n` with a seam `w` (a `SegmentLayout`: the serving code's
`pic.layout.PICLayout` is one, but this file reads only its lengths and works out the rest itself).
What the model computes for it, whatever is or is not cached:

- `s_0` (the prefix) is computed as a plain prefix;
- every middle segment `s_i` is computed *in isolation* (alone, positions
  `0 .. len_i - 1`), and its stored K/V are moved to its start `a_i` by
  rotating the K of rotary layers by `a_i` (NoPE K and every V as stored);
- the first `w_i = min(w, len_i)` rows of every middle segment (the seam) and
  every row of `s_n` are recomputed in context through every layer, their fresh
  K/V replacing the stored ones; decode tokens extend `s_n`.

This file builds that cache with the reference models' own KV cache (a
transformers `DynamicCache`, one entry per layer that owns K/V): HySparse
stores every full layer's K/V and every sparse layer's SWA branch K'/V';
HySparse2 stores the self-decoder layers' K/V and the bridged K/V of every
cross full layer (its cross sparse layers own none). Oracle indices are never
cached: the reference models recompute them on every forward from the
assembled K/V, which is what SPEC asks for recomputed rows.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from vllm_hysparse.configs.hysparse2 import SLIDING
from vllm_hysparse.reference.layers import Fp8KVCache, RotaryEmbedding
from vllm_hysparse.reference.modeling_hysparse2 import HySparse2ForCausalLM


class SegmentLayout(Protocol):
    segments: tuple[int, ...]  # lengths in prompt tokens: the prefix, the middle segments, the query
    seam: int  # `w`: the leading rows of every middle segment that are recomputed in context


# layer index -> (K, V), each `[B, G, T, D]` as the transformers cache holds them.
# K of rotary layers is post-RoPE.
LayerKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PICCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, float]]  # per generated position: top-k token id -> float64 log-softmax


# ----------------------------------------------------------------------------- cache <-> per-layer K/V


def cache_kv(cache: DynamicCache) -> LayerKV:
    """The per-layer K/V a reference cache holds (layers that own none, e.g. HySparse2 cross sparse, skipped)."""
    return {i: (layer.keys, layer.values) for i, layer in enumerate(cache.layers) if layer.is_initialized}


def append_kv(cache: DynamicCache, kv: LayerKV) -> None:
    """Append rows `kv` to every layer of `cache` without running any layer (the splice).

    `kv` must name exactly the layers the cache holds and give each the same
    number of rows, or the cache's layers would disagree on its length.
    """
    held = cache_kv(cache)
    if set(kv) != set(held):
        raise ValueError(f"K/V for layers {sorted(kv)}, but the cache holds layers {sorted(held)}")
    for i, (k, v) in kv.items():
        cache.update(k, v, i)


def slice_rows(kv: LayerKV, lo: int, hi: int) -> LayerKV:
    """Rows (token positions) `[lo, hi)` of every layer."""
    return {i: (k[:, :, lo:hi], v[:, :, lo:hi]) for i, (k, v) in kv.items()}


# ----------------------------------------------------------------------------- isolated segments and rotation


@torch.no_grad()
def isolated_segment_cache(model, ids, cache: DynamicCache | None = None) -> LayerKV:
    """Run `model` on segment `ids` (`[T]` or list) alone, at positions `0 .. T-1`; its per-layer stored K/V.

    Returns {layer index: (K, V)}, each `[1, G, T, D]`: what the segment store
    holds for this segment. K of rotary layers is rotated for positions 0 .. T-1.
    `cache`: an empty cache to run in (an `Fp8KVCache`: the segment's layers
    attend to rounded K/V, as the engine's prefill does, while the store keeps
    what each layer wrote before rounding).
    """
    ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    # logits_to_keep=1: only the cache is wanted (HySparse2 then skips the
    # cross-decoder for all but one row; its cached K/V are bridged from the
    # self-decoder, so they are complete either way).
    res = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    written = getattr(res.past_key_values, "written", None)
    return dict(written) if written is not None else cache_kv(res.past_key_values)


def layer_rotary(model, layer_idx: int) -> RotaryEmbedding | None:
    """The RoPE applied to the stored K of `layer_idx`, or None for a NoPE layer.

    HySparse: every layer (full K and SWA K') uses the model's RoPE.
    HySparse2: sliding layers their partial `swa_rotary_dim` / `swa_rope_theta`
    RoPE; full layers (self and bridged cross) the full RoPE with
    `config.full_rope`, none without.
    """
    if isinstance(model, HySparse2ForCausalLM):
        if model.config.layer_types[layer_idx] == SLIDING:
            return model.model.swa_rotary_emb
        return model.model.rotary_emb  # None unless full_rope
    return model.model.rotary_emb


def rotate_k(k: torch.Tensor, rope: RotaryEmbedding, shift: int) -> torch.Tensor:
    """`R(shift) k` for post-RoPE `k [B, G, T, D]`: every row's rotary dims turned by `shift` more positions.

    RoPE composes (`R(a) R(p) = R(a + p)` per frequency pair), so this moves
    rows computed at positions `p` to `p + shift`. Only the rotation: the
    attention scaling some rope types fold into cos/sin is already in `k`.
    """
    inv_freq, _ = rope.inv_freq()  # [rd / 2]
    rd, half = rope.rotary_dim, rope.rotary_dim // 2
    ang = shift * inv_freq.double()  # float64 angle: large shifts keep their precision
    cos, sin = torch.cat([ang.cos()] * 2).float(), torch.cat([ang.sin()] * 2).float()  # [rd]
    rot, rest = k[..., :rd].float(), k[..., rd:]
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([(rot * cos + rotated_half * sin).to(k.dtype), rest], dim=-1)


def rotate_to(cache_or_kv, model, start: int) -> LayerKV:
    """Move isolated K/V (positions `0 .. T-1`) to `start .. start + T-1`; a new mapping, the input untouched.

    `cache_or_kv` is a `DynamicCache` or {layer: (K, V)} with K, V `[B, G, T, D]`.
    Rotary layers' K is rotated by `start` (each layer its own theta and
    rotary dim); NoPE K and every V are returned as they are (the same tensors:
    nothing here writes in place).
    """
    kv = cache_kv(cache_or_kv) if isinstance(cache_or_kv, DynamicCache) else cache_or_kv
    out = {}
    for i, (k, v) in kv.items():
        rope = layer_rotary(model, i)
        out[i] = (k if rope is None else rotate_k(k, rope, start), v)
    return out


# ----------------------------------------------------------------------------- PIC prefill and greedy decoding


@torch.no_grad()
def pic_prefill(model, prompt_ids: list[int], layout: SegmentLayout,
                cache: DynamicCache | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """Assemble the cache of a PIC prompt as SPEC §4 says; (cache, logits `[vocab]` of the last prompt row).

    `cache`: an empty cache to assemble into (`layers.Fp8KVCache` for an FP8 engine's), else a new one;
    isolated segments then run in an empty copy of it.

    The prefix is fed plainly; for every middle segment the seam rows are fed
    in context (attending to everything assembled before them), then the
    segment's other rows are spliced from its isolated, rotated K/V without
    running any layer on them; the query is fed in context.
    """
    lengths, prompt_len = list(layout.segments), sum(layout.segments)
    if prompt_len != len(prompt_ids):
        raise ValueError(f"layout covers {prompt_len} tokens, the prompt has {len(prompt_ids)}")
    ids = torch.tensor([prompt_ids], dtype=torch.long)

    def feed(cache, lo, hi):
        res = model(ids[:, lo:hi], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return res.past_key_values, res.logits[0, -1]

    fresh = cache.empty_like if isinstance(cache, Fp8KVCache) else lambda: None
    cache, _ = feed(cache, 0, lengths[0])
    a = lengths[0]
    for n in lengths[1:-1]:
        lo, hi = a + min(layout.seam, n), a + n  # seam is [a, lo), spliced [lo, hi)
        if lo > a:
            cache, _ = feed(cache, a, lo)
        if hi > lo:
            assert cache.get_seq_length() == lo
            stored = isolated_segment_cache(model, ids[0, a:hi], fresh())
            append_kv(cache, slice_rows(rotate_to(stored, model, a), lo - a, hi - a))
        a = hi
    assert cache.get_seq_length() == a == prompt_len - lengths[-1]
    return feed(cache, a, prompt_len)


def pic_next_token_logits(model, prompt_ids: list[int], layout: SegmentLayout) -> torch.Tensor:
    """`[vocab]` float logits of the last prompt row under PIC (for KL against plain prefill)."""
    return pic_prefill(model, prompt_ids, layout)[1]


@torch.no_grad()
def pic_greedy(model, prompt_ids: list[int], layout: SegmentLayout, max_tokens: int,
               top_logprobs: int = 5, cache: DynamicCache | None = None,
               forced: list[int] | None = None) -> PICCompletion:
    """Greedy continuation of a PIC prompt, step by step with the assembled cache.

    Logprobs as `tests/vllm_utils.reference_greedy`: per generated position the
    top-`top_logprobs` token ids -> float64 log-softmax of the logits.
    `forced`: continue with these tokens instead of the argmax (the reference
    along another engine's continuation), `max_tokens` of them.
    """
    cache, logits = pic_prefill(model, prompt_ids, layout, cache)
    tokens, logprobs = [], []
    for step in range(max_tokens):
        lp = torch.log_softmax(logits.double(), dim=-1)
        top = torch.topk(lp, top_logprobs)
        token = int(top.indices[0]) if forced is None else forced[step]
        tokens.append(token)
        logprobs.append({int(i): float(v) for i, v in zip(top.indices, top.values)})
        if step + 1 < max_tokens:  # decode tokens extend the query, plainly
            res = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = res.past_key_values, res.logits[0, -1]
    return PICCompletion(tokens, logprobs)
