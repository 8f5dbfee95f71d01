# SPDX-License-Identifier: Apache-2.0
"""The PIC shared tier's entry format and directory backend (`vllm_hysparse/pic/shared.py`), without an engine.

Entries are drawn fresh from a printed seed (`HYSPARSE_SHARED_SEED` replays it); every corruption is applied at a
random place. Both instances behind one directory, in the real server, are in `test_shared_serve.py`.
"""

import os
import random

import pytest
import torch

from vllm_hysparse.pic.shared import (
    MAGIC,
    SHARED_ENV,
    SHARED_MB_ENV,
    DirectoryTier,
    Publisher,
    SharedEntryError,
    SharedTierConfigError,
    decode_entry,
    encode_entry,
    open_shared_tier,
)

SEED = int(os.environ.get("HYSPARSE_SHARED_SEED", random.SystemRandom().randrange(2**31)))
FP = "f" * 32


@pytest.fixture(scope="module")
def rng():
    print(f"seed {SEED} (HYSPARSE_SHARED_SEED replays it)")
    return random.Random(SEED)


def _entry(rng, dtype=torch.float32, layers=3):
    """(key, token ids, kv) of a random segment: some layers windowed (a first row past 0)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    n = rng.randrange(1, 90)
    ids = [rng.randrange(16, 50000) for _ in range(n)]
    kv = {}
    for i in range(layers):
        first = rng.choice([0, max(0, n - rng.randrange(1, 40))])
        g, d, dv = rng.choice([1, 2]), rng.choice([8, 16]), rng.choice([8, 12])
        k = torch.randn(n - first, g, d, generator=gen).to(dtype)
        v = torch.randn(n - first, g, dv, generator=gen).to(dtype)
        kv[f"model.layers.{i}.self_attn.attn"] = (k, v, first)
    return f"{rng.getrandbits(128):032x}", ids, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_an_entry_reads_back_bit_for_bit(rng, dtype):
    key, ids, kv = _entry(rng, dtype)
    got = decode_entry(encode_entry(key, FP, "public", ids, kv), key, FP, "public", ids)
    assert got.keys() == kv.keys()
    for name, (k, v, first) in kv.items():
        gk, gv, gfirst = got[name]
        assert gfirst == first and gk.dtype == k.dtype and gk.shape == k.shape and gv.shape == v.shape
        assert torch.equal(gk.view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(gv.view(torch.uint8), v.view(torch.uint8))


def test_corrupt_and_truncated_entries_are_refused(rng):
    key, ids, kv = _entry(rng)
    data = encode_entry(key, FP, "public", ids, kv)
    refused = 0
    for _ in range(20):
        at = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        with pytest.raises(SharedEntryError, match="checksum|truncated|not a PIC entry"):
            decode_entry(bytes(flipped), key, FP, "public", ids)
        with pytest.raises(SharedEntryError, match="checksum|truncated"):
            decode_entry(data[:rng.randrange(len(data))], key, FP, "public", ids)
        refused += 2
    assert refused == 40
    with pytest.raises(SharedEntryError, match="checksum"):
        decode_entry(data + b"\0", key, FP, "public", ids)


@pytest.mark.parametrize("what", ["key", "fingerprint", "pool", "token_ids"])
def test_foreign_entries_are_refused_naming_what_differs(rng, what):
    key, ids, kv = _entry(rng)
    data = encode_entry(key, FP, "public", ids, kv)
    asked = {"key": key, "fingerprint": FP, "pool": "public", "token_ids": list(ids)}
    asked[what] = {"key": "0" * 32, "fingerprint": "e" * 32, "pool": "private",
                   "token_ids": [*ids[:-1], ids[-1] + 1]}[what]
    reason = "other token ids" if what == "token_ids" else f"its {what} "
    with pytest.raises(SharedEntryError, match="foreign entry: " + reason):
        decode_entry(data, **asked)


def test_a_checksummed_entry_whose_header_lies_is_refused(rng):
    import hashlib
    import json

    key, ids, kv = _entry(rng, layers=1)
    data = encode_entry(key, FP, "public", ids, kv)
    body = data[len(MAGIC) + 32:]
    n = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + n])
    header["layers"][0]["k"][0] += 1  # more rows than the payload holds
    head = json.dumps(header).encode()
    forged = len(head).to_bytes(8, "little") + head + body[8 + n:]
    with pytest.raises(SharedEntryError, match="payload shorter"):
        decode_entry(MAGIC + hashlib.sha256(forged).digest() + forged, key, FP, "public", ids)


def test_directory_entries_are_whole_files_and_the_budget_evicts_the_least_recently_used(rng, tmp_path):
    entries = [_entry(rng) for _ in range(4)]
    blobs = [encode_entry(key, FP, "public", ids, kv) for key, ids, kv in entries]
    tier = DirectoryTier(tmp_path, budget_bytes=sum(map(len, blobs)))  # room for all four
    for (key, _, _), blob in zip(entries, blobs):
        tier.put(key, blob)
    assert not list(tmp_path.rglob(".tmp-*")), "a temporary file was left behind"
    assert [tier.get(key) for key, _, _ in entries] == blobs
    # Modification times oldest first: entry 1, 0, 2, 3; then a read of entry 1 makes it the newest.
    base = os.path.getmtime(tier._path(entries[0][0])) - 1000
    for rank, i in enumerate((1, 0, 2, 3)):
        os.utime(tier._path(entries[i][0]), (base + rank, base + rank))
    assert tier.get(entries[1][0]) == blobs[1]
    tier.budget = len(blobs[1]) + len(blobs[3])
    assert tier.evict() == 2  # 0 and 2, the least recently used
    assert [tier.get(key) is not None for key, _, _ in entries] == [False, True, False, True]
    assert tier.get("ab" + "0" * 30) is None
    # A planted link or a file past the budget is never read.
    link = tier._path(entries[0][0])
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(blobs[0])
    with pytest.raises(OSError):
        tier.get(entries[0][0])
    tier._path(entries[2][0]).write_bytes(b"\0" * (max(tier.budget, 1 << 20) + 1))
    with pytest.raises(OSError, match="not an entry file"):
        tier.get(entries[2][0])


def test_publisher_writes_off_the_caller_and_counts_failures(rng, tmp_path):
    counters = dict.fromkeys(("shared_published", "shared_bytes_written", "shared_publish_failures"), 0)
    tier = DirectoryTier(tmp_path / "tier", budget_bytes=1 << 30)
    publisher = Publisher(tier, counters)
    key, ids, kv = _entry(rng)
    publisher.submit(key, FP, "public", ids, kv)
    assert publisher.drain()
    assert counters["shared_published"] == 1 and counters["shared_bytes_written"] == len(tier.get(key))
    assert decode_entry(tier.get(key), key, FP, "public", ids).keys() == kv.keys()
    (tmp_path / "tier").chmod(0o500)  # unwritable: the next publish fails, counted, and nothing raises
    try:
        if os.geteuid() == 0:  # root writes anyway: make the entry's directory a file instead
            (tmp_path / "tier").chmod(0o700)
            other = f"{rng.getrandbits(128):032x}"
            (tmp_path / "tier" / other[:2]).write_text("not a directory")
            key = other
        publisher.submit(key, FP, "public", ids, kv)
        assert publisher.drain()
    finally:
        (tmp_path / "tier").chmod(0o700)
    assert counters["shared_publish_failures"] == 1 and counters["shared_published"] == 1


@pytest.mark.parametrize("setting, needle", [
    ({SHARED_ENV: "redis-cluster://somewhere"}, "unknown scheme 'redis-cluster'"),
    ({SHARED_ENV: "file://otherhost/x"}, "a file URL names a local path"),
    ({SHARED_ENV: "{file}"}, "cannot write entries under"),
    ({SHARED_ENV: "{dir}", SHARED_MB_ENV: "-5"}, f"{SHARED_MB_ENV}: must be a number of MiB >= 0"),
    ({SHARED_ENV: "{dir}", SHARED_MB_ENV: "lots"}, f"{SHARED_MB_ENV}: must be a number of MiB >= 0"),
])
def test_bad_settings_get_one_line_naming_the_variable(tmp_path, setting, needle):
    plain = tmp_path / "plain-file"
    plain.write_text("x")
    env = {k: v.format(file=plain / "sub", dir=tmp_path / "ok") for k, v in setting.items()}
    with pytest.raises(SharedTierConfigError) as err:
        open_shared_tier(env)
    message = str(err.value)
    assert needle in message and "\n" not in message and message.split(":")[0] in (SHARED_ENV, SHARED_MB_ENV)


def test_settings_that_work(tmp_path):
    assert open_shared_tier({}) is None and open_shared_tier({SHARED_ENV: "  "}) is None
    tier = open_shared_tier({SHARED_ENV: f"file://{tmp_path}/a", SHARED_MB_ENV: "1.5"})
    assert tier.root == tmp_path / "a" and tier.budget == int(1.5 * 2**20) and tier.root.is_dir()
    assert open_shared_tier({SHARED_ENV: str(tmp_path / "b")}).budget == 4096 * 2**20


def test_a_redis_tier_stores_entries_and_turns_every_failure_into_an_oserror(rng):
    from tests.pic_utils import redis_server
    from vllm_hysparse.pic.shared import REDIS_PREFIX, RedisTier

    key, ids, kv = _entry(rng)
    blob = encode_entry(key, FP, "public", ids, kv)
    with redis_server() as (url, proc):
        tier = open_shared_tier({SHARED_ENV: url})
        assert isinstance(tier, RedisTier) and tier.ping() is None
        assert tier.get(key) is None
        tier.put(key, blob)
        assert tier.get(key) == blob and tier.client.exists(REDIS_PREFIX + key)
        assert decode_entry(tier.get(key), key, FP, "public", ids).keys() == kv.keys()
        proc.terminate()
        proc.wait(10)
        with pytest.raises(OSError, match="ConnectionError"):
            tier.get(key)
        with pytest.raises(OSError):
            tier.put(key, blob)
    secret = RedisTier("redis://user:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in secret.url and secret.url.startswith("redis://127.0.0.1:1")
