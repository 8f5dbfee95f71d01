# SPDX-License-Identifier: Apache-2.0
"""What every kernel does to the K/V tiles it loads from an FP8 (e4m3) cache (see `paged_args.kv_scaled`)."""

import triton
import triton.language as tl


@triton.jit
def widen_fp8(x):
    """An e4m3 tile as fp16 (exact: sm_90's native conversion), any other tile unchanged.

    Callers then cast to their dot dtype. In the sparse kernels' tile step (`attend_paged_tile`) going
    to bf16 straight from e4m3 spills registers in sm_90 builds (tests/kernels_aot) and through fp16 it
    does not; the oracle kernels build without spills the direct way (through fp16 they spill).
    """
    if x.dtype == tl.float8e4nv:
        x = x.to(tl.float16)
    return x
