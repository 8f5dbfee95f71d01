# SPDX-License-Identifier: Apache-2.0
"""Pages-per-query counting against an explicit loop over the selected positions, and the device accumulator.

Both counters are checked: the PyTorch `pages_touched` and the C++ `add_pages_touched` that the CPU serving path
runs (`csrc_triton/cpu_sparse.cpp`; CI builds the C++ kernels, so it must be there).
"""

import os

import pytest
import torch

from vllm_hysparse import metrics
from vllm_hysparse.metrics import PagesPerQueryStats, pages_touched

SEED = int(os.environ.get("HYSPARSE_TEST_SEED", "0"))


def pages_by_loop(ids, positions, block_size, page_size):
    """Distinct pages of every key `j <= t` in the selected blocks, one query and group at a time."""
    n, g, _ = ids.shape
    out = torch.zeros(n, g, dtype=torch.long)
    for i in range(n):
        t = int(positions[i])
        for h in range(g):
            pages = {j // page_size for b in ids[i, h].tolist() if b >= 0
                     for j in range(b * block_size, b * block_size + block_size) if j <= t}
            out[i, h] = len(pages)
    return out


def random_selection(n, g, k, block_size, seed):
    """Ascending distinct visible block ids, -1 padded, at random positions."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 600, (n,), generator=gen)
    ids = torch.full((n, g, k), -1, dtype=torch.int32)
    for i in range(n):
        visible = int(positions[i]) // block_size + 1
        for h in range(g):
            m = int(torch.randint(0, min(k, visible) + 1, (), generator=gen))
            ids[i, h, :m] = torch.randperm(visible, generator=gen)[:m].sort().values.to(torch.int32)
    return ids, positions


def with_invisible(ids, positions, block_size, seed):
    """Some rows' last selected entry moved past the row's position (a prefill chunk's later rows select blocks
    an earlier row cannot see): skipped by both counters, and the entry after it starts a new run."""
    gen = torch.Generator().manual_seed(seed)
    ids = ids.clone()
    for i in range(ids.shape[0]):
        beyond = int(positions[i]) // block_size + 1 + int(torch.randint(0, 3, (), generator=gen))
        h = int(torch.randint(0, ids.shape[1], (), generator=gen))
        free = (ids[i, h] < 0).nonzero()
        if len(free) and torch.rand((), generator=gen) < 0.5:
            ids[i, h, int(free[0])] = beyond
    return ids


CASES = [(16, 16), (16, 32), (64, 16), (48, 32), (1, 16), (1, 1), (32, 48)]


@pytest.mark.parametrize("block_size,page_size", CASES)
def test_pages_touched_matches_loop(block_size, page_size):
    ids, positions = random_selection(60, 3, 5, block_size, seed=SEED + block_size * 7 + page_size)
    ids = with_invisible(ids, positions, block_size, seed=SEED + page_size)
    got = pages_touched(ids, positions, block_size, page_size)
    assert torch.equal(got, pages_by_loop(ids, positions, block_size, page_size))


@pytest.mark.parametrize("block_size,page_size", CASES)
def test_cpu_counter_matches_loop(block_size, page_size):
    print(f"seed {SEED}")
    ids, positions = random_selection(60, 3, 5, block_size, seed=SEED + block_size * 7 + page_size + 1)
    ids = with_invisible(ids, positions, block_size, seed=SEED + page_size + 1)
    counter = metrics._cpu_counter(ids, positions)
    assert counter is not None, "the C++ counter is not built (csrc_triton/cpu_sparse.cpp)"
    totals = torch.tensor([7, 11, 13], dtype=torch.long)  # added to, not overwritten
    counter(ids, positions, block_size, page_size, totals)
    want = pages_by_loop(ids, positions, block_size, page_size)
    dense = int((positions // page_size + 1).sum()) * ids.shape[1]
    assert totals.tolist() == [7 + want.numel(), 11 + int(want.sum()), 13 + dense]
    assert int(want.sum()) > 0 and (want == 0).any()  # the draw has selections and empty rows


@pytest.mark.parametrize("counter", ["cpp", "torch"])
def test_stats_accumulate_on_the_device_and_can_be_switched_off(monkeypatch, counter):
    if counter == "torch":
        monkeypatch.setattr(metrics, "_cpu_counter", lambda ids, positions: None)
    ids, positions = random_selection(20, 2, 4, 16, seed=SEED + 3)
    monkeypatch.delenv("HYSPARSE_METRICS_DIR", raising=False)
    stats = PagesPerQueryStats()
    stats.add(ids, positions, 16, 32)
    stats.add(ids[:5], positions[:5], 16, 32)
    want_pages = int(pages_by_loop(ids, positions, 16, 32).sum() + pages_by_loop(ids[:5], positions[:5], 16, 32).sum())
    dense = int(((positions // 32 + 1).sum() + (positions[:5] // 32 + 1).sum()) * 2)
    assert stats.totals() == {"queries": 50, "pages": want_pages, "dense_pages": dense}
    monkeypatch.setenv("VLLM_HYSPARSE_METRICS", "0")
    off = PagesPerQueryStats()
    off.add(ids, positions, 16, 32)
    assert off.totals() == {"queries": 0, "pages": 0, "dense_pages": 0}
