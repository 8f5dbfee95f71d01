# SPDX-License-Identifier: Apache-2.0
"""The PIC reference (`vllm_hysparse.reference.pic`, SPEC §4) against plain prefill and hand-computed K/V."""

import pytest
import torch

from tests.reference._models import VOCAB, close, differs, make_h2, make_hs
from tests.vllm_utils import random_prompts, reference_greedy
from vllm_hysparse.pic.layout import PICLayout
from vllm_hysparse.reference import HySparse2ForCausalLM
from vllm_hysparse.reference.pic import (
    cache_kv,
    isolated_segment_cache,
    layer_rotary,
    pic_greedy,
    pic_next_token_logits,
    pic_prefill,
    rotate_to,
)

MODELS = {
    "hysparse": lambda: make_hs(101),
    "hysparse-headwise-qknorm": lambda: make_hs(102, gate_type="headwise", qk_norm=True, attention_bias=True),
    "hysparse2-nope": lambda: make_h2(103),
    "hysparse2-full-rope": lambda: make_h2(104, full_rope=True, qk_norm=True),
}
# Rope types whose frequencies or cos/sin scaling differ from plain RoPE (rotation only must be applied).
ROPE_MODELS = {
    "hysparse-linear": lambda: make_hs(105, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "hysparse-yarn": lambda: make_hs(106, max_position_embeddings=256,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
}


def prompt(lengths, seed):
    return random_prompts([sum(lengths)], VOCAB, seed)[0]


@torch.no_grad()
def plain_cache(model, ids):
    return cache_kv(model(torch.tensor([ids]), use_cache=True, logits_to_keep=1).past_key_values)


@torch.no_grad()
def plain_last_logits(model, ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0, -1]


@torch.no_grad()
def hidden_states(model, ids):
    """Residual stream entering every layer, `hs[l] [1, T, hidden]` (hs[0] the embeddings)."""
    return model(torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states


@torch.no_grad()
def hand_kv(model, layer_idx, hs, rows, positions):
    """K/V `[1, G, R, D]` a layer stores for `rows` of hidden states `hs`, computed from its weights by hand.

    K is pre-RoPE projected (and k-normed), then rotated by the layer's own
    RoPE at `positions`; NoPE layers keep it unrotated.
    """
    cfg, layer = model.config, model.model.layers[layer_idx]
    attn = layer.self_attn
    if isinstance(model, HySparse2ForCausalLM) and layer_idx >= cfg.num_self_decoder_layers:
        # Bridged: projected from the stream entering the bridge source layer.
        x = attn.bridge_norm(hs[cfg.bridge_source[layer_idx]][:, rows])
    else:
        x = layer.input_layernorm(hs[layer_idx][:, rows])
    own_swa = hasattr(attn, "swa_k_proj")  # a HySparse sparse layer stores its SWA branch K'/V'
    k_proj, v_proj = (attn.swa_k_proj, attn.swa_v_proj) if own_swa else (attn.k_proj, attn.v_proj)
    k = k_proj(x).view(1, len(rows), -1, cfg.head_dim)
    v = v_proj(x).view(1, len(rows), -1, cfg.head_dim)
    if cfg.qk_norm:
        k = (attn.swa_k_norm if own_swa else attn.k_norm)(k)
    rope = layer_rotary(model, layer_idx)
    if rope is not None:
        k = rope(k, torch.tensor(positions))
    return k.transpose(1, 2), v.transpose(1, 2)


def first_layer_input_is_embedding(model, layer_idx) -> bool:
    """Whether the layer's stored K/V depend on its own token only (not on any attention before it)."""
    if isinstance(model, HySparse2ForCausalLM) and layer_idx >= model.config.num_self_decoder_layers:
        return model.config.bridge_source[layer_idx] == 0
    return layer_idx == 0


# ----------------------------------------------------------------------------- 1, 2: PIC that is plain prefill


@pytest.mark.parametrize("make", list(MODELS))
@pytest.mark.parametrize("segments,seam", [((5, 7, 3, 6, 4), 7), ((4, 1, 9, 3), 100)], ids=["seam-eq-max", "seam-big"])
def test_seam_covering_every_segment_is_plain_prefill(make, segments, seam):
    model = MODELS[make]()
    ids = prompt(segments, seed=len(make) * 10 + sum(segments))
    layout = PICLayout(segments, seam)
    # The assembled cache is plain prefill's, every layer.
    cache, last = pic_prefill(model, ids, layout)
    got, want = cache_kv(cache), plain_cache(model, ids)
    assert sorted(got) == sorted(want)
    for i in want:
        close(got[i][0], want[i][0], atol=1e-5)
        close(got[i][1], want[i][1], atol=1e-5)
    close(last, plain_last_logits(model, ids), atol=1e-5)
    close(pic_next_token_logits(model, ids, layout), last, atol=0)
    # Greedy continuation: identical tokens, matching logprobs, at every position.
    ref = reference_greedy(model, [ids], max_tokens=5)[0]
    pic = pic_greedy(model, ids, layout, max_tokens=5)
    assert pic.token_ids == ref.token_ids
    for a, b in zip(ref.logprobs, pic.logprobs, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t] - b[t]) < 1e-5


@pytest.mark.parametrize("make", list(MODELS))
def test_prefix_and_query_only_is_plain_prefill(make):
    model = MODELS[make]()
    ids = prompt((9, 6), seed=7)
    layout = PICLayout((9, 6), 0)  # no middle segment: the seam never applies
    close(pic_next_token_logits(model, ids, layout), plain_last_logits(model, ids), atol=1e-5)
    assert pic_greedy(model, ids, layout, 4).token_ids == reference_greedy(model, [ids], 4)[0].token_ids


# ----------------------------------------------------------------------------- 3: rotation


@pytest.mark.parametrize("make", list(MODELS) + list(ROPE_MODELS))
@pytest.mark.parametrize("start", [11, 300])
def test_rotate_to_equals_computing_at_the_start(make, start):
    model = {**MODELS, **ROPE_MODELS}[make]()
    n = 6
    seg = prompt((n,), seed=start)
    iso = isolated_segment_cache(model, seg)
    before = {i: (k.clone(), v.clone()) for i, (k, v) in iso.items()}
    moved = rotate_to(iso, model, start)
    rotary = [i for i in iso if layer_rotary(model, i) is not None]
    # SPEC: HySparse ropes every layer; HySparse2 its sliding layers, and full/bridged ones only with full_rope.
    cfg = model.config
    if isinstance(model, HySparse2ForCausalLM):
        assert rotary == [i for i in iso if cfg.layer_types[i] == "sliding_attention" or cfg.full_rope]
        assert len(rotary) < len(iso) or cfg.full_rope
    else:
        assert rotary == list(iso) == list(range(cfg.num_hidden_layers))
    # Every rotary layer: K of the segment's own hidden states rotated by the model's RoPE at start..start+n-1.
    # (A segment alone is shift-invariant, so its hidden states are those of any start.)
    hs = hidden_states(model, seg)
    for i in iso:
        k_want, v_want = hand_kv(model, i, hs, list(range(n)), list(range(start, start + n)))
        close(moved[i][0], k_want, atol=2e-5)
        close(moved[i][1], v_want, atol=2e-5)
        if i not in rotary:
            assert moved[i][0] is iso[i][0]  # NoPE K: as stored
        else:
            assert differs(moved[i][0], iso[i][0])
        assert moved[i][1] is iso[i][1]  # every V: as stored
    # Layer 0 stores K/V of its own token only: the model's own prefill at start.. is the reference.
    ctx = prompt((start,), seed=start + 1) + seg
    plain0 = plain_cache(model, ctx)[0]
    close(moved[0][0], plain0[0][:, :, start:], atol=2e-5)
    close(moved[0][1], plain0[1][:, :, start:], atol=1e-6)
    # RoPE composes; the input was not touched; a DynamicCache is accepted too.
    close(rotate_to(rotate_to(iso, model, 5), model, start - 5)[rotary[0]][0], moved[rotary[0]][0], atol=2e-5)
    for i, (k, v) in before.items():
        assert torch.equal(iso[i][0], k) and torch.equal(iso[i][1], v)
    with torch.no_grad():
        cache = model(torch.tensor([seg]), use_cache=True, logits_to_keep=1).past_key_values
    again = rotate_to(cache, model, start)
    for i in iso:
        assert torch.equal(again[i][0], moved[i][0])


# ----------------------------------------------------------------------------- 4, 5: isolation


@pytest.mark.parametrize("make", list(MODELS))
@pytest.mark.parametrize("seam", [0, 2])
def test_isolation_matters_and_ignores_what_came_before(make, seam):
    model = MODELS[make]()
    segments = (7, 6, 5)
    layout = PICLayout(segments, seam)
    ids = prompt(segments, seed=31 + seam)
    # Same segment and query after a different prefix of the same length.
    other = prompt((7,), seed=32 + seam) + ids[7:]
    # PIC is not plain prefill once rows are spliced (so the checks below can fail).
    assert differs(pic_next_token_logits(model, ids, layout), plain_last_logits(model, ids))
    a, _ = pic_prefill(model, ids, layout)
    b, _ = pic_prefill(model, other, layout)
    a, b = cache_kv(a), cache_kv(b)
    plain_a, plain_b = plain_cache(model, ids), plain_cache(model, other)
    lo, hi = layout.spliced_span(1)
    assert (lo, hi) == (7 + seam, 13)
    context_dependent = 0
    for i in a:
        # Spliced rows: the segment's isolated K/V, the same whatever prefix preceded it.
        for x, y in zip(a[i], b[i]):
            assert torch.equal(x[:, :, lo:hi], y[:, :, lo:hi]), f"layer {i}: spliced rows depend on the prefix"
        # Plain prefill's rows there do depend on it (except where K/V see their own token only).
        if not first_layer_input_is_embedding(model, i):
            assert differs(plain_a[i][0][:, :, lo:hi], plain_b[i][0][:, :, lo:hi])
            context_dependent += 1
        # The prefix and the seam (right after the plain prefix) are plain prefill's rows.
        for x, y in zip(a[i], plain_a[i]):
            close(x[:, :, :lo], y[:, :, :lo], atol=1e-5)
    assert context_dependent > 0
    # The isolated cache is a function of the segment alone.
    seg = ids[7:13]
    first, second = isolated_segment_cache(model, seg), isolated_segment_cache(model, seg)
    for i in first:
        assert torch.equal(first[i][0], second[i][0]) and torch.equal(first[i][1], second[i][1])


@pytest.mark.parametrize("make", list(MODELS))
def test_interior_row_is_the_isolated_forward(make):
    model = MODELS[make]()
    segments, seam = (6, 4, 7, 5), 2
    layout = PICLayout(segments, seam)
    ids = prompt(segments, seed=41)
    cache = cache_kv(pic_prefill(model, ids, layout)[0])
    i, a, n = layout.middle()[1]  # the second middle segment: after a spliced one
    lo, hi = layout.spliced_span(i)
    rows = list(range(lo - a, hi - a))  # the interior rows, past the seam
    iso_hs = hidden_states(model, ids[a:a + n])  # the segment alone
    ctx_hs = hidden_states(model, ids)  # the segment in context
    for layer in cache:
        k, v = cache[layer][0][:, :, lo:hi], cache[layer][1][:, :, lo:hi]
        k_iso, v_iso = hand_kv(model, layer, iso_hs, rows, [a + j for j in rows])
        close(k, k_iso, atol=2e-5)
        close(v, v_iso, atol=2e-5)
        if not first_layer_input_is_embedding(model, layer):
            # The first interior row differs from its in-context K/V: HySparse2's first
            # layer is a sliding one, whose window reaches the previous segment there
            # (and only there: rows a window past the segment start see the same keys).
            k_ctx, v_ctx = hand_kv(model, layer, ctx_hs, [lo], [lo])
            assert differs(k[:, :, :1], k_ctx) and differs(v[:, :, :1], v_ctx), f"layer {layer}: the in-context row"


def test_layout_must_cover_the_prompt():
    model = MODELS["hysparse"]()
    with pytest.raises(ValueError, match="layout covers 10 tokens"):
        pic_prefill(model, prompt((12,), seed=1), PICLayout((4, 6), 8))
