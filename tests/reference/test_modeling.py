# SPDX-License-Identifier: Apache-2.0
"""Reference HySparse / HySparse2 models: cache, early exit, switches, loading, SPEC checkpoints."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401  (registers the Auto classes)
from tests.reference._models import (
    FULL,
    H2_TWO_SOURCES,
    HS_LAYERS,
    SLIDING,
    SPARSE,
    VOCAB,
    close,
    differs,
    gen,
    logits,
    make_h2,
    make_hs,
    randn,
    state,
    tokens,
)
from tests.reference._reference_math import hysparse2_forward, hysparse_forward, rope
from vllm_hysparse.reference import CheckpointError, HySparse2ForCausalLM, HySparseForCausalLM

# ----------------------------------------------------------------------------- against loop oracles

HS_VARIANTS = {
    "plain": {},
    "headwise-qknorm-bias-tied": dict(gate_type="headwise", qk_norm=True, attention_bias=True,
                                      tie_word_embeddings=True),
    "mha-nosinks": dict(num_key_value_heads=4, use_sinks=False),
    # Qwen3-MoE style, with a dense first layer.
    "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                mlp_only_layers=[0]),
    # SPEC §2.6: q/k and v head dims differ (the papers' 192 / 128, scaled down), both ways.
    "vdim-narrow": dict(head_dim=12, v_head_dim=8),
    "vdim-wide-headwise-qknorm": dict(v_head_dim=10, gate_type="headwise", qk_norm=True),
}


@pytest.mark.parametrize("variant", list(HS_VARIANTS))
@pytest.mark.parametrize("switch", [None, "sparse_selection", "kv_sharing", "swa_branch"])
def test_hysparse_matches_loop_oracle(variant, switch):
    model = make_hs(seed=11, **HS_VARIANTS[variant])
    ids = tokens(12, 2, 14)  # 4 blocks of 4, top-2: selection drops keys
    on = logits(model, ids)
    if switch is not None:
        model.set_switches(**{switch: False})
    got = logits(model, ids)
    want = hysparse_forward(state(model), model.config.to_dict(), ids, **({switch: False} if switch else {}))
    close(got, want)
    if switch is not None:
        assert differs(got, on), f"switch {switch} has no effect"


H2_VARIANTS = {
    "nope-max": dict(),
    "rope-sum": dict(full_rope=True, score_head_reduce="sum"),
    "gqa-headwise-qknorm-bias": dict(num_key_value_heads=2, gate_type="headwise", qk_norm=True, attention_bias=True),
    "two-sources": dict(H2_TWO_SOURCES, num_key_value_heads=2, tie_word_embeddings=True),
    # Qwen2-MoE style: not renormalised, a sigmoid-gated shared expert.
    "moe-shared": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24),
    "vdim-narrow-rope": dict(head_dim=12, v_head_dim=8, full_rope=True),
    "vdim-wide-gqa-headwise-qknorm": dict(num_key_value_heads=2, v_head_dim=10, gate_type="headwise", qk_norm=True),
}


@pytest.mark.parametrize("variant", list(H2_VARIANTS))
@pytest.mark.parametrize("switch", [None, "sliding_window", "token_selection", "forced_window", "bridge", "early_exit"])
def test_hysparse2_matches_loop_oracle(variant, switch):
    model = make_h2(seed=21, **H2_VARIANTS[variant])
    ids = tokens(22, 2, 13)  # k_g + w = 8 < 13: selection drops keys
    on = logits(model, ids)
    if switch is not None:
        model.set_switches(**{switch: False})
    got = logits(model, ids)
    kw = {switch: False} if switch not in (None, "early_exit") else {}
    want = hysparse2_forward(state(model), model.config.to_dict(), ids, **kw)
    close(got, want)
    if switch == "early_exit":
        close(got, on, atol=1e-5)
    elif switch is not None:
        assert differs(got, on), f"switch {switch} has no effect"


def own_kv_tensors(model, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Random dense-layer K/V tensors (named as in `self_attn`) for every cross sparse layer."""
    cfg, g = model.config, gen(seed)
    width = {"k": cfg.num_key_value_heads * cfg.head_dim, "v": cfg.num_key_value_heads * cfg.v_head_dim}
    out = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind != SPARSE:
            continue
        t = {f"{n}_proj.weight": randn(g, width[n], cfg.hidden_size, std=cfg.hidden_size**-0.5) for n in "kv"}
        if cfg.attention_bias:
            t.update({f"{n}_proj.bias": 0.2 * randn(g, width[n]) for n in "kv"})
        if cfg.qk_norm:
            t["k_norm.weight"] = 1.0 + 0.3 * randn(g, cfg.head_dim)
        out[i] = t
    return out


@pytest.mark.parametrize("variant", list(H2_VARIANTS))
@pytest.mark.parametrize("token_selection", [True, False])
def test_hysparse2_own_cross_kv_matches_loop_oracle(variant, token_selection):
    """cross_kv_sharing=False: cross sparse layers attend over K/V from their own input and given projections."""
    model = make_h2(seed=23, **H2_VARIANTS[variant])
    ids = tokens(24, 2, 13)
    model.set_switches(token_selection=token_selection)
    shared = logits(model, ids)
    own = own_kv_tensors(model, seed=25)
    model.set_switches(cross_kv_sharing=False)
    with pytest.raises(ValueError, match="set_own_kv"):
        logits(model, ids)
    for i, t in own.items():
        model.model.layers[i].self_attn.set_own_kv(t)
    got = logits(model, ids)
    # The borrowed tensors stay outside the checkpoint.
    assert state(model).keys() == state(make_h2(seed=23, **H2_VARIANTS[variant])).keys()
    sd = {**state(model), **{f"model.layers.{i}.self_attn.{n}": w for i, t in own.items() for n, w in t.items()}}
    want = hysparse2_forward(sd, model.config.to_dict(), ids, token_selection=token_selection,
                             cross_kv_sharing=False)
    close(got, want)
    assert differs(got, shared), "switch cross_kv_sharing has no effect"
    # Cross-decoder K/V now depend on cross-decoder states: early exit must not be taken.
    close(logits(model, ids, logits_to_keep=1), got[:, -1:], atol=1e-5)
    # Own K/V go through the cache like any layer's.
    close(torch.cat(run_incrementally(model, ids, [6, 1, 1, 5]), dim=1), got)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "set_own_kv"):
            layer.self_attn.set_own_kv(None)
    model.set_switches(cross_kv_sharing=True)
    close(logits(model, ids), shared, atol=0)


def test_own_cross_kv_of_the_wrong_shape_is_refused():
    model = make_h2(seed=26)
    bad = own_kv_tensors(model, seed=27)[4]
    bad["v_proj.weight"] = bad["v_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="layer 4: own K/V tensors do not fit.*v_proj.weight"):
        model.model.layers[4].self_attn.set_own_kv(bad)
    with pytest.raises(ValueError, match="layer 4: own K/V tensors do not fit.*k_norm"):
        model.model.layers[4].self_attn.set_own_kv({**own_kv_tensors(model, seed=27)[4],
                                                     "k_norm.weight": torch.ones(8)})


def test_set_switches_rejects_unknown():
    for model in (make_hs(), make_h2()):
        with pytest.raises(ValueError, match="bogus"):
            model.set_switches(bogus=True)
        sw = model.set_switches(kv_sharing=False)
        assert sw.kv_sharing is False and model.switches.kv_sharing is False


# ----------------------------------------------------------------------------- identity with dense attention


def dense_model_logits(sd, cfg, ids, kv_names):
    """Independent dense Llama forward with SDPA: layer i uses K/V projections `kv_names[i]`."""
    nh, ng, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    bsz, t = ids.shape
    pos = list(range(t))

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    h = sd["model.embed_tokens.weight"][ids]
    for i, (kn, vn) in enumerate(kv_names):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(bsz, t, nh, d)
        k = (x @ sd[p + f"self_attn.{kn}.weight"].T).view(bsz, t, ng, d)
        v = (x @ sd[p + f"self_attn.{vn}.weight"].T).view(bsz, t, ng, d)
        q, k = rope(q, pos, cfg.rope_theta).float(), rope(k, pos, cfg.rope_theta).float()
        k, v = k.repeat_interleave(nh // ng, 2), v.repeat_interleave(nh // ng, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + o.transpose(1, 2).reshape(bsz, t, nh * d) @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        m = F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)
        h = h + m @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("gate_type", ["elementwise", "headwise"])
def test_hysparse_without_sparsity_is_dense_attention(gate_type):
    t = 12
    model = make_hs(seed=31, sparse_topk_blocks=3, swa_window=t, use_sinks=False, gate_type=gate_type)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "sparse_gate_proj"):
                attn.sparse_gate_proj.weight.zero_()
                attn.swa_gate_proj.weight.zero_()  # sigmoid(0) = 0.5 on each branch
    model.set_switches(kv_sharing=False)
    ids = tokens(32, 2, t)
    sd = state(model)

    # One sparse layer's attention output against SDPA over its own swa_k / swa_v.
    seen = {}
    attn = model.model.layers[1].self_attn
    handle = attn.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], out=out))
    got_logits = logits(model, ids)
    handle.remove()
    x, pre = seen["x"], "model.layers.1.self_attn."
    q = (x @ sd[pre + "q_proj.weight"].T).view(2, t, 4, 8)
    k = (x @ sd[pre + "swa_k_proj.weight"].T).view(2, t, 2, 8)
    v = (x @ sd[pre + "swa_v_proj.weight"].T).view(2, t, 2, 8)
    q, k = rope(q, range(t), 1000.0).float(), rope(k, range(t), 1000.0).float()
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True)
    close(seen["out"], o.transpose(1, 2).reshape(2, t, 32) @ sd[pre + "o_proj.weight"].T, atol=1e-5)

    # The whole model is then a dense Llama with each sparse layer's own swa K/V.
    kv = [("k_proj", "v_proj") if k == FULL else ("swa_k_proj", "swa_v_proj") for k in HS_LAYERS]
    close(got_logits, dense_model_logits(sd, model.config, ids, kv))
    # Sanity: the real thing (shared KV) is not the same model.
    model.set_switches(kv_sharing=True)
    assert differs(logits(model, ids), got_logits)


# ----------------------------------------------------------------------------- KV cache


def run_incrementally(model, ids, pieces, first_keep=0):
    """Feed `ids` in pieces through the cache; return the logits of every row, concatenated."""
    out, past, start = [], None, 0
    with torch.no_grad():
        for i, n in enumerate(pieces):
            keep = first_keep if i == 0 else 0
            res = model(ids[:, start:start + n], past_key_values=past, use_cache=True, logits_to_keep=keep)
            out.append(res.logits)
            past, start = res.past_key_values, start + n
    assert start == ids.shape[1]
    return out


@pytest.mark.parametrize("make", [make_hs, lambda seed: make_hs(seed, gate_type="headwise", qk_norm=True),
                                  lambda seed: make_hs(seed, head_dim=12, v_head_dim=8)],
                         ids=["hysparse", "hysparse-headwise-qknorm", "hysparse-vdim"])
def test_hysparse_cache_matches_full_forward(make):
    model = make(41)
    pieces = [7, 1, 1, 1, 5, 1, 1]
    ids = tokens(42, 2, sum(pieces))
    full = logits(model, ids)
    got = torch.cat(run_incrementally(model, ids, pieces), dim=1)
    close(got, full)


H2_CACHE_VARIANTS = {
    "nope-max": {},
    "rope-sum": dict(full_rope=True, score_head_reduce="sum"),
    "two-sources": H2_TWO_SOURCES,
    "vdim-narrow": dict(head_dim=12, v_head_dim=8),
}


@pytest.mark.parametrize("variant", list(H2_CACHE_VARIANTS))
@pytest.mark.parametrize("first_keep", [0, 1])
def test_hysparse2_cache_matches_full_forward(variant, first_keep):
    model = make_h2(51, **H2_CACHE_VARIANTS[variant])
    pieces = [6, 1, 1, 1, 5, 1, 2]
    ids = tokens(52, 2, sum(pieces))
    full = logits(model, ids)
    parts = run_incrementally(model, ids, pieces, first_keep=first_keep)
    if first_keep:
        close(parts[0], full[:, pieces[0] - 1:pieces[0]])
        parts[0] = full[:, :pieces[0]]
    close(torch.cat(parts, dim=1), full)


# ----------------------------------------------------------------------------- early exit


@pytest.mark.parametrize("full_rope", [False, True])
@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("t,rows", [(20, [3, 10, 17]), (6, [1, 3, 5])], ids=["long", "short"])
def test_hysparse2_early_exit_is_exact(full_rope, reduce, t, rows):
    model = make_h2(61, full_rope=full_rope, score_head_reduce=reduce)
    ids = tokens(62 + t, 2, t)
    model.set_switches(early_exit=False)
    ref = logits(model, ids)
    model.set_switches(early_exit=True)
    # The cross-decoder really runs on the kept rows only.
    seen = []
    cross = model.model.layers[model.config.num_self_decoder_layers]
    handle = cross.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    last = logits(model, ids, logits_to_keep=1)
    some = logits(model, ids, logits_to_keep=torch.tensor(rows))
    handle.remove()
    assert seen == [1, len(rows)]
    close(last, ref[:, -1:], atol=1e-5)
    close(some, ref[:, rows], atol=1e-5)
    # Unordered row tensor: rows come back ascending.
    close(logits(model, ids, logits_to_keep=torch.tensor(rows[::-1])), ref[:, rows], atol=1e-5)


# ----------------------------------------------------------------------------- gradients, generate


def test_gradients_flow():
    for model, sparse_idx, names in (
        (make_hs(71), 1,
         ["q_proj.weight", "sparse_sinks", "swa_sinks", "swa_k_proj.weight", "sparse_gate_proj.weight"]),
        (make_h2(72), 4, ["q_proj.weight", "sinks", "gate_proj.weight"]),
    ):
        model.train()
        ids = tokens(73, 2, 14)
        out = model(ids, labels=ids, use_cache=False)
        want = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        close(out.loss, want, atol=1e-5)
        out.loss.backward()
        attn = model.model.layers[sparse_idx].self_attn
        for n in names:
            grad = attn.get_parameter(n).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0, n
        if isinstance(model, HySparse2ForCausalLM):
            # Through the bridge into the self-decoder, and into the sliding layers' sinks.
            for p in (model.model.layers[3].self_attn.bridge_norm.weight, model.model.layers[0].self_attn.sinks,
                      model.model.layers[1].self_attn.q_proj.weight):
                assert p.grad is not None and p.grad.abs().max() > 0
        else:
            # The full layer's K receives gradient from its sparse followers as well.
            assert model.model.layers[0].self_attn.k_proj.weight.grad.abs().max() > 0


@pytest.mark.parametrize("make", [make_hs, make_h2], ids=["hysparse", "hysparse2"])
def test_loss_with_logits_to_keep_scores_the_next_token(make):
    model = make(75)
    ids = tokens(76, 1, 16)
    rows = torch.tensor([3, 7, 11])
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        part = model(ids, labels=ids, logits_to_keep=rows, use_cache=False)
    want = F.cross_entropy(full[0, rows], ids[0, rows + 1])
    close(part.loss, want, atol=1e-5)


@pytest.mark.parametrize("make", [make_hs, make_h2], ids=["hysparse", "hysparse2"])
def test_generate_greedy_matches_argmax(make):
    model = make(81)
    ids = tokens(82, 2, 9)
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    seq = ids
    for _ in range(5):
        nxt = logits(model, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


# ----------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("make", [make_hs, make_h2, lambda s: make_h2(s, **H2_TWO_SOURCES)],
                         ids=["hysparse", "hysparse2", "hysparse2-two-sources"])
def test_save_load_round_trip(make, tmp_path):
    model = make(91)
    ids = tokens(92, 2, 13)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    volatile = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
    a, b = loaded.config.to_dict(), model.config.to_dict()
    assert {k: v for k, v in a.items() if k not in volatile} == {k: v for k, v in b.items() if k not in volatile}
    close(logits(loaded, ids), logits(model, ids), atol=1e-6)


@pytest.mark.parametrize("edit", ["missing", "extra", "misshaped"])
@pytest.mark.parametrize("make", [make_hs, make_h2], ids=["hysparse", "hysparse2"])
def test_bad_checkpoint_names_the_tensor(make, edit, tmp_path):
    model = make(93)
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    if edit == "missing":
        name = "model.layers.1.self_attn.q_proj.weight"
        del sd[name]
    elif edit == "extra":
        name = "model.layers.4.self_attn.k_proj.weight"  # a sparse layer has no k_proj
        sd[name] = torch.randn(8, 32)
    else:
        name = "model.layers.0.self_attn.o_proj.weight"
        sd[name] = torch.randn(32, 16)
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_rope_scaling_honoured_by_loaded_model(tmp_path):
    model = make_hs(94, rope_theta=20000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_theta"] == 20000.0
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = tokens(95, 1, 13)
    want = hysparse_forward(state(model), written, ids)
    close(logits(model, ids), want)
    close(logits(loaded, ids), want)
    plain = dict(written, rope_scaling=None)
    assert differs(want, hysparse_forward(state(model), plain, ids))


# ----------------------------------------------------------------------------- SPEC-format checkpoints


def _spec_common(cfg, g, tensors, tie):
    v, hid = cfg["vocab_size"], cfg["hidden_size"]
    tensors["model.embed_tokens.weight"] = randn(g, v, hid)
    tensors["model.norm.weight"] = 1 + 0.3 * randn(g, hid)
    if not tie:
        tensors["lm_head.weight"] = randn(g, v, hid, std=hid**-0.5)


def _spec_layer_common(cfg, g, tensors, i):
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    p = f"model.layers.{i}."
    tensors[p + "input_layernorm.weight"] = 1 + 0.3 * randn(g, hid)
    tensors[p + "post_attention_layernorm.weight"] = 1 + 0.3 * randn(g, hid)
    tensors[p + "mlp.gate_proj.weight"] = randn(g, inter, hid, std=hid**-0.5)
    tensors[p + "mlp.up_proj.weight"] = randn(g, inter, hid, std=hid**-0.5)
    tensors[p + "mlp.down_proj.weight"] = randn(g, hid, inter, std=inter**-0.5)


def _proj(cfg, g, tensors, name, rows, biased=False):
    hid = cfg["hidden_size"]
    tensors[name + ".weight"] = randn(g, rows, hid, std=hid**-0.5)
    if biased and cfg["attention_bias"]:
        tensors[name + ".bias"] = 0.2 * randn(g, rows)


def _write(tmp_path, cfg, tensors):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


SPEC_VARIANTS = {
    "elementwise": dict(gate_type="elementwise", qk_norm=False, attention_bias=False, tie_word_embeddings=False),
    "headwise-qknorm-bias-tied": dict(gate_type="headwise", qk_norm=True, attention_bias=True,
                                      tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(SPEC_VARIANTS))
def test_spec_hysparse_checkpoint(variant, tmp_path):
    nh, ng, d, hid = 4, 2, 8, 32
    cfg = {
        "architectures": ["HySparseForCausalLM"], "model_type": "hysparse",
        "vocab_size": 61, "hidden_size": hid, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": nh, "num_key_value_heads": ng, "head_dim": d, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "hidden_act": "silu", "rope_theta": 5000.0, "rope_scaling": None,
        "layer_types": [FULL, SPARSE], "sparse_block_size": 4, "sparse_topk_blocks": 2, "swa_window": 5,
        "use_sinks": True, **SPEC_VARIANTS[variant],
    }
    g = gen(101 + len(variant))
    t = {}
    _spec_common(cfg, g, t, cfg["tie_word_embeddings"])
    for i in range(2):
        _spec_layer_common(cfg, g, t, i)
    a0, a1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    _proj(cfg, g, t, a0 + "q_proj", nh * d, True)
    _proj(cfg, g, t, a0 + "k_proj", ng * d, True)
    _proj(cfg, g, t, a0 + "v_proj", ng * d, True)
    t[a0 + "o_proj.weight"] = randn(g, hid, nh * d, std=(nh * d) ** -0.5)
    _proj(cfg, g, t, a1 + "q_proj", nh * d, True)
    _proj(cfg, g, t, a1 + "swa_k_proj", ng * d, True)
    _proj(cfg, g, t, a1 + "swa_v_proj", ng * d, True)
    t[a1 + "o_proj.weight"] = randn(g, hid, nh * d, std=(nh * d) ** -0.5)
    gate_rows = nh * d if cfg["gate_type"] == "elementwise" else nh
    _proj(cfg, g, t, a1 + "sparse_gate_proj", gate_rows)
    _proj(cfg, g, t, a1 + "swa_gate_proj", gate_rows)
    t[a1 + "sparse_sinks"] = randn(g, nh)
    t[a1 + "swa_sinks"] = randn(g, nh)
    if cfg["qk_norm"]:
        for n in (a0 + "q_norm", a0 + "k_norm", a1 + "q_norm", a1 + "swa_k_norm"):
            t[n + ".weight"] = 1 + 0.3 * randn(g, d)
    _write(tmp_path, cfg, t)

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model, HySparseForCausalLM)
    assert model.model.layers[1].self_attn.sparse_sinks.dtype == torch.float32
    ids = torch.randint(0, 61, (2, 13), generator=g)  # 4 blocks, top-2: selection active
    want = hysparse_forward(t, cfg, ids)
    close(logits(model, ids), want)
    assert differs(want, hysparse_forward(t, cfg, ids, sparse_selection=False))
    close(model(ids[:, :9], use_cache=False, logits_to_keep=1).logits, want[:, 8:9])


@pytest.mark.parametrize("full_rope", [False, True])
@pytest.mark.parametrize("variant", list(SPEC_VARIANTS))
def test_spec_hysparse2_checkpoint(full_rope, variant, tmp_path):
    nh, ng, d, hid = 4, 1, 8, 32
    cfg = {
        "architectures": ["HySparse2ForCausalLM"], "model_type": "hysparse2",
        "vocab_size": 61, "hidden_size": hid, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": nh, "num_key_value_heads": ng, "head_dim": d, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "hidden_act": "silu", "rope_theta": 5000.0, "rope_scaling": None,
        "layer_types": [SLIDING, FULL, FULL, SPARSE], "num_self_decoder_layers": 2, "bridge_sources": [1],
        "sparse_topk_tokens": 3, "recent_window": 4, "score_head_reduce": "sum" if full_rope else "max",
        "swa_window": 5, "swa_rope_theta": 1000.0, "swa_rotary_dim": 4, "full_rope": full_rope,
        "use_sinks": True, **SPEC_VARIANTS[variant],
    }
    g = gen(111 + 2 * len(variant) + full_rope)
    t = {}
    _spec_common(cfg, g, t, cfg["tie_word_embeddings"])
    gate_rows = nh * d if cfg["gate_type"] == "elementwise" else nh
    for i in range(4):
        _spec_layer_common(cfg, g, t, i)
        a = f"model.layers.{i}.self_attn."
        _proj(cfg, g, t, a + "q_proj", nh * d, True)
        t[a + "o_proj.weight"] = randn(g, hid, nh * d, std=(nh * d) ** -0.5)
        if cfg["qk_norm"]:
            t[a + "q_norm.weight"] = 1 + 0.3 * randn(g, d)
        if i < 3:  # sliding, self full, cross full: k/v projections (cross full: of the bridge source)
            _proj(cfg, g, t, a + "k_proj", ng * d, True)
            _proj(cfg, g, t, a + "v_proj", ng * d, True)
            if cfg["qk_norm"]:
                t[a + "k_norm.weight"] = 1 + 0.3 * randn(g, d)
        if i in (0, 3):  # sliding and cross sparse: gate and sinks
            _proj(cfg, g, t, a + "gate_proj", gate_rows)
            t[a + "sinks"] = randn(g, nh)
        if i == 2:
            t[a + "bridge_norm.weight"] = 1 + 0.3 * randn(g, hid)
    _write(tmp_path, cfg, t)

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model, HySparse2ForCausalLM)
    ids = torch.randint(0, 61, (2, 13), generator=g)  # k_g + w = 7 < 13: selection active
    want = hysparse2_forward(t, cfg, ids)
    close(logits(model, ids), want)
    assert differs(want, hysparse2_forward(t, cfg, ids, token_selection=False))
    close(model(ids, use_cache=False, logits_to_keep=torch.tensor([2, 12])).logits, want[:, [2, 12]])
