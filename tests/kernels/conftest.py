# SPDX-License-Identifier: Apache-2.0
"""Kernel tests: Triton runs under the CPU interpreter when there is no GPU.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a kernel, so it must be
set here, before any test module imports a kernel module. It is set for this
pytest process only: `scripts/test.sh` runs `tests/kernels` on its own, and
`tests/conftest.py` refuses a session that would also collect engine tests.
The paged-batch helpers live in `tests/kernel_utils.py` (re-exported here).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tests.kernel_utils import (  # noqa: E402,F401  (after TRITON_INTERPRET; re-exported for kernel tests)
    DEVICE,
    Case,
    PagedBatch,
    dense_causal,
    dv_tag,
    make_paged_batch,
    nan_like,
    nan_out,
)
