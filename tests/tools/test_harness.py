# SPDX-License-Identifier: Apache-2.0
"""The benchmark harness (`vllm_hysparse.tools.harness`) on real sockets, processes, files and an HTTP server.

Also the rules that keep it a harness: its imports are the standard library (no vLLM, no torch), and no
script under `benchmarks/` imports another one or edits `sys.path`.
"""

import ast
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm_hysparse.tools import harness
from vllm_hysparse.tools.harness import free_port, machine_info, save_report, wait_until_healthy

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "vllm_hysparse" / "tools"


def test_free_port_is_bindable():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:  # what a server does with it next
        s.bind(("127.0.0.1", port))
        s.listen()


def test_machine_info_has_the_keys_the_reports_read():
    info = machine_info()
    # serve_bench, load_test, soak_test and pic_bench read these in their Markdown
    assert isinstance(info["cpu"], str) and info["cpu"]
    # the vector ISA the C++ kernels' tile shapes depend on, from the CPU's flags (read here independently)
    flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags and "fma" in flags else "scalar"
    assert info["cpu"].endswith(f"({isa})"), info["cpu"]
    assert info["cpu_count"] == os.cpu_count()
    assert len(info["loadavg_1_5_15_at_start"]) == 3
    assert set(info["versions"]) == {"torch", "vllm", "transformers"}
    assert all(isinstance(v, str) and v[0].isdigit() for v in info["versions"].values()), info["versions"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}", info["git_commit"]) and info["git_commit"] == head
    assert isinstance(info["git_dirty"], bool)
    for key in ("platform", "python", "mem_total_bytes", "gpu"):
        assert key in info
    assert json.loads(json.dumps(info))["cpu_count"] == os.cpu_count()  # reports store it as JSON


def test_save_report_writes_the_json_and_markdown(tmp_path, capsys):
    result = {"date": "2026-01-02 03:04", "models": {"hysparse": {"ttft_ms": [1.5, None]}}, "passed": True}
    text = "# Report\n\n| model | TTFT ms |\n| --- | ---: |\n| hysparse | 1.5 |\n"
    stem = tmp_path / "results" / "run_1"  # the folder does not exist yet
    save_report(stem, result, text)
    assert json.loads((tmp_path / "results" / "run_1.json").read_text()) == result
    assert (tmp_path / "results" / "run_1.md").read_text() == text
    assert text in capsys.readouterr().out


def test_wait_until_healthy_raises_with_the_log_tail_when_the_server_exits():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            wait_until_healthy(f"http://127.0.0.1:{free_port()}/v1", 120, proc=proc,
                               log_tail=lambda: "last line of the server log", poll_s=0.05)
        assert time.monotonic() - t0 < 60  # stopped by the exit, not by the 120 s bound
    finally:
        proc.kill()
        proc.wait()
    assert "exited with 3" in str(err.value)
    assert str(err.value).endswith(":\nlast line of the server log")


def test_wait_until_healthy_times_out_with_the_log_tail():
    with pytest.raises(TimeoutError) as err:
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", 0.3, log_tail=lambda: "tail", poll_s=0.05)
    assert str(err.value).endswith("within 0 s:\ntail")


class _Health(http.server.BaseHTTPRequestHandler):
    """Answers /health 503 for the first `busy` requests (a server still loading), then 200."""

    busy = 3
    paths: list[str] = []

    def do_GET(self):
        type(self).paths.append(self.path)
        status = 503 if len(self.paths) <= self.busy else 200
        self.send_response(status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wait_until_healthy_returns_once_the_server_answers_200():
    _Health.paths = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        wait_until_healthy(f"http://127.0.0.1:{port}/v1", 60, poll_s=0.05)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    # the `/v1` base is cut to the root; the 503s were waited out and the first 200 ended the wait
    assert _Health.paths == ["/health"] * (_Health.busy + 1)


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_harness_imports_only_the_standard_library():
    found = {m.split(".")[0] for m in _imports(TOOLS / "harness.py")}
    assert found - set(sys.stdlib_module_names) == {"psutil"}  # psutil inside tree_rss only
    # its two siblings load torch, transformers and openai inside the functions that use them
    light = {"vllm_hysparse.tools.harness", "vllm_hysparse.tools.staging"}  # standard library only, both
    for name in ("bench_checkpoints.py", "load_workload.py"):
        top = {m for m in _imports(TOOLS / name, top_level_only=True) if m.split(".")[0] not in sys.stdlib_module_names}
        assert top <= light, (name, top)
    assert {m.split(".")[0] for m in _imports(TOOLS / "staging.py")} <= set(sys.stdlib_module_names)


def test_no_benchmark_script_imports_another():
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) > 10
    names = {p.stem for p in scripts}
    bad = [f"{p.name} imports {m}" for p in scripts for m in _imports(p) if m.split(".")[0] in names]
    bad += [f"{p.name} edits sys.path" for p in scripts if "sys.path" in p.read_text()]
    assert not bad, bad
    assert harness.VLLM.name == "vllm" and harness.VLLM.parent == Path(sys.executable).parent
