# SPDX-License-Identifier: Apache-2.0
"""Named model layouts for demo, test and accounting checkpoints.

`tiny` runs in seconds on a CPU (tests), `tiny_moe` is `tiny` with MoE MLPs
(SPEC §2.6), `small` is about 100M parameters (benchmarks), `paper` is the
80B-A3B / 49-layer MoE layout of each paper (config only, for KV accounting).
Sizes are chosen so that short prompts already cross blocks and windows: tiny
selects 2 blocks of 16 and windows of 32.
"""

F, S, W = "full_attention", "sparse_attention", "sliding_attention"

TOKENIZER_VOCAB = 8192

_COMMON = {
    "vocab_size": TOKENIZER_VOCAB,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

# The papers' 80B-A3B MoE: 8 of 512 experts active [HS Table 1; HS2 does not state it].
# moe_intermediate_size, norm_topk_prob and any shared expert are NOT STATED in either
# paper. 512 is derived: 512 experts x 3 x 2048 x 512 x 49 layers is 79B expert
# parameters, the bulk of "80B"; norm_topk_prob true and no shared expert are assumptions.
_PAPER_MOE = {
    "num_experts": 512, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "norm_topk_prob": True,
    "shared_expert_intermediate_size": 0,
}
# 8 experts, 2 active: a prompt spreads over all of them. The HySparse one is Qwen3-MoE
# style (renormalised, a dense first layer); the HySparse2 one Qwen2-MoE style
# (not renormalised, a sigmoid-gated shared expert). Sizes are multiples of 32, the
# alignment vLLM's CPU grouped-GEMM MoE kernel needs.
_TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}

_HYSPARSE_TINY = {
    **_COMMON,
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
    "layer_types": [F, S, S, F, S, S],
    "sparse_block_size": 16, "sparse_topk_blocks": 2, "swa_window": 32,
}
_HYSPARSE2_TINY = {
    **_COMMON,
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 4096,
    "layer_types": [W, F, W, F, S, S, F, S],
    "num_self_decoder_layers": 3, "bridge_sources": [1, 1],
    "sparse_topk_tokens": 16, "recent_window": 16, "swa_window": 32,
    "swa_rotary_dim": 32,
}

PRESETS: dict[str, dict[str, dict]] = {
    "hysparse": {
        "tiny": _HYSPARSE_TINY,
        "tiny_moe": {**_HYSPARSE_TINY, **_TINY_MOE, "norm_topk_prob": True, "mlp_only_layers": [0]},
        "small": {
            **_COMMON,
            "hidden_size": 768, "intermediate_size": 2560, "num_attention_heads": 12,
            "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 32768,
            "layer_types": [F, S, S, S] * 3,
            "sparse_block_size": 64, "sparse_topk_blocks": 16, "swa_window": 128,
        },
        # HySparse 80B-A3B (SPEC §2.1): 49 layers, full at {0, 12, 24, 36, 48}, MoE MLPs
        # (see _PAPER_MOE); config only, for KV accounting.
        "paper": {
            **_COMMON,
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 8192,
            "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
            "max_position_embeddings": 262144, "rope_theta": 640000.0,
            "layer_types": [F if i % 12 == 0 else S for i in range(49)],
            "sparse_block_size": 64, "sparse_topk_blocks": 16, "swa_window": 128,
            **_PAPER_MOE,
        },
    },
    "hysparse2": {
        "tiny": _HYSPARSE2_TINY,
        "tiny_moe": {**_HYSPARSE2_TINY, **_TINY_MOE, "norm_topk_prob": False, "shared_expert_intermediate_size": 96},
        "small": {
            **_COMMON,
            "hidden_size": 768, "intermediate_size": 2560, "num_attention_heads": 12,
            "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 32768,
            "layer_types": [W, W, F, W, W, W] + [F, S, S, F, S, S],
            "num_self_decoder_layers": 6, "bridge_sources": [2, 2],
            "sparse_topk_tokens": 1024, "recent_window": 128, "swa_window": 128,
            "swa_rotary_dim": 32,
        },
        # HySparse2 80B-A3B (SPEC §2.3): self-decoder 12 sliding + 1 full + 12 sliding,
        # cross-decoder 4 x [full, sparse x 5], all bridged from layer 12; MQA, head_dim 256;
        # MoE MLPs (see _PAPER_MOE).
        "paper": {
            **_COMMON,
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 8192,
            "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 256,
            "max_position_embeddings": 262144,
            "layer_types": [W] * 12 + [F] + [W] * 12 + ([F] + [S] * 5) * 4,
            "num_self_decoder_layers": 25, "bridge_sources": [12, 12, 12, 12],
            "sparse_topk_tokens": 1024, "recent_window": 128, "swa_window": 128,
            "swa_rotary_dim": 64,
            **_PAPER_MOE,
        },
    },
}

CONFIG_ONLY = {"paper"}
