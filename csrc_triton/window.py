# SPDX-License-Identifier: Apache-2.0
"""Sliding-window sink attention on the CPU: HySparse's SWA branch (SPEC §3.2) on the tiled oracle's walk.

Each row attends its last `window` positions of its own cache with one sink
logit per head. The token-sparse kernels serve the same role from explicit
window positions (`token_sparse`, the `window` role's twin); this walk needs
none: a tile of consecutive rows reads the one range of keys its windows cover,
and each row skips the keys before its window as it skips those after its
position (`oracle/cpu_tiled.cpp`, `window_tiled`).
"""

import torch

from csrc_triton.oracle.batched import tiled_kernel
from csrc_triton.paged_batch import NO_GATE, NO_SINKS


def bind_window(q, k_cache, v_cache, *, scale: float, sinks, window: int):
    """The C++ sliding-window kernel bound to one layer's pages, scale, sinks (`[H]` float32 or None) and window;
    None where the tiled oracle does not apply (`oracle.batched.tiled_kernel`: then PyTorch runs).

    Returns `run(q [n, H, D], block_table, plan, out [n, H, Dv], ids=None, gate=None, accumulate=False)` for the
    `n = plan.num_tokens` rows of a step, writing out in place; `ids` (the twin's window positions) is not read;
    `gate` as `paged_batch.bind_sparse`'s.
    """
    tiled = tiled_kernel(q, k_cache, v_cache)
    if tiled is None:
        return None
    ext, pages = tiled
    sinks = NO_SINKS if sinks is None else sinks

    def run(q, block_table, plan, out, ids=None, gate=None, accumulate=False):
        rows = q if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.contiguous()
        o = out if out.is_contiguous() else (out.contiguous() if accumulate else torch.empty_like(out))
        ext.window_tiled(rows, pages, block_table, plan.row_req, plan.row_pos, window, scale, sinks,
                         NO_GATE if gate is None else gate, accumulate, o)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o)

    return run
