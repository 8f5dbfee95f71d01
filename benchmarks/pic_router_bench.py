# SPDX-License-Identifier: Apache-2.0
"""PIC across instances on CPU: one instance against two behind the router, on a shared directory tier (issue 23).

    python benchmarks/pic_router_bench.py            # HySparse2 `small`, 8 documents of ~1k tokens
    python benchmarks/pic_router_bench.py --quick    # `tiny`, 8 documents of 96 tokens (about a minute)

Two `vllm serve` instances of one checkpoint (eager, float32), each pinned to one core (`taskset`, one OpenMP
thread), share a directory tier; `python -m vllm_hysparse.pic.router` runs in front of both. Every request is a
token-level PIC completion, `max_tokens=1` (TTFT = the request's wall time): a 64-token system prompt, 8 documents
of random tokens never sent before (a fresh set for every measurement), and a 32-token question. In one run:

- **cold, one instance**: the request sent to instance A directly;
- **cold, two instances**: a request over other new documents sent to the router;
- **warm, same instance**: A's documents again, in another order with another question, sent to A (its own store);
- **warm, other instance**: the same sent to B, which reads every document from the shared tier;
- **segment times**: each document of a fresh set sent alone to A as the router would send it (a publish-only
  request, answered once the segment is in the tier), timed, then the whole request to A (every segment a hit:
  the final step);
- **where the two-instance time goes**: the router's own phase timers (`vllm:hysparse_pic_router_phase_seconds`)
  around each cold two-instance request: its segments phase (set beside the LPT makespan of the segment times on
  two instances), the rest of the request at the router (the whole request on one instance, set beside the final
  step alone), and what the client saw beyond the router (HTTP through one more hop).

The projection to N instances is `cold one / (LPT makespan of the segment times on N + final step)`, set beside
HYPIC's 5.7x at 8 instances (32k tokens, 8 segments, GPUs). Writes
`benchmarks/results/pic/pic_router_<date>_<HHMM>[_quick].{json,md}`.
"""

import argparse
import contextlib
import datetime
import heapq
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_hysparse.tools.bench_checkpoints import ensure_hysparse_checkpoint
from vllm_hysparse.tools.harness import (
    VLLM,
    free_port,
    machine_info,
    result_stem,
    running_server,
    save_report,
    serve_env,
    wait_until_healthy,
)

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results" / "pic"
HYPIC_8 = 5.7
TARGETS = {"two_over_one_cold": 0.6, "warm_other_over_same": 1.2, "projection_8": 4.0}
FULL = dict(preset="small", docs=8, doc_len=1024, system_len=64, query_len=32, repeats=2, seam=8, vocab=8192,
            max_model_len=16384)
QUICK = dict(preset="tiny", docs=8, doc_len=96, system_len=64, query_len=32, repeats=2, seam=8, vocab=4096,
             max_model_len=1024)


def post(url: str, body: dict, timeout: float = 1800) -> float:
    """Seconds to the whole answer of a completion request."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: status {e.code}: {e.read()[:300]!r}") from None
    return time.perf_counter() - start


def pic_body(model: str, parts: list[list[int]], seam: int) -> dict:
    return {"model": model, "prompt": [t for p in parts for t in p], "max_tokens": 1, "temperature": 0,
            "vllm_xargs": {"pic_segments": [len(p) for p in parts], "pic_seam_tokens": seam}}


def router_phases(root: str) -> dict[str, float]:
    """The router's `vllm:hysparse_pic_router_phase_seconds_total` by phase."""
    text = urllib.request.urlopen(f"{root}/metrics", timeout=30).read().decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:hysparse_pic_router_phase_seconds_total{")}


def lpt_makespan(times: list[float], n: int) -> float:
    """Longest processing time first onto the least-loaded of `n` machines: the finishing time."""
    loads = [0.0] * n
    for t in sorted(times, reverse=True):
        heapq.heapreplace(loads, loads[0] + t)
    return max(loads)


def run(cfg: dict, ckpt: Path, work: Path) -> dict:
    from vllm_hysparse.pic.router import segment_jobs

    rng = random.Random(20261205)

    def toks(n):
        return [rng.randrange(16, cfg["vocab"]) for _ in range(n)]

    def new_request():
        docs = [toks(cfg["doc_len"] + rng.randrange(-cfg["doc_len"] // 16, cfg["doc_len"] // 16 + 1))
                for _ in range(cfg["docs"])]
        return [toks(cfg["system_len"]), *docs, toks(cfg["query_len"])]

    tier = work / "tier"
    env_extra = {"VLLM_HYSPARSE_PIC_SHARED": str(tier), "VLLM_HYSPARSE_PIC_SHARED_MB": "16384",
                 "OMP_NUM_THREADS": "1"}
    out = {"cold_one": [], "cold_two": [], "warm_same": [], "warm_other": [], "segment_s": [], "final_s": [],
           "router_segments_s": [], "router_request_s": []}
    with contextlib.ExitStack() as stack:
        roots = []
        for core in (0, 1):
            port = free_port()
            cmd = ["taskset", "-c", str(core), str(VLLM), "serve", str(ckpt), "--dtype", "float32", "--port",
                   str(port), "--host", "127.0.0.1", "--enforce-eager", "--max-model-len", str(cfg["max_model_len"])]
            _, root = stack.enter_context(running_server(cmd, serve_env(4, env_extra), work / f"serve{core}.log",
                                                         start_timeout_s=900))
            roots.append(root)
        rport = free_port()
        with open(work / "router.log", "w") as log:
            router = subprocess.Popen([sys.executable, "-m", "vllm_hysparse.pic.router", "--backends", *roots,
                                       "--port", str(rport)], stdout=log, stderr=subprocess.STDOUT)
        stack.callback(router.terminate)
        router_root = f"http://127.0.0.1:{rport}"
        wait_until_healthy(router_root, 60, proc=router)
        model = json.loads(urllib.request.urlopen(f"{roots[0]}/v1/models").read())["data"][0]["id"]
        a, b = (f"{r}/v1/completions" for r in roots)
        seam = cfg["seam"]
        post(a, pic_body(model, [toks(8), toks(40), toks(8)], seam))  # first requests pay one-off costs
        post(b, pic_body(model, [toks(8), toks(40), toks(8)], seam))
        for _ in range(cfg["repeats"]):
            parts = new_request()
            out["cold_one"].append(post(a, pic_body(model, parts, seam)))
            time.sleep(2)  # let A's writer finish, off the next measurement
            docs = parts[1:-1]
            again = [parts[0], *rng.sample(docs, len(docs)), toks(cfg["query_len"])]
            out["warm_same"].append(post(a, pic_body(model, again, seam)))
            again = [parts[0], *rng.sample(docs, len(docs)), toks(cfg["query_len"])]
            out["warm_other"].append(post(b, pic_body(model, again, seam)))
            before = router_phases(router_root)
            out["cold_two"].append(post(f"{router_root}/v1/completions", pic_body(model, new_request(), seam)))
            after = router_phases(router_root)
            out["router_segments_s"].append(after["segments"] - before["segments"])
            out["router_request_s"].append(after["request"] - before["request"])
            parts = new_request()
            body = pic_body(model, parts, seam)
            out["segment_s"].append([post(a, job) for job in segment_jobs(body)])
            time.sleep(2)
            out["final_s"].append(post(a, body))
    return out


def summarize(raw: dict) -> dict:
    med = {k: statistics.median(v) for k, v in raw.items() if k not in ("segment_s",)}
    segments = [statistics.median(ts) for ts in zip(*raw["segment_s"])]
    projection = {n: med["cold_one"] / (lpt_makespan(segments, n) + med["final_s"]) for n in (1, 2, 4, 8)}
    breakdown = {"segments_phase": med["router_segments_s"], "segments_lpt_2": lpt_makespan(segments, 2),
                 "final_phase": med["router_request_s"] - med["router_segments_s"], "final_alone": med["final_s"],
                 "beyond_router": med["cold_two"] - med["router_request_s"]}
    return {"median_s": med, "segment_median_s": segments, "projection": projection, "breakdown": breakdown,
            "two_over_one_cold": med["cold_two"] / med["cold_one"],
            "warm_other_over_same": med["warm_other"] / med["warm_same"],
            "projection_8": projection[8]}


def markdown(result: dict) -> str:
    s, cfg = result["summary"], result["config"]
    med = s["median_s"]
    lines = [f"# PIC across instances: one instance and two behind the router ({cfg['preset']})", "",
             f"`{result['command']}`", "",
             f"{cfg['docs']} documents of about {cfg['doc_len']} tokens, a {cfg['system_len']}-token system prompt "
             f"and a {cfg['query_len']}-token question, seam {cfg['seam']}; each instance pinned to one core; "
             f"medians of {cfg['repeats']} fresh requests; TTFT = wall time of a 1-token completion.", "",
             "| measurement | TTFT (s) |", "| --- | ---: |"]
    for key, label in (("cold_one", "cold, one instance"), ("cold_two", "cold, two instances behind the router"),
                       ("warm_same", "warm, the instance that computed the documents"),
                       ("warm_other", "warm, the other instance (shared tier)"),
                       ("final_s", "final step alone (every segment a hit)")):
        lines.append(f"| {label} | {med[key]:.3f} |")
    lines += ["", "| target | measured | goal | |", "| --- | ---: | ---: | --- |"]
    for key, label in (("two_over_one_cold", "cold TTFT, two instances / one"),
                       ("warm_other_over_same", "warm TTFT, other instance / same"),
                       ("projection_8", "projected speed-up at 8 instances")):
        goal = TARGETS[key]
        met = s[key] <= goal if key != "projection_8" else s[key] >= goal
        lines.append(f"| {label} | {s[key]:.2f}{'x' if key == 'projection_8' else ''} | "
                     f"{'>=' if key == 'projection_8' else '<='} {goal} | {'met' if met else 'missed'} |")
    b = s["breakdown"]
    lines += ["", f"Where the cold two-instance request's {med['cold_two']:.2f} s go (the router's phase timers; "
              f"projected {b['segments_lpt_2'] + b['final_alone']:.2f} s):", "",
              "| phase | measured (s) | projected from one instance's times (s) |", "| --- | ---: | ---: |",
              f"| segments, both instances (publish-only requests, until written) | {b['segments_phase']:.3f} | "
              f"{b['segments_lpt_2']:.3f} (LPT makespan on 2) |",
              f"| the whole request on one instance | {b['final_phase']:.3f} | {b['final_alone']:.3f} (final step "
              "alone) |",
              f"| beyond the router (one more HTTP hop) | {b['beyond_router']:.3f} | 0 |"]
    times = ", ".join(f"{t:.2f}" for t in s["segment_median_s"])
    lines += ["", f"Projection from the measured segment times (s, medians: {times}) and the final step "
              f"({med['final_s']:.2f} s), LPT schedule; HYPIC reports {HYPIC_8}x at 8 instances:", "",
              "| instances | projected speed-up |", "| ---: | ---: |"]
    lines += [f"| {n} | {v:.2f}x |" for n, v in s["projection"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset, short documents")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if shutil.which("taskset") is None:
        print("error: taskset (util-linux) is needed to pin each instance to one core", file=sys.stderr)
        return 2
    cfg = QUICK if args.quick else FULL
    start = datetime.datetime.now()
    ckpt_dir = BENCH_DIR / "checkpoints"
    if cfg["preset"] == "small":
        ckpt = ensure_hysparse_checkpoint(ckpt_dir / "hysparse2-small", "hysparse2")
    else:
        from vllm_hysparse.tools.make_checkpoint import write_checkpoint

        ckpt = ckpt_dir / "hysparse2-tiny-router"
        if not (ckpt / "config.json").exists():
            write_checkpoint(ckpt, "hysparse2", "tiny", seed=5, force=True)
    with tempfile.TemporaryDirectory(prefix="pic-router-bench-") as work:
        raw = run(cfg, ckpt, Path(work))
    command = "python benchmarks/pic_router_bench.py" + (" --quick" if args.quick else "")
    result = {"config": cfg, "command": command, "machine": machine_info(), "raw": raw, "summary": summarize(raw)}
    save_report(result_stem(args.out_dir, "pic_router", start, "quick" if args.quick else None), result,
                markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
