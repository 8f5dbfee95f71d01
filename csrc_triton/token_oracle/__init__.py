# SPDX-License-Identifier: Apache-2.0
"""Token oracle attention (HySparse2 cross full layer, SPEC §3.3): causal paged attention plus the selection S_t."""

from csrc_triton.token_oracle.naive import token_oracle_attention_naive

__all__ = ["token_oracle_attention", "token_oracle_attention_naive"]


def __getattr__(name):
    # the kernel imports triton; load it on first use so the naive path works without triton
    if name == "token_oracle_attention":
        from csrc_triton.token_oracle.kernel import token_oracle_attention

        return token_oracle_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
