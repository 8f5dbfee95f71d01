# SPDX-License-Identifier: Apache-2.0
"""Pages-per-query statistics: measured in the worker, exposed as `vllm:hysparse_*` on `/metrics`.

vLLM's Prometheus registry lives in the API-server process while attention
runs in a spawned worker, so the worker accumulates a few counters and
publishes them as a small JSON file in a directory that the first process to
load our plugin creates (`HYSPARSE_METRICS_DIR`, inherited by the engine
and worker processes it spawns). A collector in every process's default
registry sums those files when scraped. Each worker publishes within 0.2 s of
a change, and once more at exit.
"""

import atexit
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

# Not VLLM_-prefixed: vLLM warns about every VLLM_* variable it does not know.
METRICS_DIR_ENV = "HYSPARSE_METRICS_DIR"
FIELDS = ("queries", "pages", "dense_pages")
_PUBLISH_INTERVAL_S = 0.2


def pages_touched(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int, page_size: int) -> torch.Tensor:
    """Distinct cache pages each query's selected blocks cover, keys `j <= t` only.

    Args:
        block_ids: `[N, G, K]` block ids, -1 padded.
        positions: `[N]` query positions t.
    Returns:
        `[N, G]` int64 page counts.
    """
    n, g, k = block_ids.shape
    offsets = torch.arange(block_size, device=block_ids.device)
    tokens = block_ids.long().unsqueeze(-1) * block_size + offsets  # [N, G, K, B]
    valid = (block_ids.unsqueeze(-1) >= 0) & (tokens <= positions.view(n, 1, 1, 1))
    pages = torch.where(valid, tokens // page_size, -1).flatten(2)  # [N, G, K*B]
    n_pages = int(positions.max()) // page_size + 2
    hit = torch.zeros(n, g, n_pages, dtype=torch.bool, device=block_ids.device)
    hit.scatter_(2, pages.clamp_min(-1) + 1, True)  # slot 0 collects the invalid ones
    return hit[..., 1:].sum(-1)


class PagesPerQueryStats:
    """Worker-side accumulator; `add` is called by the oracle attention role each step.

    A daemon thread publishes the totals when they changed, so a scrape right
    after a request sees all of it without the hot path writing files.
    """

    def __init__(self):
        self.totals = dict.fromkeys(FIELDS, 0)
        self._lock = threading.Lock()
        self._dirty = False
        directory = os.environ.get(METRICS_DIR_ENV)
        self._path = Path(directory) / f"worker-{os.getpid()}.json" if directory else None
        if self._path is not None:
            atexit.register(self.publish)
            threading.Thread(target=self._publish_loop, name="hysparse-metrics", daemon=True).start()

    def add(self, pages: torch.Tensor, positions: torch.Tensor, page_size: int) -> None:
        """pages `[N, G]` from `pages_touched`; positions `[N]` (dense = every page up to t)."""
        dense = int((positions // page_size + 1).sum()) * pages.shape[1]
        with self._lock:
            self.totals["queries"] += pages.numel()
            self.totals["pages"] += int(pages.sum())
            self.totals["dense_pages"] += dense
            self._dirty = True

    def publish(self) -> None:
        if self._path is None:
            return
        with self._lock:
            text, self._dirty = json.dumps(self.totals), False
        tmp = self._path.with_suffix(".tmp")
        try:
            tmp.write_text(text)
            tmp.replace(self._path)
        except OSError:
            pass  # the serving process removed the directory on shutdown

    def _publish_loop(self) -> None:
        while True:
            time.sleep(_PUBLISH_INTERVAL_S)
            if self._dirty:
                self.publish()


_STATS: PagesPerQueryStats | None = None


def worker_stats() -> PagesPerQueryStats:
    global _STATS
    if _STATS is None:
        _STATS = PagesPerQueryStats()
    return _STATS


def read_totals(directory: str | os.PathLike) -> dict[str, int]:
    totals = dict.fromkeys(FIELDS, 0)
    for path in Path(directory).glob("worker-*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now; the next scrape sees it
        for key in FIELDS:
            totals[key] += int(data.get(key, 0))
    return totals


class _Collector:
    """Prometheus collector over the workers' published totals."""

    def __init__(self, directory: str):
        self.directory = directory

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        t = read_totals(self.directory)
        yield CounterMetricFamily("vllm:hysparse_sparse_queries", "Sparse-layer (query, KV group) selections "
                                  "measured at the oracle full layers.", value=t["queries"])
        yield CounterMetricFamily("vllm:hysparse_pages_touched", "Distinct KV cache pages touched by the "
                                  "selected blocks, summed over queries.", value=t["pages"])
        yield CounterMetricFamily("vllm:hysparse_dense_pages", "KV cache pages dense attention would touch for "
                                  "the same queries.", value=t["dense_pages"])
        mean = t["pages"] / t["queries"] if t["queries"] else 0.0
        yield GaugeMetricFamily("vllm:hysparse_pages_per_query", "Mean distinct KV pages touched per sparse "
                                "query and KV group since start.", value=mean)


_REGISTER_LOCK = threading.Lock()
_REGISTERED = False


def register_collector() -> None:
    """Create the shared directory (first process only) and register the collector once per process."""
    global _REGISTERED
    with _REGISTER_LOCK:
        if _REGISTERED:
            return
        directory = os.environ.get(METRICS_DIR_ENV)
        if directory is None:
            directory = tempfile.mkdtemp(prefix="vllm-hysparse-metrics-")
            os.environ[METRICS_DIR_ENV] = directory
            atexit.register(shutil.rmtree, directory, True)
        from prometheus_client import REGISTRY

        REGISTRY.register(_Collector(directory))
        _REGISTERED = True
