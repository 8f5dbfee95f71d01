# SPDX-License-Identifier: Apache-2.0
"""The rename table: where each source tensor goes in the target (`LAYER_RULES` by layer kind, the top-level
rules), with which scale (`o_proj` x2 behind one gated branch), which source tensors are dropped, and which
new target tensors (gates, sinks) no source tensor provides and how they start (`INIT_RULES`, `SINK_INIT`,
`init_tensor`). `route` applies it to a whole source: {source tensor: ((target, scale), ...)} plus the new
tensors to write after each source tensor, every target checked against the target config's shapes.
"""

import re

import torch

from vllm_hysparse.configs.base import HySparseBaseConfig
from vllm_hysparse.configs.tensors import check_tensor, expected_tensors, layer_kind

# exp(-30) is ~1e-13 of the softmax mass of any key: the sink starts switched off.
SINK_INIT = -30.0

# (source pattern, target names, scale). Patterns match a whole name, layer
# patterns the part after `model.layers.{i}.`; the first match wins; no
# targets means the tensor is dropped on purpose. Anything unmatched is an error.
Rule = tuple[str, tuple[str, ...], float]
# fmt: off
_MLP_AND_NORMS: list[Rule] = [
    (r"(input|post_attention)_layernorm\.weight", (r"\1_layernorm.weight",),   1.0),
    (r"mlp\.(gate|up|down)_proj\.weight",         (r"mlp.\1_proj.weight",),     1.0),
    # MoE MLPs (SPEC §2.6) are copied; `route` checks each against the layer's layout.
    (r"mlp\.gate\.weight",                         ("mlp.gate.weight",),         1.0),
    (r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", (r"mlp.experts.\1.\2_proj.weight",), 1.0),
    (r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", (r"mlp.shared_expert.\1_proj.weight",), 1.0),
    (r"mlp\.shared_expert_gate\.weight",           ("mlp.shared_expert_gate.weight",), 1.0),
    # A buffer in some old checkpoints; RoPE frequencies come from the config.
    (r"self_attn\.rotary_emb\.inv_freq",          (),                           1.0),
]
_QKV_KEPT: list[Rule] = [
    (r"self_attn\.([qkv])_proj\.(weight|bias)",   (r"self_attn.\1_proj.\2",),   1.0),
    (r"self_attn\.([qk])_norm\.weight",           (r"self_attn.\1_norm.weight",), 1.0),
]
_Q_KEPT: list[Rule] = [
    (r"self_attn\.q_proj\.(weight|bias)",         (r"self_attn.q_proj.\1",),    1.0),
    (r"self_attn\.q_norm\.weight",                ("self_attn.q_norm.weight",), 1.0),
]
_O_X1: Rule = (r"self_attn\.o_proj\.weight",      ("self_attn.o_proj.weight",), 1.0)
# One gated branch at sigmoid(0) = 0.5 halves the output; o_proj doubles it back.
_O_X2: Rule = (r"self_attn\.o_proj\.weight",      ("self_attn.o_proj.weight",), 2.0)

LAYER_RULES: dict[str, list[Rule]] = {
    "full": [*_QKV_KEPT, _O_X1, *_MLP_AND_NORMS],
    # Two gated branches at 0.5 each: o_proj stays as is. The dense k/v become the SWA branch's.
    "sparse": [
        *_Q_KEPT,
        (r"self_attn\.([kv])_proj\.(weight|bias)", (r"self_attn.swa_\1_proj.\2",), 1.0),
        (r"self_attn\.k_norm\.weight",             ("self_attn.swa_k_norm.weight",), 1.0),
        _O_X1, *_MLP_AND_NORMS,
    ],
    "sliding": [*_QKV_KEPT, _O_X2, *_MLP_AND_NORMS],
    # bridge_norm starts as the layer's own input norm: the norm its k/v were trained behind.
    "cross_full": [
        (r"input_layernorm\.weight", ("input_layernorm.weight", "self_attn.bridge_norm.weight"), 1.0),
        *_QKV_KEPT, _O_X1, *_MLP_AND_NORMS,
    ],
    # Cross sparse layers own no KV: they read the cross full layer's cache.
    "cross_sparse": [
        *_Q_KEPT,
        (r"self_attn\.[kv]_proj\.(weight|bias)", (), 1.0),
        (r"self_attn\.k_norm\.weight",           (), 1.0),
        _O_X2, *_MLP_AND_NORMS,
    ],
}
_TOP_RULES: list[Rule] = [
    (r"model\.embed_tokens\.weight", ("model.embed_tokens.weight",), 1.0),
    (r"model\.norm\.weight",         ("model.norm.weight",),         1.0),
    (r"lm_head\.weight",             ("lm_head.weight",),            1.0),
]
# Target tensors no source tensor provides, and how they start.
INIT_RULES: list[tuple[str, str]] = [
    (r"model\.layers\.\d+\.self_attn\.(\w+_)?gate_proj\.weight", "zeros"),
    (r"model\.layers\.\d+\.self_attn\.(\w+_)?sinks",             "sinks"),
]
# fmt: on
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def map_name(config: HySparseBaseConfig, name: str) -> tuple[tuple[str, float], ...]:
    """Target names (with `o_proj`-style scale) of one source tensor; () = dropped; raises if unmapped."""
    m = LAYER_NAME.fullmatch(name)
    if m and int(m.group(1)) < config.num_hidden_layers:
        idx, rest = int(m.group(1)), m.group(2)
        kind = layer_kind(config, idx)
        return _apply(LAYER_RULES[kind], rest, f"model.layers.{idx}.", name, f"a {kind} layer")
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return ()
    return _apply(_TOP_RULES, name, "", name, "the top level")


def _apply(rules: list[Rule], key: str, prefix: str, name: str, where: str) -> tuple[tuple[str, float], ...]:
    for pattern, targets, scale in rules:
        m = re.fullmatch(pattern, key)
        if m:
            return tuple((prefix + m.expand(t), scale) for t in targets)
    raise ValueError(f"unknown source tensor {name}: no conversion rule for it in {where}")


def _init_kind(name: str) -> str | None:
    return next((kind for pattern, kind in INIT_RULES if re.fullmatch(pattern, name)), None)


def init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The starting value of a new target tensor (`INIT_RULES`)."""
    if _init_kind(name) == "sinks":
        # SPEC §2.2: sinks are float32 whatever the weight dtype.
        return torch.full(shape, SINK_INIT, dtype=torch.float32)
    return torch.zeros(shape, dtype=dtype)


def route(config: HySparseBaseConfig, headers: dict) -> tuple[dict, dict]:
    """(routes, inits): where each source tensor goes and which new tensors follow which source tensor."""
    expected = expected_tensors(config)
    routes, produced = {}, set()
    for name, (shape, _) in headers.items():
        routes[name] = map_name(config, name)
        for target, _ in routes[name]:
            check_tensor(expected, target, shape)
            if target in produced:
                raise ValueError(f"two source tensors map to {target}")
            produced.add(target)
    inits: dict[str, list[str]] = {}
    for target in expected:
        if target in produced:
            continue
        m = LAYER_NAME.fullmatch(target)
        if _init_kind(target) is None or m is None:
            raise ValueError(f"no source tensor or initialiser provides {target}")
        inits.setdefault(f"model.layers.{m.group(1)}.self_attn.q_proj.weight", []).append(target)
    return routes, inits
