# SPDX-License-Identifier: Apache-2.0
"""The PIC segment store's second tier: entries shared by every engine instance that points at the same place.

The in-memory pools of `store.SegmentStore` stay the first tier. `VLLM_HYSPARSE_PIC_SHARED` names the second:
- a directory (a path, or `file:///path`), for instances on one host or on shared storage: an entry is one file,
  `<root>/<key[:2]>/<key>.pic`, written to a temporary name in the same directory and renamed, so a reader sees a
  whole entry or none;
- a Redis-protocol server (`redis://`, `rediss://`, `unix://` URLs: Valkey or Redis, through the `redis` client),
  for instances on many hosts: an entry is one string value under `hysparse:pic:<key>`, set in one command.
Lookup goes to the first tier, then the second, then computes; a segment computed cold is published to the second
tier by a background thread, off the step. An entry's bytes:

    8 bytes   MAGIC
    32 bytes  sha256 of everything after it
    8 bytes   header length, little-endian
    header    JSON: key, fingerprint, pool, token ids, and per layer its name, dtype, K/V shapes and first row
    payload   each layer's K bytes then V bytes, in header order

A reader refuses, with its reason, an entry that is truncated, corrupt (checksum), or foreign: another key, model
fingerprint, pool or token ids than the segment it looks for. The key already hashes the model fingerprint and,
for the private pool, the request's `cache_salt`, so tenants never find each other's entries.

The directory has a byte budget (`VLLM_HYSPARSE_PIC_SHARED_MB`); a writer that takes it over evicts the least
recently used entries (by modification time, which a read refreshes). A Redis server keeps to its own `maxmemory`
with its eviction policy (`allkeys-lru`), and every command times out after `REDIS_TIMEOUT_S`.
"""

import hashlib
import json
import logging
import os
import queue
import stat
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from vllm_hysparse import envs

logger = logging.getLogger("vllm.hysparse")

SHARED_ENV = envs.PIC_SHARED.name
SHARED_MB_ENV = envs.PIC_SHARED_MB.name
MAGIC = b"HYPIC\x00\x01\n"
_SUFFIX = ".pic"
_HEADER_MAX = 64 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                                       torch.float8_e5m2, torch.uint8, torch.int8)}


REDIS_SCHEMES = ("redis", "rediss", "unix")
REDIS_PREFIX = "hysparse:pic:"
REDIS_TIMEOUT_S = 2.0


class SharedEntryError(ValueError):
    """An entry the second tier holds but must not be used (truncated, corrupt or foreign); the reason is the text."""


class SharedTierConfigError(ValueError):
    """A bad `VLLM_HYSPARSE_PIC_SHARED` / `VLLM_HYSPARSE_PIC_SHARED_MB`; one line naming the variable."""


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_entry(key: str, fingerprint: str, pool: str, token_ids, kv: dict) -> bytes:
    """An entry's file content. kv: layer -> (K `[rows, G, D]`, V `[rows, G, Dv]`, first row offset)."""
    layers, chunks = [], []
    for name, (k, v, first) in kv.items():
        layers.append({"name": name, "dtype": str(k.dtype).removeprefix("torch."), "k": list(k.shape),
                       "v": list(v.shape), "first": int(first)})
        chunks += [_tensor_bytes(k), _tensor_bytes(v)]
    header = json.dumps({"key": key, "fingerprint": fingerprint, "pool": pool, "token_ids": [int(t) for t in token_ids],
                         "layers": layers}, separators=(",", ":")).encode()
    body = len(header).to_bytes(8, "little") + header + b"".join(chunks)
    return MAGIC + hashlib.sha256(body).digest() + body


def decode_entry(data: bytes, key: str, fingerprint: str, pool: str, token_ids) -> dict:
    """The kv dict of `encode_entry`, as CPU tensors, if `data` is a whole entry of exactly this segment.

    Raises `SharedEntryError` naming why not: truncated, corrupt, or foreign (key, fingerprint, pool, token ids).
    """
    if len(data) < len(MAGIC) + 40 or not data.startswith(MAGIC):
        raise SharedEntryError("truncated or not a PIC entry")
    body = memoryview(data)[len(MAGIC) + 32:]
    if hashlib.sha256(body).digest() != data[len(MAGIC):len(MAGIC) + 32]:
        raise SharedEntryError("checksum mismatch (corrupt or truncated)")
    n = int.from_bytes(body[:8], "little")
    if n > min(_HEADER_MAX, len(body) - 8):
        raise SharedEntryError("header length past the entry")
    try:
        header = json.loads(bytes(body[8:8 + n]))
    except ValueError as e:
        raise SharedEntryError(f"unreadable header ({e})") from None
    for field, want in (("key", key), ("fingerprint", fingerprint), ("pool", pool)):
        if header.get(field) != want:
            raise SharedEntryError(f"foreign entry: its {field} is not this segment's")
    if tuple(header.get("token_ids", ())) != tuple(int(t) for t in token_ids):
        raise SharedEntryError("foreign entry: other token ids under the same key")
    kv, offset = {}, 8 + n
    try:
        for layer in header["layers"]:
            dtype = _DTYPES[layer["dtype"]]
            tensors = []
            for shape in (layer["k"], layer["v"]):
                count = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
                if offset + count > len(body):
                    raise SharedEntryError("payload shorter than its header says")
                raw = torch.frombuffer(bytearray(body[offset:offset + count]), dtype=torch.uint8)
                tensors.append(raw.view(dtype).reshape(shape))
                offset += count
            kv[layer["name"]] = (tensors[0], tensors[1], int(layer["first"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, SharedEntryError):
            raise
        raise SharedEntryError(f"malformed header ({type(e).__name__}: {e})") from None
    if offset != len(body):
        raise SharedEntryError("payload longer than its header says")
    return kv


class DirectoryTier:
    """Entries as files under `root`, with a byte budget (LRU by modification time)."""

    def __init__(self, root: Path, budget_bytes: int):
        self.root, self.budget = Path(root), budget_bytes
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None. A link, a non-regular file or one past the budget is not read (OSError)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > max(self.budget, 1 << 20):
                raise OSError(f"{path} is not an entry file of at most the tier's budget")
            data = f.read()
        try:
            os.utime(path)  # a read makes the entry recently used
        except OSError:
            pass
        return data

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.evict()

    def entries(self) -> list[tuple[float, int, Path]]:
        """(modification time, bytes, path) of every entry, oldest first."""
        out = []
        for path in self.root.glob(f"??/*{_SUFFIX}"):
            if path.name.startswith(".tmp-"):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:  # another instance evicted it meanwhile
                continue
            out.append((st.st_mtime, st.st_size, path))
        return sorted(out)

    def evict(self) -> int:
        """Delete the least recently used entries until the directory fits its budget; returns how many."""
        entries = self.entries()
        total, dropped = sum(size for _, size, _ in entries), 0
        for _, size, path in entries:
            if total <= self.budget:
                break
            path.unlink(missing_ok=True)
            total -= size
            dropped += 1
        return dropped


class RedisTier:
    """Entries as string values on a Redis-protocol server; errors and timeouts surface as `OSError`."""

    def __init__(self, url: str, timeout_s: float = REDIS_TIMEOUT_S):
        import redis

        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        parsed = urlparse(url)
        self.url = parsed._replace(netloc=parsed.netloc.rpartition("@")[2]).geturl()  # no password in logs

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get(REDIS_PREFIX + key)
        except self._errors as e:
            raise OSError(f"{type(e).__name__}: {e}") from None

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.set(REDIS_PREFIX + key, data)
        except self._errors as e:
            raise OSError(f"{type(e).__name__}: {e}") from None

    def ping(self) -> str | None:
        """None when the server answers, else why not."""
        try:
            self.client.ping()
            return None
        except self._errors as e:
            return f"{type(e).__name__}: {e}"


def open_shared_tier(env=None) -> "DirectoryTier | RedisTier | None":
    """The second tier `VLLM_HYSPARSE_PIC_SHARED` names, or None when unset. Raises `SharedTierConfigError`."""
    env = os.environ if env is None else env
    url = env.get(SHARED_ENV, "").strip()
    if not url:
        return None
    mb_text = env.get(SHARED_MB_ENV, envs.PIC_SHARED_MB.default)
    try:
        mb = float(mb_text)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise SharedTierConfigError(f"{SHARED_MB_ENV}: must be a number of MiB >= 0 (got {mb_text!r})")
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        root = Path(parsed.path if parsed.scheme == "file" else url).expanduser()
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise SharedTierConfigError(f"{SHARED_ENV}: a file URL names a local path (file:///path), got {url!r}")
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=root, prefix=".tmp-probe-")
            probe.close()
        except OSError as e:
            raise SharedTierConfigError(f"{SHARED_ENV}: cannot write entries under {str(root)!r} "
                                        f"({e.strerror or e})") from None
        return DirectoryTier(root, int(mb * 2**20))
    if parsed.scheme in REDIS_SCHEMES:
        try:
            import redis  # noqa: F401
        except ImportError:
            raise SharedTierConfigError(f"{SHARED_ENV}: a Redis tier needs the redis client (pip install redis)") \
                from None
        try:
            tier = RedisTier(url)
        except ValueError as e:
            raise SharedTierConfigError(f"{SHARED_ENV}: not a usable Redis URL ({e})") from None
        if (why := tier.ping()) is not None:  # it may come up later: every lookup until then recomputes
            logger.warning("PIC shared tier %s does not answer yet (%s); segments are computed until it does",
                           tier.url, why)
        return tier
    raise SharedTierConfigError(f"{SHARED_ENV}: unknown scheme {parsed.scheme!r} in {url!r} (use a directory path, "
                                f"file:///path, or a redis://, rediss:// or unix:// URL)")


class Publisher:
    """Writes entries to the second tier from a daemon thread, so a step never waits for storage.

    `submit` takes the entry's tensors as they are (the first tier's own clones, never written again); the
    thread encodes and stores them. Failures are counted and logged in one line each, never raised.
    """

    def __init__(self, tier, counters: dict, on_change=None):
        self.tier, self.counters, self.on_change = tier, counters, on_change
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="hysparse-pic-publish", daemon=True)
        self.thread.start()

    def submit(self, key: str, fingerprint: str, pool: str, token_ids, kv: dict) -> None:
        self.jobs.put((key, fingerprint, pool, tuple(token_ids), kv))

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted entry is written (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.jobs.unfinished_tasks

    def _run(self) -> None:
        while True:
            key, fingerprint, pool, token_ids, kv = self.jobs.get()
            try:
                data = encode_entry(key, fingerprint, pool, token_ids, kv)
                self.tier.put(key, data)
                self.counters["shared_published"] += 1
                self.counters["shared_bytes_written"] += len(data)
            except Exception as e:  # storage full, permissions, a vanished mount: the segment stays local
                self.counters["shared_publish_failures"] += 1
                logger.warning("PIC shared tier %s: could not publish segment %s (%s: %s)", self.tier.url, key[:12],
                               type(e).__name__, e)
            finally:
                self.jobs.task_done()
                if self.on_change is not None:
                    self.on_change()
