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
import contextlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import torch

from vllm_hysparse import envs

METRICS_DIR_ENV = envs.METRICS_DIR.name
FIELDS = ("queries", "pages", "dense_pages")
# PIC counters and store gauges, set on the host by the worker's PIC engine (`vllm_hysparse.pic.runner`).
PIC_COUNTERS = ("segments_hit", "segments_cold", "tokens_reused", "tokens_recomputed", "shared_hits", "shared_misses",
                "shared_refused", "shared_errors", "shared_queued", "shared_published", "shared_publish_failures",
                "shared_bytes_read", "shared_bytes_written")
PIC_POOL_FIELDS = ("bytes", "entries", "evictions")
PIC_POOLS = ("public", "private")
_PUBLISH_INTERVAL_S = 0.2
# What the collector reads from the directory: worker-<pid>.json files of at most this size, at most this many.
_WORKER_FILE = re.compile(r"worker-\d{1,10}\.json")
_MAX_FILE_BYTES = 64 << 10
_MAX_FILES = 4096
logger = logging.getLogger("vllm.hysparse")


METRICS_ENV = envs.METRICS.name


def metrics_enabled() -> bool:
    """`VLLM_HYSPARSE_METRICS=0` switches the pages-per-query counters off (one C++ call per oracle layer on the CPU,
    a few tensor ops elsewhere)."""
    return os.environ.get(METRICS_ENV, "1") not in ("0", "false", "False")


def pages_touched(ids: torch.Tensor, positions: torch.Tensor, block_size: int, page_size: int) -> torch.Tensor:
    """Distinct cache pages each query's selection covers, keys `j <= t` only.

    Selected blocks are ascending, so their page ranges are too, and two
    neighbours share at most one page (the last of one, the first of the next):
    the count needs no `[N, G, K, block]` expansion.

    Args:
        ids: `[N, G, K]` ascending block ids (token positions when `block_size` is 1), -1 padded.
        positions: `[N]` query positions t.
    Returns:
        `[N, G]` int64 page counts.
    """
    ids = ids.long()
    t = positions.long().view(-1, 1, 1)
    valid = (ids >= 0) & (ids * block_size <= t)
    first = torch.where(valid, ids * block_size // page_size, -1)
    last = torch.where(valid, torch.minimum(ids * block_size + block_size - 1, t) // page_size, -1)
    pages = torch.where(valid, last - first + 1, 0).sum(-1)
    # a block whose first page is the previous valid block's last page counts it once
    prev_last = torch.nn.functional.pad(last[..., :-1], (1, 0), value=-1)
    shared = valid & (first == prev_last)
    return pages - shared.sum(-1)


def _cpu_counter(ids: torch.Tensor, positions: torch.Tensor):
    """The C++ twin of `pages_touched` plus the sums (`csrc_triton/cpu_sparse.cpp`, `add_pages_touched`) where it
    applies: CPU tensors, int32 ids, int64 positions and the C++ kernels built; else None."""
    if ids.device.type != "cpu" or ids.dtype != torch.int32 or positions.dtype != torch.long:
        return None
    from csrc_triton import cpu_ext

    ext = cpu_ext.load("sparse")
    return None if ext is None else ext.add_pages_touched


class PagesPerQueryStats:
    """Worker-side accumulator; `add` is called by the oracle attention roles each step.

    The totals live in a tensor on the device of the ids, so `add` queues a few
    tensor ops and never waits for the device. A daemon thread reads them, off
    the hot path, and publishes them when they changed.
    """

    def __init__(self):
        self._totals: torch.Tensor | None = None  # [len(FIELDS)] int64 on the kernels' device
        self._pic: dict[str, int] = {}  # host values: PIC counters and store state
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._host_totals = [0] * len(FIELDS)  # the device totals as last read
        self._dirty = False
        self.enabled = metrics_enabled()
        directory = os.environ.get(METRICS_DIR_ENV)
        self._path = Path(directory) / f"worker-{os.getpid()}.json" if directory else None
        if self._path is not None and self.enabled:
            atexit.register(self.publish)
            threading.Thread(target=self._publish_loop, name="hysparse-metrics", daemon=True).start()

    def add(self, ids: torch.Tensor, positions: torch.Tensor, block_size: int, page_size: int) -> None:
        """One oracle layer's selections `ids [N, G, K]` of queries at `positions [N]`."""
        if not self.enabled:
            return
        if self._totals is None:
            self._totals = torch.zeros(len(FIELDS), dtype=torch.long, device=ids.device)
        counter = _cpu_counter(ids, positions)
        if counter is not None:  # one C++ call on the CPU serving path
            counter(ids, positions, block_size, page_size, self._totals)
        else:
            pages = pages_touched(ids, positions, block_size, page_size)
            dense = (positions.long() // page_size + 1).sum() * ids.shape[1]  # every page up to t, per group
            self._totals.add_(torch.stack([pages.new_full((), pages.numel()), pages.sum(), dense]))
        self._dirty = True

    def set_pic(self, values: dict[str, int], flush: bool = False) -> None:
        """The PIC engine's current counters and store statistics (host ints, once per PIC step).

        `flush` writes the file now instead of within 0.2 s: a publish-only request is answered once the
        segments it queued for the shared tier are written, which the API server reads from this file.
        """
        if not self.enabled:
            return
        with self._lock:
            self._pic = dict(values)
        self._dirty = True
        if flush:
            self.publish(read_device=False)

    def totals(self, read_device: bool = True) -> dict[str, int]:
        """The counters on the host (waits for the device: call off the hot path). Without `read_device`, the
        pages counters are the ones last read, so a step's flush never waits for the device."""
        with self._lock:
            if read_device:
                self._host_totals = [0] * len(FIELDS) if self._totals is None else self._totals.tolist()
            values = self._host_totals
            pic = {f"pic_{k}": int(v) for k, v in self._pic.items()}
        return {**dict(zip(FIELDS, values)), **pic}

    def publish(self, read_device: bool = True) -> None:
        if self._path is None:
            return
        # One writer at a time, so the file never goes back to an older snapshot than one already written.
        with self._write_lock:
            self._dirty = False
            self._write(json.dumps(self.totals(read_device)).encode())

    def _write(self, text: bytes) -> None:
        tmp = None
        try:
            # A fresh, exclusively created temporary file (never an existing name, never through a link), then an
            # atomic rename onto our own file name (a rename replaces a link there, it never writes through it).
            fd, tmp = tempfile.mkstemp(prefix=f"{self._path.stem}.", suffix=".tmp", dir=self._path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(text)
            os.replace(tmp, self._path)
            tmp = None
        except OSError:
            pass  # the serving process removed the directory on shutdown
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

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


def pic_fields() -> list[str]:
    pools = [f"{pool}_{f}" for pool in PIC_POOLS for f in PIC_POOL_FIELDS]
    return [f"pic_{k}" for k in (*PIC_COUNTERS, *pools, "in_use")]


def _read_worker_file(directory: str | os.PathLike, name: str) -> dict | None:
    """One worker's published values, or None for anything that is not a small regular file of a JSON object.

    Opened without following links and without blocking (a FIFO or device planted in the directory is skipped, not
    waited on), checked to be a regular file of at most `_MAX_FILE_BYTES`, read at most that far.
    """
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # a link, gone (being replaced right now: the next scrape sees it), or unreadable
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_FILE_BYTES:
            return None
        raw = os.read(fd, _MAX_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def read_totals(directory: str | os.PathLike) -> dict[str, int]:
    """Sum of every worker's published values (under TP each rank stores its own shard of the segments).

    Only files named like a worker's (`worker-<pid>.json`) count, and only their non-negative integer values; anything
    else found in the directory (other names, links, non-regular or oversized files, bad JSON) is ignored, so it can
    neither break `/metrics` nor make it read outside the directory.
    """
    totals = dict.fromkeys((*FIELDS, *pic_fields()), 0)
    try:
        names = sorted(os.listdir(directory))[:_MAX_FILES]
    except OSError:
        return totals
    for name in names:
        if not _WORKER_FILE.fullmatch(name):
            continue
        data = _read_worker_file(directory, name)
        if data is None:
            continue
        for key in totals:
            value = data.get(key, 0)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
                totals[key] += value
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
        yield from _pic_metrics(t)


_PIC_HELP = {
    "segments_hit": "PIC segments served from the segment store.",
    "segments_cold": "PIC segments computed in isolation and stored (first seen, or evicted).",
    "tokens_reused": "PIC prompt tokens spliced from stored K/V: no layer ran on them.",
    "tokens_recomputed": "PIC prompt tokens run through the layers (prefix, seams, query).",
    "shared_hits": "PIC segments missing from this instance's store and read from the shared tier.",
    "shared_misses": "PIC segments found in neither this instance's store nor the shared tier.",
    "shared_refused": "Shared-tier entries refused (truncated, corrupt or foreign) and recomputed.",
    "shared_errors": "Shared-tier reads that failed (storage error) and were recomputed.",
    "shared_queued": "PIC segments this instance computed and handed to its shared-tier writer.",
    "shared_published": "PIC segments this instance computed and wrote to the shared tier.",
    "shared_publish_failures": "PIC segments this instance could not write to the shared tier.",
    "shared_bytes_read": "Bytes of entries read from the shared tier and used.",
    "shared_bytes_written": "Bytes of entries written to the shared tier.",
}


def _pic_metrics(t: dict[str, int]):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, text in _PIC_HELP.items():
        yield CounterMetricFamily(f"vllm:hysparse_pic_{name}", text, value=t[f"pic_{name}"])
    families = {
        "bytes": GaugeMetricFamily("vllm:hysparse_pic_store_bytes", "Bytes of K/V held by the PIC segment store.",
                                   labels=["pool"]),
        "entries": GaugeMetricFamily("vllm:hysparse_pic_store_entries", "Segments held by the PIC segment store.",
                                     labels=["pool"]),
        "evictions": CounterMetricFamily("vllm:hysparse_pic_evictions", "PIC segments evicted (LRU, over budget).",
                                         labels=["pool"]),
    }
    for pool in PIC_POOLS:
        for field, family in families.items():
            family.add_metric([pool], t[f"pic_{pool}_{field}"])
    yield from families.values()
    yield GaugeMetricFamily("vllm:hysparse_pic_in_use", "PIC segments pinned by running requests.",
                            value=t["pic_in_use"])


def _private_dir(directory: str) -> bool:
    """True for an existing directory (not a link to one) owned by this user, which no other user can access."""
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


_REGISTER_LOCK = threading.Lock()
_REGISTERED = False


def register_collector() -> None:
    """Create the shared directory (first process only) and register the collector once per process."""
    global _REGISTERED
    with _REGISTER_LOCK:
        if _REGISTERED:
            return
        directory = os.environ.get(METRICS_DIR_ENV)
        if directory is not None and not _private_dir(directory):
            logger.warning("%s=%s is not a directory of this user's that only this user can access (mode 0700, "
                           "no link); using a private temporary directory for HySparse metrics instead",
                           METRICS_DIR_ENV, directory)
            directory = None
        if directory is None:
            # mkdtemp: a new directory with mode 0700, so no other user can plant, replace or redirect files in it.
            directory = tempfile.mkdtemp(prefix="vllm-hysparse-metrics-")
            os.environ[METRICS_DIR_ENV] = directory
            atexit.register(shutil.rmtree, directory, True)
        from prometheus_client import REGISTRY

        REGISTRY.register(_Collector(directory))
        _REGISTERED = True
