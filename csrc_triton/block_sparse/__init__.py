# SPDX-License-Identifier: Apache-2.0
"""Block-sparse paged attention (HySparse sparse layer, global branch): Triton kernel and PyTorch twin."""

from csrc_triton.block_sparse.naive import block_sparse_attention_naive

__all__ = ["block_sparse_attention", "block_sparse_attention_naive"]


def __getattr__(name):
    # the kernel imports triton; load it on first use so the naive path works without triton
    if name == "block_sparse_attention":
        from csrc_triton.block_sparse.kernel import block_sparse_attention

        return block_sparse_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
