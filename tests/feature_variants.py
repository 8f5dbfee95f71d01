# SPDX-License-Identifier: Apache-2.0
"""Checkpoint variants that turn on the config features real checkpoints use, several per tiny checkpoint, so
that one engine start covers them (tests/models/test_checkpoint_features.py; variant `a` also over two pipeline
stages in tests/models/test_pipeline_parallel.py).

* `a`: `qk_norm`, `attention_bias`, tied embeddings, headwise gates and yarn RoPE scaling;
* `b`: no sinks (`use_sinks=False`) and llama3 RoPE scaling.
"""

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
VARIANTS = {
    "a": dict(qk_norm=True, attention_bias=True, tie_word_embeddings=True, gate_type="headwise", rope_scaling=YARN),
    "b": dict(use_sinks=False, rope_scaling=LLAMA3),
}
# `max_position_embeddings`: yarn's covered length, 64 x 8 (the config refuses more: vLLM's YaRN table ends there).
# HySparse2's full and sparse layers have RoPE, which the scalings act on, only with `full_rope=True`.
ARCH_OVERRIDES = {"hysparse": dict(max_position_embeddings=512),
                  "hysparse2": dict(max_position_embeddings=512, full_rope=True)}


def variant_overrides(arch: str, variant: str) -> dict:
    """`write_checkpoint(..., overrides=...)` for `variant` of `arch`."""
    return {**VARIANTS[variant], **ARCH_OVERRIDES[arch]}
