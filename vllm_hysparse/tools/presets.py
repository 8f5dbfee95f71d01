# SPDX-License-Identifier: Apache-2.0
"""Named model layouts for demo, test and accounting checkpoints.

`tiny` runs in seconds on a CPU (tests), `small` is about 100M parameters
(benchmarks), `paper` is the 80B / 49-layer layout of each paper (config only,
for KV accounting). Sizes are chosen so that short prompts already cross
blocks and windows: tiny selects 2 blocks of 16 and windows of 32.
"""

F, S, W = "full_attention", "sparse_attention", "sliding_attention"

TOKENIZER_VOCAB = 8192

_COMMON = {
    "vocab_size": TOKENIZER_VOCAB,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

PRESETS: dict[str, dict[str, dict]] = {
    "hysparse": {
        "tiny": {
            **_COMMON,
            "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
            "layer_types": [F, S, S, F, S, S],
            "sparse_block_size": 16, "sparse_topk_blocks": 2, "swa_window": 32,
        },
        "small": {
            **_COMMON,
            "hidden_size": 768, "intermediate_size": 2560, "num_attention_heads": 12,
            "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 32768,
            "layer_types": [F, S, S, S] * 3,
            "sparse_block_size": 64, "sparse_topk_blocks": 16, "swa_window": 128,
        },
        # HySparse 80B-A3B (SPEC §2.1): 49 layers, full at {0, 12, 24, 36, 48}. The MoE
        # FFN is not modelled; config only, for KV accounting.
        "paper": {
            **_COMMON,
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 8192,
            "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
            "max_position_embeddings": 262144, "rope_theta": 640000.0,
            "layer_types": [F if i % 12 == 0 else S for i in range(49)],
            "sparse_block_size": 64, "sparse_topk_blocks": 16, "swa_window": 128,
        },
    },
    "hysparse2": {
        "tiny": {
            **_COMMON,
            "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 4096,
            "layer_types": [W, F, W, F, S, S, F, S],
            "num_self_decoder_layers": 3, "bridge_sources": [1, 1],
            "sparse_topk_tokens": 16, "recent_window": 16, "swa_window": 32,
            "swa_rotary_dim": 32,
        },
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
        # cross-decoder 4 x [full, sparse x 5], all bridged from layer 12; MQA, head_dim 256.
        "paper": {
            **_COMMON,
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 8192,
            "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 256,
            "max_position_embeddings": 262144,
            "layer_types": [W] * 12 + [F] + [W] * 12 + ([F] + [S] * 5) * 4,
            "num_self_decoder_layers": 25, "bridge_sources": [12, 12, 12, 12],
            "sparse_topk_tokens": 1024, "recent_window": 128, "swa_window": 128,
            "swa_rotary_dim": 64,
        },
    },
}

CONFIG_ONLY = {"paper"}
