# SPDX-License-Identifier: Apache-2.0
"""Soak test: `vllm serve` on a tiny checkpoint under a steady mixed load (PIC included) for `--minutes`.

    python benchmarks/soak_test.py                                # 10 minutes, 16 clients, HySparse tiny
    python benchmarks/soak_test.py --minutes 1 --out-dir /tmp/x   # CI: 10 s windows, last 20 s vs the 2nd window

`--clients` closed-loop streaming clients (async `openai`, `max_retries=0`, bounded timeout) each send one
request after another, drawn from a pool of `--pool` distinct prompts (a `--pic-fraction` share PIC requests
whose documents come from a small pool, in new orders; plain prompts of log-uniform lengths), with mixed
output lengths (greedy, `ignore_eos`); a `--disconnect-fraction` share close the stream early. Before the
soak the server is warmed up and every pool prompt is served alone (the reference); a background thread
polls `/health` and the server's RSS (psutil, server and children) throughout.

Per window (`--window-s`, 60 by default, 10 for runs of up to 2 minutes): requests, p50 / p99 end-to-end
latency, TTFT and TPOT, output tokens/s, mean and max RSS. Pass criteria: p99 latency of the last
`--last-s` seconds (default: one window; 20 s for runs of up to 2 minutes) within `--p99-ratio` (1.3) of the
second window; RSS within `--rss-tolerance` (10%) of its value after warm-up at every poll; no request
fails; every completed request returns the alone answer (disconnected ones a prefix of it); `/health` 200
at every poll; KV usage and PIC segments in use back to 0 after. Writes
`benchmarks/results/load/soak_<date>_<HHMM>[_<tag>].{json,md,png}`; exits 1 when a criterion fails.
"""

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_hysparse.tools.harness import (Monitor, error_excerpt, exit_on_sigterm, free_port, machine_info, model_id,
                                         percentile, result_stem, running_server, serve_env, server_log_problems,
                                         wait_drained)
from vllm_hysparse.tools.load_workload import (ARCHS, LABELS, SEEDS, DocPool, Job, alone_answers, check_outcomes,
                                               ensure_tiny, make_client, make_jobs, make_specs, run_burst, serve_cmd,
                                               stream_one)

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "load"


async def closed_loop(root: str, model: str, specs, clients: int, duration_s: float, rng: random.Random,
                      output_lens, disconnect_fraction: float, timeout_s: float, max_requests: int):
    """`clients` workers, each sending one request after another until `duration_s` has passed."""
    client = make_client(root, timeout_s, clients)
    t0 = time.monotonic()
    outcomes, jobs = [], []

    async def worker(w: int):
        wrng = random.Random(rng.random())
        while time.monotonic() - t0 < duration_s and len(jobs) < max_requests:
            s = wrng.randrange(len(specs))
            out = wrng.randint(*output_lens)
            job = Job(s, out, wrng.randint(1, max(1, out - 1)) if wrng.random() < disconnect_fraction else None)
            jobs.append(job)
            idx = len(jobs) - 1
            outcomes.append(None)
            outcomes[idx] = await stream_one(client, model, specs[s], job, idx, t0)

    tasks = [asyncio.create_task(worker(w)) for w in range(clients)]
    await asyncio.wait(tasks, timeout=duration_s + timeout_s + 30)
    for t in tasks:
        t.cancel()
    await client.close()
    keep = [i for i, o in enumerate(outcomes) if o is not None]
    return [outcomes[i] for i in keep], [jobs[i] for i in keep], time.monotonic() - t0


def windows(outcomes, samples, duration_s: float, window_s: float) -> list[dict]:
    """Per window of completion time: latency percentiles, throughput and RSS."""
    rows = []
    n = max(1, round(duration_s / window_s))
    for k in range(n):
        lo, hi = k * window_s, (k + 1) * window_s
        rows.append(window_row(outcomes, samples, lo, hi, f"{lo:.0f}-{hi:.0f} s"))
    return rows


def window_row(outcomes, samples, lo: float, hi: float, label: str) -> dict:
    got = [o for o in outcomes if not o.error and o.t_end is not None and lo <= o.t_end < hi]
    full = [o for o in got if not o.disconnected]
    e2e = [o.e2e for o in full]
    ttft = [o.ttft for o in got if o.ttft is not None]
    tpot = [o.tpot for o in full if o.tpot is not None]
    rss = [s["rss"] for s in samples if lo <= s["t_soak"] < hi and s["rss"]]
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    return {"window": label, "from_s": lo, "to_s": hi, "requests": len(got), "completed": len(full),
            "e2e_p50_ms": ms(percentile(e2e, 50)), "e2e_p99_ms": ms(percentile(e2e, 99)),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
            "output_tokens_per_s": sum(len(o.tokens) for o in got) / (hi - lo),
            "rss_mean_mib": statistics.fmean(rss) / 2**20 if rss else None,
            "rss_max_mib": max(rss) / 2**20 if rss else None}


def run(args, work: Path, logs: Path) -> dict:
    arch = args.arch
    rng = random.Random(args.seed * 1000 + SEEDS[arch] + 7)
    pool = DocPool(rng)
    specs = make_specs(rng, args.pool, args.pic_fraction, tuple(args.prompt_lens), pool)
    warm_specs = make_specs(rng, 32, args.pic_fraction, tuple(args.prompt_lens), pool)
    warm_jobs = make_jobs(rng, warm_specs, 2 * args.clients, tuple(args.output_lens), args.disconnect_fraction)
    duration = args.minutes * 60
    window_s = args.window_s or (60.0 if args.minutes > 2 else 10.0)
    last_s = args.last_s or (window_s if args.minutes > 2 else 20.0)
    rec: dict = {"arch": arch, "label": LABELS[arch], "errors": [], "phases_s": {}, "window_s": window_s,
                 "last_s": last_s}
    ckpt = ensure_tiny(arch, work)
    log_path = logs / f"soak_{arch}.log"
    rec["server_log"] = str(log_path)
    t_all = time.monotonic()
    try:
        with running_server(serve_cmd(ckpt, free_port(), args), serve_env(args.kv_space_gib), log_path,
                            args.start_timeout) as (proc, root):
            rec["phases_s"]["startup"] = time.monotonic() - t_all
            model = model_id(root)
            with Monitor(root, proc.pid, args.poll_s) as mon:
                mon.phase = "warmup"
                t = time.monotonic()
                for _ in range(2):
                    warm, _ = asyncio.run(run_burst(root, model, warm_specs, warm_jobs, args.request_timeout, 300))
                rec["warmup_failed"] = sum(1 for o in warm if o.error)
                rec["phases_s"]["warmup"] = time.monotonic() - t
                mon.phase = "alone"
                t = time.monotonic()
                answers = alone_answers(root, model, specs, [args.output_lens[1]] * len(specs), args.request_timeout)
                rec["phases_s"]["alone"] = time.monotonic() - t
                wait_drained(root, 30)
                time.sleep(1.0)
                rss_base = mon.rss_now()
                mon.phase = "soak"
                t_soak = time.monotonic()
                soak_offset = t_soak - mon.t0
                outcomes, jobs, wall = asyncio.run(closed_loop(
                    root, model, specs, args.clients, duration, rng, tuple(args.output_lens),
                    args.disconnect_fraction, args.request_timeout, args.max_requests))
                rec["phases_s"]["soak"] = wall
                mon.phase = "drain"
                drain = wait_drained(root, args.drain_timeout)
                rss_end = mon.rss_now()
            rec["server_log_problems"] = server_log_problems(log_path)
    except Exception as e:  # noqa: BLE001
        rec["errors"].append(f"{type(e).__name__}: {e}")
        rec["server_log_excerpt"] = error_excerpt(log_path)
        return rec

    samples = [{**s, "t_soak": s["t"] - soak_offset} for s in mon.samples]
    soak_samples = [s for s in samples if s["phase"] in ("soak", "drain")]
    rows = windows(outcomes, soak_samples, duration, window_s)
    second = rows[1] if len(rows) > 1 else rows[0]
    last = window_row(outcomes, soak_samples, duration - last_s, duration + args.request_timeout,
                      f"last {last_s:.0f} s")
    checks = check_outcomes(outcomes, jobs, answers)
    rss = [s["rss"] for s in soak_samples if s["rss"]] + [rss_end]
    ratio = (last["e2e_p99_ms"] / second["e2e_p99_ms"]) if last["e2e_p99_ms"] and second["e2e_p99_ms"] else None
    rss_second, rss_last = second["rss_mean_mib"], last["rss_mean_mib"]
    health = mon.health_summary()
    rec.update({
        "workload": {"clients": args.clients, "pool": len(specs), "minutes": args.minutes,
                     "pic_prompts": sum(1 for s in specs if s.pic_segments), "requests": len(outcomes),
                     "pic_requests": sum(1 for o in outcomes if o.kind == "pic"),
                     "disconnecting": sum(1 for j in jobs if j.disconnect_after is not None)},
        "windows": rows, "second_window": second, "last_window": last, "checks": checks, "drain": drain,
        "health": health,
        "memory": {"rss_after_warmup_bytes": rss_base, "rss_max_bytes": max(rss), "rss_min_bytes": min(rss),
                   "rss_after_drain_bytes": rss_end, "max_over_base": max(rss) / rss_base,
                   "min_over_base": min(rss) / rss_base,
                   "last_over_second_window": rss_last / rss_second if rss_last and rss_second else None},
        "throughput": {"output_tokens_per_s": sum(len(o.tokens) for o in outcomes if not o.error) / wall,
                       "requests_per_s": len(outcomes) / wall},
        "samples": {"monitor": [{k: s[k] for k in ("t_soak", "phase", "health", "rss")} for s in samples]},
    })
    rec["criteria"] = {
        "p99_latency_last_vs_second_window": {
            "pass": ratio is not None and ratio <= args.p99_ratio,
            "value": f"{last['e2e_p99_ms']:.0f} ms ({last['window']}) / {second['e2e_p99_ms']:.0f} ms "
                     f"({second['window']}) = {ratio:.3f} (limit {args.p99_ratio})" if ratio else "no data"},
        "rss_flat": {"pass": rec["memory"]["max_over_base"] <= 1 + args.rss_tolerance
                     and rec["memory"]["min_over_base"] >= 1 - args.rss_tolerance,
                     "value": f"max {rec['memory']['max_over_base']:.3f}x, min {rec['memory']['min_over_base']:.3f}x "
                              f"of {rss_base / 2**20:.0f} MiB after warm-up; last / second window "
                              f"{rec['memory']['last_over_second_window']:.3f}"},
        "no_request_failed": {"pass": not checks["failed"] and rec.get("warmup_failed", 0) == 0,
                              "value": f"{len(checks['failed'])} of {len(outcomes)} failed"},
        "completed_match_alone": {"pass": not checks["mismatched"] and not checks["wrong_length"]
                                  and checks["completed"] > 0,
                                  "value": f"{checks['completed']} completed + {checks['disconnected']} disconnected "
                                           f"checked, {len(checks['mismatched'])} mismatched, "
                                           f"{len(checks['wrong_length'])} wrong length"},
        "health_200_throughout": {"pass": health["not_200"] == 0 and health["polls"] > 0,
                                  "value": f"{health['polls']} polls, {health['not_200']} not 200, max "
                                           f"{health['max_latency_s']:.3f} s"},
        "kv_and_pic_in_use_back_to_zero": {"pass": drain["drained"],
                                           "value": f"{drain['values']} after {drain['after_s']:.1f} s"},
    }
    rec["total_s"] = time.monotonic() - t_all
    return rec


def markdown(result: dict) -> str:
    rec = result["run"]
    s = result["settings"]
    f = lambda x, d=0: "—" if x is None else f"{x:,.{d}f}"  # noqa: E731
    lines = [f"# Soak test, {result['date']}", "", f"`{result['command']}`", "",
             f"{rec['label']}: {s['clients']} closed-loop streaming clients for {s['minutes']} min over a pool of "
             f"{s['pool']} prompts ({s['pic_fraction']:.0%} PIC), outputs {s['output_lens'][0]}-{s['output_lens'][1]} "
             f"tokens, {s['disconnect_fraction']:.0%} disconnect mid-stream.", ""]
    if "windows" not in rec:
        return "\n".join(lines + [f"error: {rec['errors']}", ""])
    lines += ["| window | requests | e2e p50 ms | e2e p99 ms | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
              "| output tok/s | RSS mean MiB | RSS max MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- "
              "| --- | --- |"]
    for w in [*rec["windows"], rec["last_window"]]:
        lines.append(f"| {w['window']} | {w['requests']} | {f(w['e2e_p50_ms'])} | {f(w['e2e_p99_ms'])} | "
                     f"{f(w['ttft_p50_ms'])} | {f(w['ttft_p99_ms'])} | {f(w['tpot_p50_ms'], 1)} | "
                     f"{f(w['tpot_p99_ms'], 1)} | {f(w['output_tokens_per_s'])} | {f(w['rss_mean_mib'])} | "
                     f"{f(w['rss_max_mib'])} |")
    lines += ["", "| criterion | pass | value |", "| --- | --- | --- |"]
    for name, c in rec["criteria"].items():
        lines.append(f"| {name} | {'PASS' if c['pass'] else 'FAIL'} | {c['value']} |")
    lines += ["", f"Overall: **{'PASS' if result['passed'] else 'FAIL'}**; {rec['workload']['requests']} requests "
              f"({rec['workload']['pic_requests']} PIC), {rec['throughput']['output_tokens_per_s']:.0f} output tok/s. "
              f"Machine: {result['machine']['cpu']}, {result['machine']['cpu_count']} cores shared with other work "
              f"(load average {', '.join(f'{x:.2f}' for x in result['loadavg_start'])} at start, "
              f"{', '.join(f'{x:.2f}' for x in result['loadavg_end'])} at end).", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = result["run"]
    if "windows" not in rec:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    mid = [(w["from_s"] + w["to_s"]) / 2 for w in rec["windows"]]
    for key, label in (("e2e_p50_ms", "e2e p50"), ("e2e_p99_ms", "e2e p99"), ("ttft_p99_ms", "TTFT p99")):
        axes[0].plot(mid, [w[key] for w in rec["windows"]], marker="o", label=label)
    axes[0].set_xlabel("soak time (s)")
    axes[0].set_ylabel("latency (ms)")
    axes[0].set_title(f"{rec['label']}: latency per {rec['window_s']:.0f} s window")
    mon = [s for s in rec["samples"]["monitor"] if s["rss"]]
    axes[1].plot([s["t_soak"] for s in mon], [s["rss"] / 2**20 for s in mon])
    axes[1].axvline(0, color="gray", ls="--", lw=0.8)
    axes[1].set_xlabel("soak time (s; before 0: warm-up and alone answers)")
    axes[1].set_ylabel("server RSS (MiB)")
    axes[1].set_title("resident memory (server + children)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="hysparse")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--pool", type=int, default=48, help="distinct prompts")
    p.add_argument("--pic-fraction", type=float, default=0.25)
    p.add_argument("--disconnect-fraction", type=float, default=0.1)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[8, 400], metavar=("MIN", "MAX"))
    p.add_argument("--output-lens", type=int, nargs=2, default=[4, 32], metavar=("MIN", "MAX"))
    p.add_argument("--window-s", type=float, default=0)
    p.add_argument("--last-s", type=float, default=0)
    p.add_argument("--p99-ratio", type=float, default=1.3)
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-space-gib", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--max-requests", type=int, default=200_000)
    p.add_argument("--drain-timeout", type=float, default=60)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default=None)
    p.add_argument("--report-from", type=Path, default=None, help="redraw the .md and .png of an earlier JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    if args.report_from:
        result = json.loads(args.report_from.read_text())
        stem = args.report_from.with_suffix("")
        stem.with_suffix(".md").write_text(markdown(result))
        plot(result, stem.with_suffix(".png"))
        print(markdown(result))
        return 0 if result["passed"] else 1
    start = datetime.datetime.now()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(args.out_dir, "soak", start, args.tag)
    result = {"date": f"{start:%Y-%m-%d %H:%M}", "command": shlex.join([sys.executable, *sys.argv]),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": machine_info(), "loadavg_start": os.getloadavg()}
    logs = args.out_dir / "tmp" / stem.name  # server log (ignored by git)
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak_test_") as tmp:
        result["run"] = run(args, Path(tmp), logs)
    rec = result["run"]
    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = (datetime.datetime.now() - start).total_seconds()
    result["passed"] = not rec["errors"] and all(c["pass"] for c in rec.get("criteria", {}).values()) \
        and bool(rec.get("criteria"))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    report = markdown(result)
    stem.with_suffix(".md").write_text(report)
    plot(result, stem.with_suffix(".png"))
    print(report)
    if rec["errors"]:
        print(rec.get("server_log_excerpt", ""), file=sys.stderr)
    print(f"wrote {stem}.json (.md, .png) in {result['wall_s']:.0f} s")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
