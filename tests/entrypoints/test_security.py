# SPDX-License-Identifier: Apache-2.0
"""Security of what the plugin adds to `vllm serve`: API-key protection, listening sockets, the metrics channel.

One `vllm serve` on the tiny HySparse checkpoint with `--api-key`, the PIC text
middleware given a second time explicitly (`--middleware`, where vLLM puts it
*outside* its authentication), `--host 127.0.0.1` and a private `TMPDIR`:

* every `/v1` request without the key, or with a wrong one, gets vLLM's 401 and
  reaches nothing of ours (a malformed PIC text request, which the middleware
  would answer with 400, still gets 401; no request is counted);
* the only listening TCP socket of the whole process tree is `--port`;
* the worker -> API-server metrics directory is private (0700, ours, no link),
  and files planted there (bad JSON, a FIFO, a link to a file outside, a huge
  file) neither break nor hang `/metrics`, nor make it read outside it;
* the server writes nothing into the model directory and leaves nothing of ours
  in `TMPDIR` after it stops.

The metrics-directory rules are also checked without a server (`read_totals`,
`publish`, the directory check).
"""

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from tests.entrypoints.serve_utils import USER_TOPOLOGY, serve
from vllm_hysparse import metrics
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

API_KEY = "security-test-key"
MAX_LEN = 512
REPO = Path(__file__).resolve().parents[2]
METRICS_PREFIX = "vllm-hysparse-metrics-"


# ---- the metrics directory, without a server --------------------------------------------------------------------


def _read_with_timeout(directory, timeout_s=10.0):
    """read_totals in a thread: a FIFO that it opened would block it forever."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("totals", metrics.read_totals(directory)), daemon=True)
    t.start()
    t.join(timeout_s)
    assert "totals" in out, "read_totals hung on a planted file"
    return out["totals"]


def plant_hostile_files(directory: Path, outside: Path) -> list[Path]:
    """Files another process could leave in the metrics directory; `outside` holds valid, huge counters."""
    outside.write_text(json.dumps({"queries": 10**12, "pages": 10**12, "pic_segments_hit": 10**12}))
    planted = {
        "worker-900001.json": "not json {",
        "worker-900002.json": "[1, 2, 3]",
        "worker-900003.json": json.dumps({"queries": "many", "pages": None, "dense_pages": [1],
                                          "pic_segments_hit": True, "pic_segments_cold": -5}),
        "worker-900004.json": '{"queries": 1e999}',
        "worker-900005.json": "[" * 100000 + "]" * 100000,
        "worker-900006.json": json.dumps({"queries": 10**12, "pad": "x" * (1 << 20)}),  # oversized
        "evil.json": json.dumps({"queries": 10**12}),  # not a worker's name
        "worker-abc.json": json.dumps({"queries": 10**12}),
    }
    paths = []
    for name, text in planted.items():
        (directory / name).write_text(text)
        paths.append(directory / name)
    os.symlink(outside, directory / "worker-900007.json")
    os.mkfifo(directory / "worker-900008.json")
    (directory / "worker-900009.json").mkdir()
    paths += [directory / "worker-900007.json", directory / "worker-900008.json", directory / "worker-900009.json"]
    return paths


def test_read_totals_ignores_planted_files(tmp_path):
    directory = tmp_path / "metrics"
    directory.mkdir(mode=0o700)
    (directory / "worker-1.json").write_text(json.dumps({"queries": 7, "pages": 9, "pic_segments_hit": 2}))
    plant_hostile_files(directory, tmp_path / "outside.json")
    totals = _read_with_timeout(directory)
    assert totals["queries"] == 7 and totals["pages"] == 9 and totals["pic_segments_hit"] == 2
    assert totals["dense_pages"] == 0 and totals["pic_segments_cold"] == 0
    # The collector renders them all, too.
    samples = {s.name: s.value for family in metrics._Collector(str(directory)).collect() for s in family.samples}
    assert samples["vllm:hysparse_sparse_queries_total"] == 7


def test_read_totals_of_a_missing_directory_is_zero(tmp_path):
    assert set(metrics.read_totals(tmp_path / "gone").values()) == {0}


def test_publish_never_writes_through_a_link(tmp_path, monkeypatch):
    directory = tmp_path / "metrics"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(directory))
    stats = metrics.PagesPerQueryStats()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    own = directory / f"worker-{os.getpid()}.json"
    os.symlink(victim, own)  # planted at the worker's own file name
    os.symlink(victim, directory / f"worker-{os.getpid()}.tmp")  # and at the old fixed temporary name
    stats.set_pic({"segments_hit": 4})
    stats.publish()
    assert victim.read_text() == "precious"
    assert own.is_file() and not own.is_symlink()
    assert json.loads(own.read_text())["pic_segments_hit"] == 4
    assert stat.S_IMODE(own.stat().st_mode) & 0o077 == 0  # written private (mkstemp: 0600)
    assert [p.name for p in directory.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()] == []


def test_only_a_private_directory_is_accepted(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert metrics._private_dir(str(private))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    readable = tmp_path / "readable"
    readable.mkdir()
    readable.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(private)
    afile = tmp_path / "file"
    afile.write_text("")
    for bad in (shared, readable, link, afile, tmp_path / "missing", Path("/tmp")):
        assert not metrics._private_dir(str(bad)), bad


def test_an_unsafe_metrics_dir_from_the_environment_is_replaced(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code = ("import os; from vllm_hysparse.metrics import register_collector; register_collector(); "
            "print(os.environ['HYSPARSE_METRICS_DIR'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, metrics.METRICS_DIR_ENV: str(shared)})
    assert out.returncode == 0, out.stderr
    used = Path(out.stdout.strip().splitlines()[-1])
    assert used != shared and used.name.startswith(METRICS_PREFIX)
    assert "is not a directory of this user's" in out.stderr
    assert not used.exists()  # the process that made it removed it at exit


# ---- a real server ----------------------------------------------------------------------------------------------


def _snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_mode, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("security") / "tiny", "hysparse", "tiny", seed=51)


@pytest.fixture(scope="module")
def tmpdir_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("security-tmpdir")
    d.chmod(0o700)
    return d


@pytest.fixture(scope="module")
def server(ckpt, tmpdir_env, tmp_path_factory):
    log = tmp_path_factory.mktemp("security-log") / "serve.log"
    before = _snapshot(ckpt)
    with serve(ckpt, log, "--enforce-eager", "--max-model-len", str(MAX_LEN),
               "--middleware", "vllm_hysparse.pic.middleware.PICTextMiddleware",
               api_key=API_KEY, env={**USER_TOPOLOGY, "TMPDIR": str(tmpdir_env)}) as s:  # vLLM's own processes
        s.model_snapshot = before
        yield s


@pytest.fixture(scope="module")
def model(server):
    r = requests.get(f"{server.base_url}/models", headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


def _tree(server) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


def _metrics_dir(server) -> Path:
    """The directory the server's engine and workers were started with (inherited through their environment)."""
    found = set()
    for p in _tree(server)[1:]:
        try:
            value = p.environ().get(metrics.METRICS_DIR_ENV)
        except (psutil.Error, OSError):
            continue
        if value:
            found.add(value)
    assert len(found) == 1, found
    return Path(found.pop())


def _scrape(server) -> dict[str, float]:
    r = requests.get(f"{server.root}/metrics", timeout=15)
    assert r.status_code == 200, r.text[:500]
    out = {}
    for line in r.text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _counted(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix))


WRONG_AUTH = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}x"},
              {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer "}, {"Authorization": API_KEY},
              {"Authorization": f"bearer {API_KEY[:-1]}"}, {"Authorization": "Bearer \u00e9\u00e8"},
              {"X-Api-Key": API_KEY}]


def _requests(model):
    text_ok = {"model": model, "prompt": "", "max_tokens": 2,
               "vllm_xargs": {"pic_text_segments": ["prefix text", "a document", "the query"]}}
    text_bad = {"model": model, "prompt": "x", "max_tokens": 2, "vllm_xargs": {"pic_text_segments": "bad"}}
    pic_ids = {"model": model, "prompt": list(range(20, 60)), "max_tokens": 2, "vllm_xargs": {"pic_segments": [10, 30]}}
    plain = {"model": model, "prompt": "def f(x):", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # (name, method, path, body, status with the right key)
    return [("text_ok", "POST", "/v1/completions", text_ok, 200),
            ("text_bad", "POST", "/v1/completions", text_bad, 400),
            ("pic_ids", "POST", "/v1/completions", pic_ids, 200), ("plain", "POST", "/v1/completions", plain, 200),
            ("chat", "POST", "/v1/chat/completions", chat, 200), ("models", "GET", "/v1/models", None, 200)]


def test_api_key_protects_v1_and_the_pic_text_middleware(server, model):
    before = _scrape(server)
    for _, method, path, body, _ in _requests(model):
        for headers in WRONG_AUTH:
            r = requests.request(method, f"{server.root}{path}", json=body, headers=headers, timeout=30)
            # vLLM's authentication answers (its own body), not our middleware (which would say 400 for text_bad).
            assert r.status_code == 401, (path, body, headers, r.status_code, r.text[:300])
            assert r.json() == {"error": "Unauthorized"}
    after = _scrape(server)
    for prefix in ("vllm:prompt_tokens_total", "vllm:request_success_total", "vllm:generation_tokens_total",
                   "vllm:hysparse_pic_tokens_recomputed_total", "vllm:hysparse_pic_segments_cold_total"):
        assert _counted(after, prefix) == _counted(before, prefix), prefix
    # With the key the same requests are served (text_bad: the middleware's 400 naming the field).
    for name, method, path, body, status in _requests(model):
        r = requests.request(method, f"{server.root}{path}", json=body, headers=server.headers, timeout=60)
        assert r.status_code == status, (name, r.text[:300])
        if name == "text_bad":
            assert r.json()["error"]["param"] == "pic_text_segments", r.text


def test_unguarded_paths_are_vllms_own(server):
    """vLLM guards only /v1, /v2, /inference and /cohere; /health and /metrics answer without a key.

    Recorded vLLM behaviour: our `vllm:hysparse_*` values are on /metrics with vLLM's own, unauthenticated as
    those are; they are aggregate counters and gauges (no request content, ids or salts).
    """
    assert requests.get(f"{server.root}/health", timeout=10).status_code == 200
    r = requests.get(f"{server.root}/metrics", timeout=15)
    assert r.status_code == 200
    ours = [line for line in r.text.splitlines() if line.startswith("vllm:hysparse_")]
    assert ours
    for line in ours:
        assert re.fullmatch(r'vllm:hysparse_[a-z_]+(\{pool="(public|private)"\})? [0-9.e+]+', line), line


def test_nothing_listens_but_the_port(server):
    """The API server listens on --port only; the only other listeners are vLLM's worker's gloo groups, on loopback.

    Recorded vLLM behaviour: on CPU vLLM initialises torch.distributed with the gloo backend in the worker
    (`backend=gloo` in its log, one process group per parallel dimension) and gloo listens on a loopback port
    per group. Our code opens no socket at all (`test_our_code_opens_no_sockets`).
    """
    listening = {}
    for p in _tree(server):
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                listening.setdefault(p.pid, set()).add((c.laddr.ip, c.laddr.port))
    assert listening.pop(server.proc.pid) == {("127.0.0.1", server.port)}, listening
    log = server.log.read_text(errors="replace")
    gloo_workers = {int(m.group(1)) for m in re.finditer(r"\(Worker pid=(\d+)\).*backend=gloo", log)}
    print(f"\n[security] listeners besides --port: {dict((k, len(v)) for k, v in listening.items())} "
          f"(gloo workers {sorted(gloo_workers)})")
    assert set(listening) <= gloo_workers, (listening, gloo_workers)
    assert all(ip == "127.0.0.1" for addrs in listening.values() for ip, _ in addrs), listening


# Client-side tools that start and probe `vllm serve` (the benchmark harness finds a free port by binding one):
# never imported by what a server runs (tests/test_layers.py forbids serving code to import `tools`).
# The PIC router (`python -m vllm_hysparse.pic.router`) is a server by design, in a process of its own: no engine or
# API server imports it.
CLIENT_TOOLS = {"vllm_hysparse/tools/harness.py", "vllm_hysparse/pic/router.py"}


def test_our_code_opens_no_sockets():
    """The runtime check above covers what runs; this covers every module of the package but the client tools."""
    pattern = re.compile(r"\b(socket\.socket|\.bind\(|\.listen\(|zmq\.|start_server|HTTPServer|uvicorn\.run"
                         r"|create_server)\b")
    hits = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "vllm_hysparse").rglob("*.py"))
            if str(path.relative_to(REPO)) not in CLIENT_TOOLS
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
    assert all((REPO / f).is_file() for f in CLIENT_TOOLS)


def test_metrics_dir_is_private(server, tmpdir_env, model):
    directory = _metrics_dir(server)
    assert directory.parent == tmpdir_env and directory.name.startswith(METRICS_PREFIX)
    info = os.lstat(directory)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    assert stat.S_IMODE(info.st_mode) == 0o700
    requests.post(f"{server.base_url}/completions", json={"model": model, "prompt": "x = 1", "max_tokens": 2},
                  headers=server.headers, timeout=60).raise_for_status()
    deadline = time.monotonic() + 10
    while not list(directory.glob("worker-*.json")):
        assert time.monotonic() < deadline, "no worker published its metrics"
        time.sleep(0.2)
    pids = {p.pid for p in _tree(server)}
    for f in directory.iterdir():
        assert re.fullmatch(r"worker-\d+\.json", f.name), f
        assert int(f.name[7:-5]) in pids, f
        fi = os.lstat(f)
        assert stat.S_ISREG(fi.st_mode) and fi.st_uid == os.getuid() and stat.S_IMODE(fi.st_mode) & 0o077 == 0, f


def test_planted_files_neither_break_nor_redirect_metrics(server, model, tmp_path):
    directory = _metrics_dir(server)
    before = _scrape(server)
    planted = plant_hostile_files(directory, tmp_path / "outside.json")
    # A link at a worker's own file name, to a file outside: the collector must not follow it, and the worker's
    # next publish must replace the link, not write through it.
    (own,) = [f for f in directory.iterdir() if re.fullmatch(r"worker-\d+\.json", f.name) and f not in planted]
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({"queries": 10**12}))
    os.replace(own, directory / "saved")
    os.symlink(victim, own)
    try:
        t0 = time.monotonic()
        during = _scrape(server)
        assert time.monotonic() - t0 < 10
        assert during["vllm:hysparse_sparse_queries_total"] < 10**12
        assert during["vllm:hysparse_pic_segments_hit_total"] == before["vllm:hysparse_pic_segments_hit_total"]
        requests.post(f"{server.base_url}/completions", json={"model": model, "prompt": "y = 2", "max_tokens": 2},
                      headers=server.headers, timeout=60).raise_for_status()
        deadline = time.monotonic() + 10
        while own.is_symlink():
            assert time.monotonic() < deadline, "the worker did not republish"
            time.sleep(0.2)
        assert json.loads(victim.read_text()) == {"queries": 10**12}
        after = _scrape(server)
        assert before["vllm:hysparse_sparse_queries_total"] <= after["vllm:hysparse_sparse_queries_total"] < 10**12
    finally:
        for p in planted:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink()
        (directory / "saved").unlink(missing_ok=True)
    assert requests.get(f"{server.root}/health", timeout=10).status_code == 200


def test_nothing_written_to_the_model_dir_and_nothing_left_in_tmpdir(server, ckpt, tmpdir_env):
    directory = _metrics_dir(server)
    server.stop()
    assert server.proc.returncode is not None
    assert _snapshot(ckpt) == server.model_snapshot
    assert not directory.exists()
    left = sorted(p.name for p in tmpdir_env.iterdir())
    assert not [n for n in left if n.startswith(METRICS_PREFIX)], left
    print(f"\n[security] left in TMPDIR by vLLM after shutdown: {left}")


def test_make_checkpoint_writes_only_its_output(tmp_path, monkeypatch):
    """Our tools write their output directory (through a temporary sibling) and nothing else beside it or in TMPDIR."""
    import tempfile

    watched_tmp = tmp_path / "tmp"
    watched_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(watched_tmp))
    parent = tmp_path / "models"
    write_checkpoint(parent / "tiny", "hysparse", "tiny", seed=52)
    assert [p.name for p in parent.iterdir()] == ["tiny"]
    assert list(watched_tmp.iterdir()) == []
