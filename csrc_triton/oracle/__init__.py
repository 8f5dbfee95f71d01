# SPDX-License-Identifier: Apache-2.0
"""Oracle attention (HySparse full layer, SPEC §3.1): causal paged attention plus top-k block ids."""

from csrc_triton.oracle.naive import oracle_attention_naive

__all__ = ["oracle_attention", "oracle_attention_naive"]


def __getattr__(name):
    # the kernel imports triton; load it on first use so the naive path works without triton
    if name == "oracle_attention":
        from csrc_triton.oracle.kernel import oracle_attention

        return oracle_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
