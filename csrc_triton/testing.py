# SPDX-License-Identifier: Apache-2.0
"""The one builder of vLLM-style paged KV batches for the kernel tests and the benchmarks.

Torch only: no vLLM, no pytest, no `vllm_hysparse` (the GPU benchmark image has torch and triton alone).
Importing this sets nothing (`TRITON_INTERPRET` belongs to the kernel pytest process).

`make_paged_batch(q_lens, seq_lens, ...)` returns a `PagedBatch` of R = len(seq_lens) requests, with
P = page_size, G = num_kv_heads, D = head_dim, Dv = head_dim_v (default D),
T = sum(q_lens) + pad_tokens query rows and N = sum(ceil(seq_lens / P)) + spare_pages pages:

    query_start_loc  [R + 1]             int32   cumulative q_lens
    seq_lens_t       [R]                 int32
    block_table      [R, max pages + 1]  int32   shuffled pages; entries past a request's pages point at a spare page
    k_cache          [N, G, P, D]        dtype   a view of one [N, G, P, D + Dv] tensor (layout "hnd"),
    v_cache          [N, G, P, Dv]       dtype   or of one [N, P, G, D + Dv] tensor transposed (layout "nhd")
    keys / values    R x [seq_len, G, D] / [seq_len, G, Dv]   dense ground truth in the cache dtype
    pos / req        [sum(q_lens)]       int64   position and request of every (unpadded) query row
    kv               [N, G, P, D + Dv]   dtype   the one tensor both caches view

Slots past each sequence and every spare page hold NaN, so a stray read poisons the output. Request r's
queries are the last q_lens[r] of its seq_lens[r] positions.
"""

from dataclasses import dataclass
from functools import cached_property

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedBatch:
    """A vLLM-style batch: request r's queries are the last `q_lens[r]` of its `seq_lens[r]` positions."""

    q_lens: list[int]
    seq_lens: list[int]
    num_tokens: int  # query rows, including `pad_tokens` rows past the last request
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens_t: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_pages + 1] int32, shuffled page order
    k_cache: torch.Tensor  # [num_pages, G, page_size, D], a strided view of one KV tensor
    v_cache: torch.Tensor  # [num_pages, G, page_size, Dv]
    keys: list[torch.Tensor]  # per request, [seq_len, G, D] in the cache dtype (dense ground truth); [] if dense=False
    values: list[torch.Tensor]  # per request, [seq_len, G, Dv]

    def rows(self):
        """(request, first query row, query position of that row) for every request."""
        start = 0
        for r, (q_len, seq_len) in enumerate(zip(self.q_lens, self.seq_lens)):
            yield r, start, seq_len - q_len
            start += q_len

    def positions(self) -> list[int]:
        """Absolute position of every query row; -1 for padding rows."""
        pos = [p for q_len, s in zip(self.q_lens, self.seq_lens) for p in range(s - q_len, s)]
        return pos + [-1] * (self.num_tokens - len(pos))

    @cached_property
    def req(self) -> torch.Tensor:
        """[sum(q_lens)] int64, on the batch's device: the request of every query row (padding rows excluded)."""
        q_lens = torch.tensor(self.q_lens, dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(self.q_lens)), q_lens).to(self.block_table.device)

    @cached_property
    def pos(self) -> torch.Tensor:
        """[sum(q_lens)] int64, on the batch's device: the absolute position of every query row (no padding)."""
        return torch.tensor(self.positions()[: sum(self.q_lens)], dtype=torch.int64, device=self.block_table.device)

    @property
    def kv(self) -> torch.Tensor:
        """The one tensor `k_cache` and `v_cache` view, `[pages, G, page_size, D + Dv]` in logical order (as built)."""
        n, g, p, d = self.k_cache.shape
        return self.k_cache.as_strided((n, g, p, d + self.v_cache.shape[-1]), self.k_cache.stride(),
                                       self.k_cache.storage_offset())

    def args(self, q):
        """The positional arguments of every paged kernel: (q, k_cache, v_cache, block_table, query_start_loc,
        seq_lens)."""
        return q, self.k_cache, self.v_cache, self.block_table, self.query_start_loc, self.seq_lens_t


def make_paged_batch(q_lens, seq_lens, *, num_kv_heads, head_dim, page_size, dtype, seed=0, layout="hnd",
                     pad_tokens=0, spare_pages=3, head_dim_v=None, device=None, draw="per_request",
                     dense=True) -> PagedBatch:
    """Random K/V written into randomly permuted pages; every unwritten slot and spare page is NaN.

    `layout="hnd"` stores the cache as `[pages, G, page, D + Dv]` (vLLM's logical
    order), `"nhd"` as `[pages, page, G, D + Dv]` viewed in logical order. Unused
    block-table entries point at a NaN page, so a stray lookup poisons the output.
    `head_dim_v` (Dv, default D) is the value head dim (SPEC §2.6). `device`: where the
    batch lives (default `DEVICE`, CUDA when there is one).

    `draw` picks how the values are drawn, both from `seed` alone:
    - `"per_request"` (the tests'): a CPU generator of its own, never the global RNG; a random page
      order over all pages (spare pages anywhere), unused entries at random spare pages, then each
      request's K then V; the batch is built on the CPU and moved to `device`.
    - `"whole_cache"` (the benchmarks', for caches of GBs): `torch.manual_seed(seed)`, then one
      `normal_` over the whole cache on `device`, the spare pages last, the used pages a random order
      of the others, unused entries at the first spare page. It seeds the global RNG on purpose: what
      a benchmark draws after it (queries, indices) continues that seeded stream, independent of the cache.
    `dense=False` leaves `keys` and `values` empty (no second copy of a large cache).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    device = DEVICE if device is None else torch.device(device)
    n_pages = [-(-s // page_size) for s in seq_lens]
    used_pages = sum(n_pages)
    total = used_pages + spare_pages
    if layout == "hnd":
        physical, to_logical = (total, num_kv_heads, page_size, head_dim + head_dim_v), lambda t: t
    elif layout == "nhd":
        physical, to_logical = (total, page_size, num_kv_heads, head_dim + head_dim_v), lambda t: t.transpose(1, 2)
    else:
        raise ValueError(layout)
    width = max(n_pages) + 1
    keys, values = [], []
    if draw == "per_request":
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(total, generator=g)
        spare = order[used_pages:]
        kv = to_logical(torch.full(physical, float("nan"), dtype=dtype))
        block_table = spare[torch.randint(len(spare), (len(seq_lens), width), generator=g)].to(torch.int32)
        used = 0
        for r, seq_len in enumerate(seq_lens):
            block_table[r, : n_pages[r]] = order[used: used + n_pages[r]].to(torch.int32)
            used += n_pages[r]
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
            v = torch.randn(seq_len, num_kv_heads, head_dim_v, generator=g).to(dtype)
            p = torch.arange(seq_len)
            kv[block_table[r, p // page_size].long(), :, p % page_size] = torch.cat([k, v], dim=-1)
            if dense:
                keys.append(k.to(device))
                values.append(v.to(device))
        kv = kv.to(device)
        block_table = block_table.to(device)
    elif draw == "whole_cache":
        if spare_pages < 1:
            raise ValueError("draw='whole_cache' needs a spare page for the unused block-table entries")
        torch.manual_seed(seed)
        kv = to_logical(torch.empty(physical, dtype=dtype, device=device).normal_())
        kv[used_pages:] = float("nan")
        order = torch.randperm(used_pages)
        block_table = torch.full((len(seq_lens), width), used_pages, dtype=torch.int32)
        used = 0
        for r, (n, seq_len) in enumerate(zip(n_pages, seq_lens)):
            block_table[r, :n] = order[used: used + n].to(torch.int32)
            used += n
            if seq_len % page_size:
                kv[int(block_table[r, n - 1]), :, seq_len % page_size:] = float("nan")
        block_table = block_table.to(device)
        if dense:
            for r, seq_len in enumerate(seq_lens):
                p = torch.arange(seq_len, device=device)
                kv_r = kv[block_table[r, p // page_size].long(), :, p % page_size]
                keys.append(kv_r[..., :head_dim])
                values.append(kv_r[..., head_dim:])
    else:
        raise ValueError(draw)
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    return PagedBatch(
        q_lens=list(q_lens),
        seq_lens=list(seq_lens),
        num_tokens=qsl[-1] + pad_tokens,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        k_cache=kv[..., :head_dim],
        v_cache=kv[..., head_dim:],
        keys=keys,
        values=values,
    )
