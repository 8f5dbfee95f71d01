# SPDX-License-Identifier: Apache-2.0
"""The PIC segment store: isolated per-layer K/V of prompt segments, by content and model fingerprint.

An entry holds, for every KV-owning attention layer of the model, the K
(post-RoPE at the segment's local positions 0..len-1) and V that the layer
wrote when the segment was computed in isolation (SPEC §4): HySparse full
layers and SWA branches; HySparse2 self-decoder layers and bridged caches.
Sliding-window layers keep only the segment's last `window - 1` rows, the
only ones later rows can read.

Two pools, each with its own byte budget and LRU order: `public` for
segments any request may reuse, `private` for segments of requests that
carry their own `cache_salt` (keyed with it, so tenants never share them).
An entry pinned by a running request is never evicted; a pool over budget
evicts its least recently used unpinned entries, and an entry that does not
fit even then is used by its request and dropped when unpinned.
"""

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_hysparse import envs

POOLS = ("public", "private")
BUDGET_ENVS = {"public": envs.PIC_PUBLIC_MB.name, "private": envs.PIC_PRIVATE_MB.name}
DEFAULT_BUDGET_MB = {"public": int(envs.PIC_PUBLIC_MB.default), "private": int(envs.PIC_PRIVATE_MB.default)}


def segment_key(token_ids, fingerprint: str, salt: str | None = None) -> str:
    """Content key: sha256 of the int32 little-endian token ids, the model fingerprint and a pool salt."""
    h = hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes())
    h.update(fingerprint.encode())
    if salt:
        h.update(b"\0salt:" + salt.encode())
    return h.hexdigest()[:32]


def model_fingerprint(model: torch.nn.Module, config, dtype: torch.dtype) -> str:
    """Hash of the config (rope and sparsity parameters included), dtype and a digest of every weight.

    The weight digest reads a strided sample and the sum of each parameter,
    so it is cheap for large models and still changes with any retraining.
    """
    h = hashlib.sha256()
    h.update(config.to_json_string(use_diff=False).encode())
    h.update(str(dtype).encode())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 256)
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(flat[::step].float().cpu().numpy().tobytes())
            h.update(np.float64(flat.double().sum().item()).tobytes())
    return h.hexdigest()[:32]


@dataclass
class Entry:
    key: str
    token_ids: tuple[int, ...]
    kv: dict[str, tuple[torch.Tensor, torch.Tensor, int]]  # layer -> (K, V [rows, G, D], offset of the first row)
    nbytes: int
    pins: set[str] = field(default_factory=set)  # request ids using it


def _budget_bytes(pool: str) -> int:
    mb = float(os.environ.get(BUDGET_ENVS[pool], DEFAULT_BUDGET_MB[pool]))
    if mb < 0:
        raise ValueError(f"{BUDGET_ENVS[pool]}: must be >= 0 (got {mb})")
    return int(mb * 2**20)


class Pool:
    def __init__(self, name: str, budget: int):
        self.name, self.budget = name, budget
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self.nbytes = 0
        self.evictions = 0

    def get(self, key: str, token_ids) -> Entry | None:
        entry = self.entries.get(key)
        if entry is None or entry.token_ids != tuple(token_ids):  # id recheck on every hit
            return None
        self.entries.move_to_end(key)
        return entry

    def put(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self.nbytes += entry.nbytes
        self.evict()

    def evict(self) -> None:
        for key in list(self.entries):
            if self.nbytes <= self.budget:
                return
            entry = self.entries[key]
            if not entry.pins:
                self._drop(key)

    def _drop(self, key: str) -> None:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        self.evictions += 1


class SegmentStore:
    def __init__(self):
        self.pools = {name: Pool(name, _budget_bytes(name)) for name in POOLS}
        self.held: dict[str, list[tuple[str, str]]] = {}  # request id -> [(pool, key)] it pins

    def lookup(self, pool: str, key: str, token_ids, req_id: str) -> Entry | None:
        entry = self.pools[pool].get(key, token_ids)
        if entry is not None:
            self._pin(pool, entry, req_id)
        return entry

    def insert(self, pool: str, key: str, token_ids, kv: dict, req_id: str) -> Entry:
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v, _ in kv.values())
        entry = Entry(key, tuple(token_ids), kv, nbytes)
        self._pin(pool, entry, req_id)
        self.pools[pool].put(entry)
        return entry

    def _pin(self, pool: str, entry: Entry, req_id: str) -> None:
        if req_id not in entry.pins:
            entry.pins.add(req_id)
            self.held.setdefault(req_id, []).append((pool, entry.key))

    def release(self, req_id: str) -> None:
        """A request finished, was aborted or preempted: unpin what it held and apply the budgets."""
        for pool, key in self.held.pop(req_id, []):
            entry = self.pools[pool].entries.get(key)
            if entry is not None:
                entry.pins.discard(req_id)
        for p in self.pools.values():
            p.evict()

    def in_use(self) -> int:
        """Entries pinned by at least one running request."""
        return sum(1 for p in self.pools.values() for e in p.entries.values() if e.pins)

    def stats(self) -> dict[str, int]:
        out = {}
        for name, p in self.pools.items():
            out[f"{name}_bytes"], out[f"{name}_entries"], out[f"{name}_evictions"] = p.nbytes, len(p.entries), p.evictions
        out["in_use"] = self.in_use()
        return out
