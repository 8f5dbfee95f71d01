# SPDX-License-Identifier: Apache-2.0
"""HySparseConfig / HySparse2Config: SPEC §2.1 and §2.3 fields, validation, (de)serialisation."""

import json
import re

import pytest
from transformers import AutoConfig

import vllm_hysparse  # noqa: F401  (registers the Auto classes)
from vllm_hysparse.configs import HySparse2Config, HySparseConfig

FULL, SPARSE, SLIDING = "full_attention", "sparse_attention", "sliding_attention"
VOLATILE = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")

HS = dict(layer_types=[FULL, SPARSE, SPARSE, FULL, SPARSE, SPARSE], vocab_size=97, hidden_size=32,
          intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
          sparse_block_size=4, sparse_topk_blocks=2, swa_window=5)
H2 = dict(layer_types=[SLIDING, FULL, SLIDING, FULL, SPARSE, SPARSE, FULL, SPARSE], num_self_decoder_layers=3,
          bridge_sources=[1, 1], vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4,
          num_key_value_heads=1, head_dim=8, sparse_topk_tokens=3, recent_window=5, swa_window=5,
          swa_rotary_dim=4)
H2_TWO = dict(H2, layer_types=[FULL, SLIDING, FULL, FULL, SPARSE, FULL, SPARSE], num_self_decoder_layers=3,
              bridge_sources=[2, 0])


def comparable(cfg) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if k not in VOLATILE}


# ----------------------------------------------------------------------------- defaults and properties


def test_hysparse_defaults_follow_spec():
    c = HySparseConfig(layer_types=[FULL, SPARSE])
    assert c.model_type == "hysparse" and c.architectures == ["HySparseForCausalLM"]
    assert (c.sparse_block_size, c.sparse_topk_blocks, c.swa_window) == (64, 16, 128)
    assert (c.gate_type, c.use_sinks, c.qk_norm, c.attention_bias, c.hidden_act) == (
        "elementwise", True, False, False, "silu")
    assert c.num_hidden_layers == 2
    assert c.num_key_value_heads == c.num_attention_heads
    assert c.head_dim == c.hidden_size // c.num_attention_heads
    assert c.rope_scaling is None and c.rope_parameters["rope_type"] == "default"


def test_hysparse2_defaults_follow_spec():
    c = HySparse2Config(layer_types=[FULL, FULL], num_self_decoder_layers=1, bridge_sources=[0], head_dim=64)
    assert c.model_type == "hysparse2" and c.architectures == ["HySparse2ForCausalLM"]
    assert (c.sparse_topk_tokens, c.recent_window, c.score_head_reduce, c.swa_window) == (1024, 128, "max", 128)
    assert (c.swa_rope_theta, c.swa_rotary_dim, c.full_rope) == (10000.0, 64, False)
    assert (c.gate_type, c.use_sinks, c.qk_norm) == ("elementwise", True, False)


def test_moe_defaults_are_dense_and_follow_spec():
    c = HySparseConfig(**HS)
    assert (c.num_experts, c.shared_expert_intermediate_size, c.mlp_only_layers) == (0, 0, [])
    assert not any(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    m = HySparse2Config(**H2, num_experts=8, num_experts_per_tok=8, moe_intermediate_size=16, mlp_only_layers=[3])
    assert [m.is_moe_layer(i) for i in range(m.num_hidden_layers)] == [i != 3 for i in range(8)]


@pytest.mark.parametrize("cls,kw", [(HySparseConfig, HS), (HySparse2Config, H2)], ids=["hysparse", "hysparse2"])
def test_v_head_dim_defaults_to_head_dim_and_sizes_v_tensors(cls, kw):
    from vllm_hysparse.configs.tensors import expected_tensors

    assert cls(**kw).v_head_dim == kw["head_dim"]
    c = cls(**dict(kw, head_dim=12, v_head_dim=8, swa_rotary_dim=4) if cls is HySparse2Config
            else dict(kw, head_dim=12, v_head_dim=8))
    h, g, e = c.num_attention_heads, c.num_key_value_heads, c.hidden_size
    shapes = expected_tensors(c)
    for name, shape in shapes.items():
        leaf = name.split(".")[-2]
        if leaf in ("v_proj", "swa_v_proj"):
            assert shape == (g * 8, e), name
        elif leaf in ("k_proj", "swa_k_proj"):
            assert shape == (g * 12, e), name
        elif leaf == "q_proj":
            assert shape == (h * 12, e), name
        elif leaf == "o_proj":
            assert shape == (e, h * 8), name
        elif leaf.endswith("gate_proj") and ".mlp." not in name:
            assert shape == (h * 8, e), name
        elif leaf in ("q_norm", "k_norm", "swa_k_norm"):
            assert shape == (12,), name
    headwise = expected_tensors(cls(**dict(kw, v_head_dim=4, gate_type="headwise")))
    assert all(s == (h, e) for n, s in headwise.items() if n.split(".")[-2].endswith("gate_proj") and ".mlp." not in n)


def test_hysparse_oracle_layer():
    assert HySparseConfig(**HS).oracle_layer == {1: 0, 2: 0, 4: 3, 5: 3}
    c = HySparseConfig(**dict(HS, layer_types=[FULL, FULL, SPARSE, FULL]))
    assert c.oracle_layer == {2: 1}


def test_hysparse2_properties():
    c = HySparse2Config(**H2)
    assert c.cross_full_layers == [3, 6]
    assert c.bridge_source == {3: 1, 6: 1}
    assert c.oracle_layer == {4: 3, 5: 3, 7: 6}
    c = HySparse2Config(**H2_TWO)
    assert c.cross_full_layers == [3, 5]
    assert c.bridge_source == {3: 2, 5: 0}
    assert c.oracle_layer == {4: 3, 6: 5}


# ----------------------------------------------------------------------------- validation


def raises_naming(field: str, cls, **kw):
    with pytest.raises(ValueError) as info:
        cls(**kw)
    assert field in str(info.value), f"{field!r} not named in: {info.value}"
    return str(info.value)


COMMON_BAD = [
    ("layer_types", dict(num_hidden_layers=5)),  # 6 layer types
    ("layer_types[2]", dict(layer_types=[FULL, SPARSE, "linear_attention", FULL, SPARSE, SPARSE])),
    ("num_key_value_heads", dict(num_key_value_heads=3)),
    ("num_key_value_heads", dict(num_key_value_heads=0)),
    ("num_attention_heads", dict(num_attention_heads=0)),
    ("vocab_size", dict(vocab_size=0)),
    ("hidden_size", dict(hidden_size=-32)),
    ("intermediate_size", dict(intermediate_size=0)),
    ("head_dim", dict(head_dim=0)),
    ("head_dim", dict(head_dim=7)),
    ("v_head_dim", dict(v_head_dim=0)),
    ("v_head_dim", dict(v_head_dim=4.0)),
    ("max_position_embeddings", dict(max_position_embeddings=0)),
    ("swa_window", dict(swa_window=0)),
    ("swa_window", dict(swa_window=-4)),
    ("swa_window", dict(swa_window=True)),
    ("swa_window", dict(swa_window=2.5)),
    ("gate_type", dict(gate_type="channelwise")),
    ("hidden_act", dict(hidden_act="gelu")),
    ("rms_norm_eps", dict(rms_norm_eps=0.0)),
    ("attention_bias", dict(attention_bias="no")),
    ("qk_norm", dict(qk_norm=1)),
    ("use_sinks", dict(use_sinks=None)),
    ("tie_word_embeddings", dict(tie_word_embeddings="true")),
    ("rope_theta", dict(rope_theta=0.0)),
    ("rope_scaling.rope_type", dict(rope_scaling={"rope_type": "bogus", "factor": 2.0})),
    ("rope_scaling.factor", dict(rope_scaling={"rope_type": "linear"})),
    ("rope_scaling.factor", dict(rope_scaling={"rope_type": "linear", "factor": -1.0})),
    ("rope_scaling.original_max_position_embeddings", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
    ("rope_scaling.original_max_position_embeddings",
     dict(max_position_embeddings=4096, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 512})),
    # MoE (SPEC §2.6)
    ("num_experts", dict(num_experts=-1)),
    ("num_experts", dict(num_experts=2.0)),
    ("num_experts_per_tok", dict(num_experts=4, num_experts_per_tok=5)),
    ("num_experts_per_tok", dict(num_experts=4, num_experts_per_tok=0)),
    ("moe_intermediate_size", dict(num_experts=4, moe_intermediate_size=0)),
    ("norm_topk_prob", dict(num_experts=4, norm_topk_prob="true")),
    ("shared_expert_intermediate_size", dict(num_experts=4, shared_expert_intermediate_size=-8)),
    ("shared_expert_intermediate_size", dict(shared_expert_intermediate_size=16)),  # dense model
    ("mlp_only_layers[1]", dict(num_experts=4, mlp_only_layers=[0, 99])),
    ("mlp_only_layers[0]", dict(num_experts=4, mlp_only_layers=[-1])),
    ("mlp_only_layers[0]", dict(num_experts=4, mlp_only_layers=[True])),
    ("mlp_only_layers", dict(num_experts=4, mlp_only_layers=[2, 2])),
]

HS_BAD = COMMON_BAD + [
    ("layer_types[0]", dict(layer_types=[SPARSE, FULL, SPARSE, FULL, SPARSE, SPARSE])),
    ("layer_types[1]", dict(layer_types=[FULL, SLIDING, SPARSE, FULL, SPARSE, SPARSE])),
    ("sparse_block_size", dict(sparse_block_size=0)),
    ("sparse_block_size", dict(sparse_block_size=-64)),
    ("sparse_topk_blocks", dict(sparse_topk_blocks=0)),
    ("sparse_topk_blocks", dict(sparse_topk_blocks=-1)),
]


@pytest.mark.parametrize("field,change", HS_BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(HS_BAD)])
def test_hysparse_validation_names_field(field, change):
    raises_naming(field, HySparseConfig, **{**HS, **change})


def _h2_bad_common():
    out = []
    for field, change in COMMON_BAD:
        if field == "layer_types[2]":
            change = dict(layer_types=[SLIDING, FULL, "linear_attention", FULL, SPARSE, SPARSE, FULL, SPARSE])
        elif field == "layer_types":
            change = dict(num_hidden_layers=7)
        elif field == "head_dim" and change["head_dim"] == 7:
            change = dict(head_dim=7, swa_rotary_dim=4)
        out.append((field, change))
    return out


H2_BAD = _h2_bad_common() + [
    ("score_head_reduce", dict(score_head_reduce="mean")),
    ("sparse_topk_tokens", dict(sparse_topk_tokens=0)),
    ("recent_window", dict(recent_window=0)),
    ("recent_window", dict(recent_window=-3)),
    ("swa_rotary_dim", dict(swa_rotary_dim=0)),
    ("swa_rotary_dim", dict(swa_rotary_dim=10)),  # > head_dim 8
    ("swa_rotary_dim", dict(swa_rotary_dim=3)),  # odd
    ("swa_rope_theta", dict(swa_rope_theta=0.0)),
    ("full_rope", dict(full_rope="yes")),
    ("num_self_decoder_layers", dict(num_self_decoder_layers=0)),
    ("num_self_decoder_layers", dict(num_self_decoder_layers=8)),  # empty cross-decoder
    # sparse layer in the self-decoder
    ("layer_types[2]", dict(layer_types=[SLIDING, FULL, SPARSE, FULL, SPARSE, SPARSE, FULL, SPARSE])),
    # sliding layer in the cross-decoder
    ("layer_types[5]", dict(layer_types=[SLIDING, FULL, SLIDING, FULL, SPARSE, SLIDING, FULL, SPARSE])),
    # first cross layer sparse
    ("layer_types[3]", dict(layer_types=[SLIDING, FULL, SLIDING, SPARSE, FULL, SPARSE, FULL, SPARSE])),
    ("bridge_sources", dict(bridge_sources=[1])),
    ("bridge_sources", dict(bridge_sources=[1, 1, 1])),
    ("bridge_sources[1]", dict(bridge_sources=[1, 0])),  # layer 0 is sliding
    ("bridge_sources[0]", dict(bridge_sources=[9, 1])),  # out of range
    ("bridge_sources[0]", dict(bridge_sources=[-1, 1])),
    ("bridge_sources[1]", dict(bridge_sources=[1, 3])),  # a cross-decoder full layer
    ("bridge_sources[0]", dict(bridge_sources=[True, 1])),
]


@pytest.mark.parametrize("field,change", H2_BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(H2_BAD)])
def test_hysparse2_validation_names_field(field, change):
    raises_naming(field, HySparse2Config, **{**H2, **change})


def test_required_fields():
    raises_naming("layer_types", HySparseConfig, **{k: v for k, v in HS.items() if k != "layer_types"})
    raises_naming("layer_types", HySparse2Config, **{k: v for k, v in H2.items() if k != "layer_types"})
    raises_naming("num_self_decoder_layers", HySparse2Config,
                  **{k: v for k, v in H2.items() if k != "num_self_decoder_layers"})
    raises_naming("bridge_sources", HySparse2Config, **{k: v for k, v in H2.items() if k != "bridge_sources"})


def test_validation_message_names_field_first():
    msg = raises_naming("sparse_topk_blocks", HySparseConfig, **{**HS, "sparse_topk_blocks": 0})
    assert re.match(r"sparse_topk_blocks\b", msg)
    assert "0" in msg


# ----------------------------------------------------------------------------- serialisation


@pytest.mark.parametrize("cls,kw", [
    (HySparseConfig, HS),
    (HySparseConfig, dict(HS, gate_type="headwise", qk_norm=True, attention_bias=True, use_sinks=False,
                          tie_word_embeddings=True, rope_theta=123456.0,
                          rope_scaling={"rope_type": "linear", "factor": 2.0})),
    (HySparseConfig, dict(HS, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                          norm_topk_prob=True, shared_expert_intermediate_size=24, mlp_only_layers=[0, 3])),
    (HySparse2Config, H2),
    (HySparse2Config, dict(H2_TWO, full_rope=True, score_head_reduce="sum", swa_rope_theta=777.0,
                           gate_type="headwise", rope_theta=50000.0)),
], ids=["hysparse", "hysparse-nondefault", "hysparse-moe", "hysparse2", "hysparse2-nondefault"])
def test_save_load_round_trip_keeps_every_field(cls, kw, tmp_path):
    c = cls(**kw)
    c.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for field in ("layer_types", "rope_theta", "rope_scaling", "swa_window", "gate_type", "use_sinks", "qk_norm",
                  "num_key_value_heads", "head_dim", "attention_bias", "tie_word_embeddings", "model_type"):
        assert field in written, field
    for field, value in kw.items():
        assert written[field] == value, field
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is cls
    assert comparable(loaded) == comparable(c)
    for field, value in kw.items():
        assert getattr(loaded, field) == value, field
    assert comparable(cls.from_pretrained(tmp_path)) == comparable(loaded)


def _write_config(tmp_path, base: dict, **fields) -> dict:
    d = {"model_type": "hysparse", "architectures": ["HySparseForCausalLM"], **base, **fields}
    (tmp_path / "config.json").write_text(json.dumps(d))
    return d


def test_auto_config_returns_our_classes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _write_config(tmp_path / "a", HS)
    d2 = {"model_type": "hysparse2", "architectures": ["HySparse2ForCausalLM"], **H2}
    (tmp_path / "b" / "config.json").write_text(json.dumps(d2))
    a, b = AutoConfig.from_pretrained(tmp_path / "a"), AutoConfig.from_pretrained(tmp_path / "b")
    assert type(a) is HySparseConfig and type(b) is HySparse2Config
    assert a.layer_types == HS["layer_types"] and b.bridge_sources == [1, 1]
    assert type(AutoConfig.for_model("hysparse", **HS)) is HySparseConfig


def test_rope_theta_and_null_scaling_in_config_json(tmp_path):
    _write_config(tmp_path, HS, rope_theta=500000.0, rope_scaling=None)
    c = AutoConfig.from_pretrained(tmp_path)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling is None
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"type": "linear", "factor": 2.0},  # legacy key
])
def test_rope_scaling_in_config_json(scaling, tmp_path):
    _write_config(tmp_path, HS, rope_theta=250000.0, rope_scaling=scaling)
    c = AutoConfig.from_pretrained(tmp_path)
    assert c.rope_theta == 250000.0
    assert c.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 250000.0}
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # And it survives a save / load.
    out = tmp_path / "again"
    c.save_pretrained(out)
    c2 = AutoConfig.from_pretrained(out)
    assert c2.rope_parameters == c.rope_parameters and c2.rope_theta == 250000.0


def test_llama3_rope_scaling_in_config_json(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    _write_config(tmp_path, HS, rope_theta=500000.0, rope_scaling=scaling)
    c = AutoConfig.from_pretrained(tmp_path)
    assert c.rope_parameters == {**scaling, "rope_theta": 500000.0}
    assert c.rope_scaling == scaling


def test_invalid_config_json_is_rejected_on_load(tmp_path):
    _write_config(tmp_path, HS, sparse_topk_blocks=0)
    with pytest.raises(ValueError, match="sparse_topk_blocks"):
        AutoConfig.from_pretrained(tmp_path)
