# SPDX-License-Identifier: Apache-2.0
"""A real `vllm serve` process for tests that talk HTTP to it (loopback only, bounded waits)."""

import contextlib
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

import tests.vllm_utils  # noqa: F401  (CPU engine environment, before vLLM starts)
from vllm_hysparse.metrics import METRICS_DIR_ENV
from vllm_hysparse.tools import harness
from vllm_hysparse.tools.harness import free_port, wait_until_healthy

VLLM = str(harness.VLLM)
# On top of the harness's server settings (`harness.server_env_settings`: KV memory, no thread binding).
# VLLM_ENABLE_V1_MULTIPROCESSING=0: the server still runs its engine core in a process of its own (vLLM's async
# client always does), but the worker runs inside it (vllm/platforms/cpu.py keeps the "uni" executor), one process
# start less per server. `USER_TOPOLOGY` restores vLLM's own layout (API server, engine core, worker) where a test
# needs it: the fault tests kill the worker, the security test counts each process's listeners, and test_serve
# starts one server exactly as a user would.
KV_SPACE_GIB = 1
SERVE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
USER_TOPOLOGY = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# The shared tiny servers of tests/entrypoints/conftest.py.
API_KEY = "hostile-test-key"
MAX_LEN = 512
VOCAB = 8192  # the tiny preset's vocabulary
# A pooled client must drop an idle connection before the server does: uvicorn closes one after
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), httpx keeps it 5 s too, and a request sent on a connection the
# server is closing at that moment dies with a connection reset (`ReadError`), which is the client's
# race, not the server's fault. (vllm/envs.py: VLLM_HTTP_TIMEOUT_KEEP_ALIVE.)
KEEPALIVE_EXPIRY_S = 1.0


def pool_limits(connections: int) -> httpx.Limits:
    """Connection limits for a client that sends `connections` requests at once to a `vllm serve`."""
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


def server_env(extra: dict | None = None) -> dict[str, str]:
    """The environment of a `vllm serve` child: ours, less the metrics directory, plus the CPU engine settings.

    The plugin's metrics collector sets the directory in this process once an in-process engine has started;
    a server that inherited it would publish into that engine's directory and report its counters as its own.
    """
    return harness.serve_env(KV_SPACE_GIB, {METRICS_DIR_ENV: None, **SERVE_ENV, **(extra or {})})


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    api_key: str | None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def death(self) -> str | None:
        """None while the server runs; else how it ended (exit status or signal, the memory left on the machine,
        the end of its log): a shared server found dead must name why, not leave the next test a refused
        connection."""
        rc = self.proc.poll()
        if rc is None:
            return None
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = meminfo.get("MemAvailable", "?").strip()
        return (f"vllm serve on port {self.port} {how} (MemAvailable now {available}); its log ends:\n"
                + self.log_tail())

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 60 s; idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@contextlib.contextmanager
def serve(ckpt, log: Path, *args: str, api_key: str | None = None, env: dict | None = None,
          start_timeout_s: float = 300):
    """`vllm serve ckpt --host 127.0.0.1 --port <free> ...`; yields a healthy `Server`, stops it afterwards."""
    port = free_port()
    cmd = [VLLM, "serve", str(ckpt), "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    server = None
    try:
        with tests.vllm_utils.timed_start("serve", count=False):
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env(env))
            server = Server(proc, port, log, api_key)
            wait_until_healthy(server.root, start_timeout_s, proc=proc, log_tail=server.log_tail)
        yield server
    finally:
        if server is not None:
            server.stop()


def error_of(response) -> tuple[str, str | None]:
    """(message, param) of an error response: vLLM's `ErrorResponse`, its 401 body, or FastAPI's `detail`."""
    try:
        body = response.json()
    except ValueError:
        return response.text, None
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message") or ""), err.get("param")
        if err is not None:
            return str(err), None
        if "message" in body:
            return str(body["message"]), body.get("param")
    return str(body), None
