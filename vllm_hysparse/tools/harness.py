# SPDX-License-Identifier: Apache-2.0
"""The benchmark harness: what every script under `benchmarks/` (and the served tests) needs around `vllm serve`.

Imported by module name from anywhere (`from vllm_hysparse.tools.harness import ...`); its own imports are the
standard library only (psutil inside `tree_rss`), so a benchmark pays for vLLM and torch only where it uses them.

- servers: `VLLM`, `free_port`, `server_env_settings` / `serve_env`, `running_server` / `stop_server`,
  `exit_on_sigterm`;
- health: `wait_until_healthy` (the one health wait of the repository), `Monitor` (/health and RSS in the
  background), `tree_rss`;
- HTTP and metrics: `http_get`, `model_id`, `scrape`, `parse_metrics`, `pages_per_query`, `probe_request`,
  `wait_drained`;
- server logs: `log_tail`, `error_excerpt`, `server_log_problems`;
- machine info: `machine_info`;
- result files: `save_report`, `result_stem`, and `percentile` for the tables in them.

Checkpoint builders live in `vllm_hysparse.tools.bench_checkpoints` and the load test's workload (prompts,
streaming clients, checks against the alone answers) in `vllm_hysparse.tools.load_workload`.
"""

import contextlib
import datetime
import functools
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from importlib import metadata
from pathlib import Path

# The checkout this module was loaded from: the commit `machine_info` records is the code being measured.
REPO = Path(__file__).resolve().parents[2]
VLLM = Path(sys.executable).parent / "vllm"  # the `vllm` command of this interpreter's environment


# ---------------------------------------------------------------- servers

# Ports handed to servers come from below Linux's ephemeral range (32768-60999 by default), where the kernel never
# picks the local port of an outgoing connection: a port the OS handed out as free could be taken by another test
# process's client socket before `vllm serve` bound it (CI, 2026-12-06: "Address already in use").
PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A TCP port that nothing is bound to, on any address, at the moment of the call (`vllm serve` binds 0.0.0.0),
    drawn at random from `PORT_RANGE`."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {PORT_RANGE[0]}-{PORT_RANGE[1]} after 200 tries")


def server_env_settings(kv_space_gib: int, extra: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """The variables a server is started with on top of the inherited environment (None: unset)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(extra or {})}


def serve_env(kv_space_gib: int, extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with `server_env_settings` applied: the `env` of a `vllm serve` child."""
    env = dict(os.environ)
    for key, value in server_env_settings(kv_space_gib, extra).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@contextlib.contextmanager
def running_server(cmd: list[str], env: dict, log_path: Path, start_timeout_s: float, stop_timeout_s: float = 60):
    """Start `cmd` (a `vllm serve ... --port N`) in its own process group, logging to `log_path`; yield
    (`subprocess.Popen`, root url `http://127.0.0.1:N`) once /health answers; always stop it."""
    port = cmd[cmd.index("--port") + 1]
    root_url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_healthy(root_url, start_timeout_s, proc=proc, poll_s=2.0)
        yield proc, root_url
    finally:
        stop_server(proc, stop_timeout_s)


def stop_server(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (vLLM shuts its engine down), then SIGKILL the server's own process group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # leftover engine-core children of this server only
    proc.wait()


def exit_on_sigterm() -> None:
    """SIGTERM (e.g. a test's timeout) unwinds the stack, so the server's context manager stops it."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# ---------------------------------------------------------------- health

def wait_until_healthy(base_url: str, timeout_s: float, proc=None, log_tail=lambda: "", poll_s: float = 1.0) -> None:
    """Polls `<root>/health` until it answers 200 (`base_url`: the server's root or its `/v1` base).

    The one health wait of the repository (the demo, the tests' servers and the benchmarks). With `proc` (the
    server's `subprocess.Popen`), a server that exits stops the wait at once with a RuntimeError; past
    `timeout_s` it raises TimeoutError. Both messages end with `log_tail()` (a str), the end of the server's
    log where the caller has one.
    """
    def tail() -> str:
        text = log_tail()
        return f":\n{text}" if text else ""

    root = base_url.rsplit("/v1", 1)[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it became healthy{tail()}")
        try:
            with urllib.request.urlopen(f"{root}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"server at {root} did not become healthy within {timeout_s:.0f} s{tail()}")


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its children (0 once it is gone)."""
    import psutil

    total = 0
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
    return total


class Monitor:
    """Background thread: /health status and the server's RSS every `period_s`, tagged with the current phase.

    `samples`: dicts {t (s since start), phase, health (HTTP status or None), health_s, error, rss (bytes)}.
    """

    def __init__(self, root_url: str, pid: int, period_s: float = 0.5, health_timeout_s: float = 5.0,
                 max_samples: int = 100_000):
        self.root_url, self.pid, self.period_s = root_url, pid, period_s
        self.health_timeout_s, self.max_samples = health_timeout_s, max_samples
        self.phase = "start"
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def _run(self):
        while not self._stop.is_set() and len(self.samples) < self.max_samples:
            t = time.monotonic()
            status, err = None, None
            try:
                with urllib.request.urlopen(f"{self.root_url}/health", timeout=self.health_timeout_s) as r:
                    status = r.status
            except Exception as e:  # noqa: BLE001 - any failure to answer is recorded
                status = getattr(e, "code", None)
                err = f"{type(e).__name__}: {e}"
            latency = time.monotonic() - t
            self.samples.append({"t": t - self.t0, "phase": self.phase, "health": status, "health_s": latency,
                                 "error": err, "rss": tree_rss(self.pid)})
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - t)))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(self.health_timeout_s + 10)

    def rss_now(self) -> int:
        return tree_rss(self.pid)

    def health_summary(self, phases: set[str] | None = None) -> dict:
        rows = [s for s in self.samples if phases is None or s["phase"] in phases]
        bad = [s for s in rows if s["health"] != 200]
        lat = [s["health_s"] for s in rows]
        return {"polls": len(rows), "not_200": len(bad), "first_bad": bad[:5],
                "max_latency_s": max(lat) if lat else None,
                "p99_latency_s": percentile(lat, 99) if lat else None}


# ---------------------------------------------------------------- HTTP and metrics

def http_get(url: str, timeout: float = 10) -> str:
    """The body of a GET, decoded."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def model_id(root_url: str) -> str:
    """The first (for `vllm serve`: the only) model id on `/v1/models`."""
    return json.loads(http_get(f"{root_url}/v1/models"))["data"][0]["id"]


def scrape(root_url: str, timeout: float = 10) -> dict[str, float]:
    """Every sample on /metrics: `name` (labels dropped, summed) and `name{labels}`."""
    out: dict[str, float] = {}
    for line in http_get(f"{root_url}/metrics", timeout).splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        base = key.split("{", 1)[0]
        if base != key:
            out[base] = out.get(base, 0.0) + v
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """`vllm:hysparse_*` samples from a Prometheus text page, by name without labels."""
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:hysparse_"):
            name, _, value = line.partition(" ")
            values[name.split("{")[0]] = float(value.split()[0])
    return values


def pages_per_query(before: dict[str, float], after: dict[str, float]) -> dict:
    """Pages a sparse query touched and pages a dense query would touch, over one run (counter deltas of two
    `parse_metrics` results): {queries, pages_per_query, dense_pages_per_query} (None without queries)."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("vllm:hysparse_sparse_queries_total")
    pages, dense = delta("vllm:hysparse_pages_touched_total"), delta("vllm:hysparse_dense_pages_total")
    if queries <= 0:
        return {"queries": queries, "pages_per_query": None, "dense_pages_per_query": None}
    return {"queries": queries, "pages_per_query": pages / queries, "dense_pages_per_query": dense / queries}


def probe_request(root_url: str, timeout_s: float = 60) -> None:
    """One 1-token plain request: makes the engine run a step, which refreshes its scheduler stats."""
    body = json.dumps({"model": model_id(root_url), "prompt": [17, 18, 19], "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{root_url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def wait_drained(root_url: str, timeout_s: float, poll_s: float = 0.5, probe_every_s: float = 10.0) -> dict:
    """Poll /metrics until KV usage, running and waiting requests and PIC segments in use are all 0.

    Returns {drained (bool), after_s, values (the last readings), probes}. vLLM refreshes its scheduler
    gauges (KV usage, running, waiting) only when the engine runs a step, so when the last event was an
    abort they can keep a stale value on an idle engine; after `probe_every_s` without reaching 0 one
    1-token request is sent to make a step (counted in `probes`).
    """
    keys = ("vllm:kv_cache_usage_perc", "vllm:hysparse_pic_in_use", "vllm:num_requests_running",
            "vllm:num_requests_waiting")
    t0 = time.monotonic()
    last: dict = {}
    probes, next_probe = 0, t0 + probe_every_s
    while True:
        try:
            m = scrape(root_url)
            last = {k: m.get(k) for k in keys}
        except OSError as e:
            last = {"error": str(e)}
        if all(last.get(k) == 0 for k in keys):
            return {"drained": True, "after_s": time.monotonic() - t0, "values": last, "probes": probes}
        if time.monotonic() - t0 > timeout_s:
            return {"drained": False, "after_s": time.monotonic() - t0, "values": last, "probes": probes}
        if time.monotonic() >= next_probe:
            with contextlib.suppress(OSError):
                probe_request(root_url)
            probes += 1
            next_probe = time.monotonic() + probe_every_s
        time.sleep(poll_s)


# ---------------------------------------------------------------- server logs

def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log ("" if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def error_excerpt(path: Path, max_lines: int = 40) -> str:
    """The first traceback / error lines of a server log (what a crash looks like), else its tail."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    for i, line in enumerate(text):
        if "Traceback" in line or " ERROR " in line or "Error:" in line:
            return "\n".join(text[i:i + max_lines])
    return "\n".join(text[-max_lines:])


def server_log_problems(path: Path) -> list[str]:
    """Tracebacks and ERROR lines in a server log (the first 10, each cut to 300 characters)."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [ln[:300] for ln in lines if "Traceback" in ln or " ERROR " in ln][:10]


# ---------------------------------------------------------------- machine info

def _version(dist: str) -> str | None:
    # the installed distribution's version, read from its metadata so that vLLM and torch are not imported
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo's lines, read once per process (empty where there is none)."""
    with contextlib.suppress(OSError):
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    return ()


def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo, or None (no such file or field)."""
    line = next((x for x in _cpuinfo_lines() if x.startswith(field)), None)
    return None if line is None else line.split(":", 1)[1].strip()


def vector_isa() -> str:
    """The widest vector ISA of this CPU our C++ kernels build for ("AVX-512", "AVX2" or "scalar"): their tile
    shapes differ by it, and so do their ratios to vLLM's kernels."""
    flags = set((_cpuinfo("flags") or "").split())
    return "AVX-512" if "avx512f" in flags else "AVX2" if {"avx2", "fma"} <= flags else "scalar"


def machine_info(repo: Path = REPO) -> dict:
    """What ran the benchmark: {platform, python, cpu, cpu_count, mem_total_bytes, gpu, versions {torch, vllm,
    transformers}, git_commit, git_dirty, loadavg_1_5_15_at_start} (`repo`: the checkout whose commit counts)."""
    cpu = f"{_cpuinfo('model name') or platform.processor()} ({vector_isa()})"
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                                cwd=repo).stdout.strip())
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "mem_total_bytes": mem, "gpu": None,
            "versions": {name: _version(name) for name in ("torch", "vllm", "transformers")},
            "git_commit": commit, "git_dirty": dirty, "loadavg_1_5_15_at_start": os.getloadavg()}


# ---------------------------------------------------------------- result files

def save_report(stem: Path, result: dict, text: str) -> None:
    """`stem.json` (the result) and `stem.md` (the text, also printed)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text)


def result_stem(out_dir: Path, prefix: str, start: datetime.datetime, tag: str | None) -> Path:
    """`out_dir/<prefix>_<date>_<HHMM>[_<tag>]`, with `_2`, `_3`, ... added while that JSON exists."""
    stem = f"{prefix}_{start:%Y-%m-%d_%H%M}" + (f"_{tag}" if tag else "")
    path, n = out_dir / stem, 2
    while path.with_suffix(".json").exists():
        path, n = out_dir / f"{stem}_{n}", n + 1
    return path


def percentile(values, q: float):
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
