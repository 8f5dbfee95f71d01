"""CPU seconds per process during one `vllm bench serve` run (8 requests on a shared 8k prompt, 95% shared), per
server process (API server, engine core, worker) and the benchmark client. Run from the repository root:

    python benchmarks/results/experiments/floors_2026-12-07/cpu_split.py dense hysparse

EXTRA_SERVE adds `vllm serve` flags; the environment is passed on (e.g. VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
import psutil
ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import serve_bench as sb
from vllm_hysparse.tools.harness import free_port, running_server, serve_env

work = Path(os.environ.get("WORK", "/tmp/cpu_split")); work.mkdir(exist_ok=True)
models = sys.argv[1:] or ["dense", "hysparse"]
extra_serve = os.environ.get("EXTRA_SERVE", "").split()
class A: output_len=128; num_prompts=8; concurrency=8; seed=0; prefix_fraction=0.95; warm_runs=1
def cpu(p):
    try:
        t = p.cpu_times(); return t.user + t.system
    except psutil.Error: return 0.0
for name in models:
    ckpt = sb.CHECKPOINT_DIR / sb.SERVERS[name]["checkpoint"]
    port = free_port()
    cmd = sb.serve_command(ckpt, port, 9216, prefix_caching=True) + extra_serve
    env = serve_env(4, sb.SERVERS[name]["env"])
    with running_server(cmd, env, work / f"{name}.log", 600) as (proc, root):
        sb.warm_up(root, str(ckpt), 600)
        bcmd, warms, res = sb.bench_commands(name, ckpt, root, 8192, A, work)
        for w in warms: subprocess.run(w, capture_output=True, check=True)
        server = psutil.Process(proc.pid)
        procs = [server] + server.children(recursive=True)
        before = {p.pid: (p.name(), " ".join(p.cmdline())[:60], cpu(p)) for p in procs}
        t0 = time.monotonic()
        client = subprocess.Popen(bcmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        cp = psutil.Process(client.pid); ccpu = 0.0
        while client.poll() is None:
            try: ccpu = max(ccpu, cpu(cp) + sum(cpu(c) for c in cp.children(recursive=True)))
            except psutil.Error: pass
            time.sleep(1.0)
        wall = time.monotonic() - t0
        out = json.loads(res.read_text())
        print(f"== {name}: wall {wall:.1f} s, TTFT {out['mean_ttft_ms']:.0f} ms, TPOT {out['mean_tpot_ms']:.1f} ms")
        for p in procs:
            n, c, c0 = before[p.pid]
            print(f"   {n:20s} {cpu(p) - c0:7.2f} s  {c}")
        print(f"   client (>= sampled)  {ccpu:7.2f} s")
        res.unlink()
