# SPDX-License-Identifier: Apache-2.0
"""Paged-batch helpers of the kernel tests, also used by tests that run the serving kernels on simulated ranks.

Importing this sets nothing: `TRITON_INTERPRET` belongs to the kernel pytest
process alone (`tests/kernels/conftest.py`), never to an engine process.
"""

from dataclasses import dataclass

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
    block_table: torch.Tensor  # [R, max_pages] int32, shuffled page order
    k_cache: torch.Tensor  # [num_pages, G, page_size, D], a strided view of one KV tensor
    v_cache: torch.Tensor  # [num_pages, G, page_size, Dv]
    keys: list[torch.Tensor]  # per request, [seq_len, G, D] in the cache dtype (dense ground truth)
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


def make_paged_batch(q_lens, seq_lens, *, num_kv_heads, head_dim, page_size, dtype, seed=0, layout="hnd",
                     pad_tokens=0, spare_pages=3, head_dim_v=None) -> PagedBatch:
    """Random K/V written into randomly permuted pages; every unwritten slot and spare page is NaN.

    `layout="hnd"` stores the cache as `[pages, G, page, D + Dv]` (vLLM's logical
    order), `"nhd"` as `[pages, page, G, D + Dv]` viewed in logical order. Unused
    block-table entries point at a NaN page, so a stray lookup poisons the output.
    `head_dim_v` (Dv, default D) is the value head dim (SPEC §2.6).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-s // page_size) for s in seq_lens]
    total = sum(n_pages) + spare_pages
    order = torch.randperm(total, generator=g)
    spare = order[sum(n_pages):]
    shape = (total, num_kv_heads, page_size, head_dim + head_dim_v)
    if layout == "hnd":
        kv = torch.full(shape, float("nan"), dtype=dtype)
    elif layout == "nhd":
        kv = torch.full((total, page_size, num_kv_heads, head_dim + head_dim_v), float("nan"),
                        dtype=dtype).transpose(1, 2)
    else:
        raise ValueError(layout)
    width = max(n_pages) + 1
    block_table = spare[torch.randint(len(spare), (len(seq_lens), width), generator=g)].to(torch.int32)
    keys, values, used = [], [], 0
    for r, seq_len in enumerate(seq_lens):
        block_table[r, : n_pages[r]] = order[used: used + n_pages[r]].to(torch.int32)
        used += n_pages[r]
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim_v, generator=g).to(dtype)
        p = torch.arange(seq_len)
        kv[block_table[r, p // page_size].long(), :, p % page_size] = torch.cat([k, v], dim=-1)
        keys.append(k)
        values.append(v)
    kv = kv.to(DEVICE)
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    return PagedBatch(
        q_lens=list(q_lens),
        seq_lens=list(seq_lens),
        num_tokens=qsl[-1] + pad_tokens,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
        k_cache=kv[..., :head_dim],
        v_cache=kv[..., head_dim:],
        keys=[k.to(DEVICE) for k in keys],
        values=[v.to(DEVICE) for v in values],
    )


def dense_causal(batch, q, scale, sinks):
    """Causal attention with a sink, in float64, written out per row and head."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape[0], num_heads, batch.v_cache.shape[-1], dtype=torch.float64)
    for r, row0, pos0 in batch.rows():
        k, v = batch.keys[r].cpu().double(), batch.values[r].cpu().double()
        for i in range(batch.q_lens[r]):
            for h in range(num_heads):
                grp = h // (num_heads // k.shape[1])
                z = k[: pos0 + i + 1, grp] @ q[row0 + i, h].cpu().double() * scale
                if sinks is not None:
                    z = torch.cat([z, sinks[h].cpu().double().view(1)])
                p = torch.softmax(z, dim=0)[: pos0 + i + 1]
                out[row0 + i, h] = p @ v[: pos0 + i + 1, grp]
    return out


def nan_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: a kernel must overwrite every element."""
    return torch.full_like(x, float("nan"))


def nan_out(batch: PagedBatch, q: torch.Tensor) -> torch.Tensor:
    """`nan_like` of a kernel's output `[T, H, Dv]`: as wide as the values, not the queries."""
    return torch.full((*q.shape[:2], batch.v_cache.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)


@dataclass
class Case:
    """A paged batch shape for the oracle and block-sparse kernel tests."""

    q_lens: list[int]
    seq_lens: list[int]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    page_size: int = 16
    block_size: int = 16
    topk: int = 3
    layout: str = "hnd"
    pad_tokens: int = 0
    head_dim_v: int | None = None  # None: head_dim

    def __str__(self):
        return (f"q{self.q_lens}-s{self.seq_lens}-H{self.num_heads}-G{self.num_kv_heads}-D{self.head_dim}"
                f"{dv_tag(self)}-P{self.page_size}-B{self.block_size}-K{self.topk}-{self.layout}").replace(" ", "")


@dataclass
class TokenCase(Case):
    """A paged batch shape for the token-oracle and token-sparse kernel tests: a window, no key blocks."""

    topk: int = 16
    window: int = 8

    def __str__(self):
        return (f"q{self.q_lens}-s{self.seq_lens}-H{self.num_heads}-G{self.num_kv_heads}-D{self.head_dim}"
                f"{dv_tag(self)}-P{self.page_size}-K{self.topk}-W{self.window}-{self.layout}").replace(" ", "")


def dv_tag(case) -> str:
    """`-Dv<n>` in a case id when its value head dim is its own."""
    return "" if case.head_dim_v is None else f"-Dv{case.head_dim_v}"
