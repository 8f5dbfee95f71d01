# SPDX-License-Identifier: Apache-2.0
"""Paged-batch helpers of the kernel tests, also used by tests that run the serving kernels on simulated ranks.

The batch builder (`PagedBatch`, `make_paged_batch`) lives in `csrc_triton.testing`, shared with the
benchmarks, and is re-exported here.

Importing this sets nothing: `TRITON_INTERPRET` belongs to the kernel pytest
process alone (`tests/kernels/conftest.py`), never to an engine process.
"""

from dataclasses import dataclass

import torch

# the builder lives beside the kernels so the benchmarks share it without pytest or vLLM; re-exported here
from csrc_triton.testing import DEVICE, PagedBatch, make_paged_batch  # noqa: F401


def dense_causal(batch, q, scale, sinks, window=None):
    """Causal attention with a sink, in float64, written out per row and head; with `window`, each row over its last
    `window` positions only."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape[0], num_heads, batch.v_cache.shape[-1], dtype=torch.float64)
    for r, row0, pos0 in batch.rows():
        k, v = batch.keys[r].cpu().double(), batch.values[r].cpu().double()
        for i in range(batch.q_lens[r]):
            lo, hi = (0 if window is None else max(0, pos0 + i + 1 - window)), pos0 + i + 1
            for h in range(num_heads):
                grp = h // (num_heads // k.shape[1])
                z = k[lo:hi, grp] @ q[row0 + i, h].cpu().double() * scale
                if sinks is not None:
                    z = torch.cat([z, sinks[h].cpu().double().view(1)])
                p = torch.softmax(z, dim=0)[: hi - lo]
                out[row0 + i, h] = p @ v[lo:hi, grp]
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


def make_case_inputs(case, dtype, seed: int = 0, sinks: bool = False):
    """A kernel test case's paged batch and queries: `(batch, q [T, H, D] on DEVICE)`, plus `sinks [H]` with `sinks`.

    `q` is strided (every other head of a wider projection output), as the models pass it; the sinks are drawn
    after it from the same generator, so a case's inputs do not depend on which kernel asks for them.
    """
    batch = make_paged_batch(case.q_lens, case.seq_lens, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                             page_size=case.page_size, dtype=dtype, seed=seed, layout=case.layout,
                             pad_tokens=case.pad_tokens, head_dim_v=case.head_dim_v)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch.num_tokens, 2 * case.num_heads, case.head_dim, generator=g).to(dtype)[:, ::2]
    if not sinks:
        return batch, q.to(DEVICE)
    return batch, q.to(DEVICE), (torch.randn(case.num_heads, generator=g) + 1.0).to(DEVICE)


def random_blocks(batch, num_kv_heads, block_size, topk, seed=0):
    """`[T, G, topk]` int32: per row and group a random subset of the blocks up to the query, ascending, -1 padded.

    Rows also pick, at random, blocks after the query but inside the sequence: the kernel must mask them.
    """
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.full((batch.num_tokens, num_kv_heads, topk), -1, dtype=torch.int32)
    seq_of_row = [s for q_len, s in zip(batch.q_lens, batch.seq_lens) for _ in range(q_len)]
    for t, pos in enumerate(batch.positions()):
        if pos < 0:
            continue
        num_blocks = pos // block_size + 1
        if torch.rand((), generator=g) < 0.2:
            num_blocks = -(-seq_of_row[t] // block_size)
        for h in range(num_kv_heads):
            n = int(torch.randint(0, min(topk, num_blocks) + 1, (), generator=g))
            chosen = torch.randperm(num_blocks, generator=g)[:n].sort().values
            ids[t, h, :n] = chosen.to(torch.int32)
    return ids.to(DEVICE)


def share_pages(batch: PagedBatch, shares: dict[int, tuple[int, int]]) -> None:
    """Give requests the leading pages of others, as vLLM's prefix cache does for requests on one prompt.

    `shares` maps a request to (the request whose pages it starts with, how many); those pages must be full in
    both (vLLM shares only full pages), so each row reads the same keys as before, from the other's pages.
    """
    page_size = batch.k_cache.shape[2]
    for req, (src, pages) in shares.items():
        assert pages * page_size <= min(batch.seq_lens[req], batch.seq_lens[src])
        batch.block_table[req, :pages] = batch.block_table[src, :pages]


def share_prefix(batch: PagedBatch, shares: dict[int, tuple[int, int]]) -> None:
    """`share_pages`, and each sharing request's reference keys and values (`batch.keys` / `batch.values`) made what
    its shared pages now hold: the other request's."""
    share_pages(batch, shares)
    page_size = batch.k_cache.shape[2]
    for req, (src, pages) in shares.items():
        batch.keys[req][:pages * page_size] = batch.keys[src][:pages * page_size]
        batch.values[req][:pages * page_size] = batch.values[src][:pages * page_size]
