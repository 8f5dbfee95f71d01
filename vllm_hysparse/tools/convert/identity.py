# SPDX-License-Identifier: Apache-2.0
"""The identity check against the teacher: the reference switches, input length and depth under which a
converted model reproduces its dense teacher exactly (HySparse: every layer; HySparse2: up to the first
cross sparse layer), and `verify` (`--verify`), which loads both in float32 and compares logits [1, length,
vocab] or the hidden states [1, length, hidden] entering that layer.
"""

from pathlib import Path

import torch

from vllm_hysparse.configs.base import HySparseBaseConfig
from vllm_hysparse.tools.convert.conversion import Conversion
from vllm_hysparse.tools.convert.source import S


def identity_switches(config: HySparseBaseConfig) -> dict[str, bool]:
    """Reference switches under which a converted model equals its teacher on short inputs."""
    return {"kv_sharing": False} if config.model_type == "hysparse" else {"bridge": False}


def identity_length(config: HySparseBaseConfig) -> int:
    """Longest input on which every block / token is selected and every window covers the sequence."""
    if config.model_type == "hysparse":
        cover = config.sparse_block_size * config.sparse_topk_blocks
    else:
        cover = config.sparse_topk_tokens + config.recent_window
    return min(64, config.swa_window, cover)


def identity_depth(config: HySparseBaseConfig) -> int:
    """Number of layers a converted model reproduces exactly under `identity_switches`.

    A HySparse2 cross sparse layer attends over the cross full layer's cache
    and has no k/v of its own (no switch can give it its teacher's keys), so
    the match ends at the first one.
    """
    if config.model_type == "hysparse":
        return config.num_hidden_layers
    return min(config.layers_of_type(S), default=config.num_hidden_layers)


def verify(conv: Conversion, out: Path, tol: float = 1e-3) -> str:
    """Teacher vs converted reference model (float32) under the identity switches.

    Compares logits, or for HySparse2 with cross sparse layers the hidden
    states entering the first of them (see `identity_depth`).
    """
    from transformers import AutoModelForCausalLM

    from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM

    cfg = conv.config
    cls = HySparseForCausalLM if cfg.model_type == "hysparse" else HySparse2ForCausalLM
    teacher = AutoModelForCausalLM.from_pretrained(conv.src, dtype=torch.float32).eval()
    student = cls.from_pretrained(out, dtype=torch.float32).eval()
    student.set_switches(**identity_switches(cfg))
    length, depth = identity_length(cfg), identity_depth(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = teacher(ids, output_hidden_states=True)
        got = student(ids, use_cache=False, output_hidden_states=True)
    if depth == cfg.num_hidden_layers:
        what, want, got = "logits", want.logits, got.logits
    else:
        what, want, got = f"hidden states entering layer {depth}", want.hidden_states[depth], got.hidden_states[depth]
    err, scale = (want.float() - got.float()).abs().max().item(), want.abs().max().item()
    line = f"verify: {what}: max |difference| {err:.2e} (max |value| {scale:.2f}) over {length} tokens"
    if not err <= tol * max(scale, 1.0):
        raise ValueError(f"{line} exceeds {tol:g} relative: the conversion does not reproduce the teacher")
    return line
