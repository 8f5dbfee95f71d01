# SPDX-License-Identifier: Apache-2.0
"""Token-sparse paged attention (HySparse2 cross sparse layer): Triton kernel and PyTorch twin."""

from csrc_triton.token_sparse.naive import token_sparse_attention_naive

__all__ = ["token_sparse_attention", "token_sparse_attention_naive"]


def __getattr__(name):
    # the kernel imports triton; load it on first use so the naive path works without triton
    if name == "token_sparse_attention":
        from csrc_triton.token_sparse.kernel import token_sparse_attention

        return token_sparse_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
