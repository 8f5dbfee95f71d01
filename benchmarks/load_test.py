# SPDX-License-Identifier: Apache-2.0
"""Load test of `vllm serve` on the tiny HySparse and HySparse2 checkpoints, PIC requests mixed in.

    python benchmarks/load_test.py                     # 256 clients, every prompt distinct, both archs
    python benchmarks/load_test.py --clients 256 --distinct 64 --output-lens 2 8 --out-dir /tmp/x   # CI size

Per architecture, one server at a time (`vllm serve <tiny checkpoint> --dtype float32`):

1. **warm-up**: a burst of `--warmup-clients` concurrent streaming requests on other prompts (not checked);
2. **alone**: every distinct prompt is served one request at a time (non-streaming, greedy, `ignore_eos`,
   `cache_salt` "alone" so the load never hits these blocks or PIC segments), with the longest output
   any client asks of it: the reference answer;
3. **load**: `--clients` streaming clients start at once (async `openai` client, `max_retries=0`, a bounded
   timeout); a `--pic-fraction` share send PIC requests (`vllm_xargs.pic_segments`) whose documents come
   from a small pool, in new orders; a `--disconnect-fraction` share close their stream after a random
   number of chunks. Prompts are token ids of mixed lengths, outputs of mixed lengths;
4. **drain**: `vllm:kv_cache_usage_perc` and `vllm:hysparse_pic_in_use` on /metrics must return to 0
   (bounded wait).

A background thread polls `/health` and the server's resident memory (psutil, the server process and its
children) every `--poll-s` throughout. Pass criteria, per architecture: no request fails; every completed
request returns exactly the alone answer's first `max_tokens` tokens (greedy continuations do not depend
on `max_tokens`), and every disconnected one a prefix of it; `/health` answers 200 at every poll; KV usage
and PIC segments in use return to 0; RSS stays within `--rss-tolerance` of its value after warm-up.
Writes `benchmarks/results/load/load_<date>_<HHMM>[_<tag>].{json,md,png}` (TTFT / TPOT p50 and p99,
throughput, memory, every criterion) and exits 1 when a criterion fails.
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
                                         percentile, result_stem, running_server, scrape, serve_env,
                                         server_log_problems, wait_drained)
from vllm_hysparse.tools.load_workload import (ARCHS, LABELS, SEEDS, DocPool, Outcome, alone_answers, check_outcomes,
                                               ensure_tiny, make_jobs, make_specs, run_burst, serve_cmd)

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "load"


# ---------------------------------------------------------------- latency

def latency_stats(outcomes: list[Outcome]) -> dict:
    ok = [o for o in outcomes if not o.error]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    tpot = [o.tpot for o in ok if o.tpot is not None]
    e2e = [o.e2e for o in ok if not o.disconnected and o.e2e is not None]
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    return {"n": len(ok), "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
            "e2e_p50_ms": ms(percentile(e2e, 50)), "e2e_p99_ms": ms(percentile(e2e, 99)),
            "ttft_mean_ms": ms(statistics.fmean(ttft)) if ttft else None,
            "tpot_mean_ms": ms(statistics.fmean(tpot)) if tpot else None}


# ---------------------------------------------------------------- one architecture

def run_arch(arch: str, args, work: Path, logs: Path) -> dict:
    rng = random.Random(args.seed * 1000 + SEEDS[arch])
    pool = DocPool(rng)
    specs = make_specs(rng, args.distinct or args.clients, args.pic_fraction, tuple(args.prompt_lens), pool)
    jobs = make_jobs(rng, specs, args.clients, tuple(args.output_lens), args.disconnect_fraction)
    warm_specs = make_specs(rng, min(args.warmup_clients, 64), args.pic_fraction, tuple(args.prompt_lens), pool)
    warm_jobs = make_jobs(rng, warm_specs, args.warmup_clients, tuple(args.output_lens), args.disconnect_fraction)
    need = [0] * len(specs)
    for j in jobs:
        need[j.spec] = max(need[j.spec], j.max_tokens)

    record: dict = {"arch": arch, "label": LABELS[arch], "errors": [], "phases_s": {}}
    ckpt = ensure_tiny(arch, work)
    log_path = logs / f"serve_{arch}.log"
    record["server_log"] = str(log_path)
    t_arch = time.monotonic()
    port = free_port()
    try:
        with running_server(serve_cmd(ckpt, port, args), serve_env(args.kv_space_gib), log_path,
                            args.start_timeout) as (proc, root):
            record["phases_s"]["startup"] = time.monotonic() - t_arch
            model = model_id(root)
            with Monitor(root, proc.pid, args.poll_s) as mon:
                mon.phase = "warmup"
                t = time.monotonic()
                warm, _ = asyncio.run(run_burst(root, model, warm_specs, warm_jobs, args.request_timeout,
                                                args.overall_timeout))
                record["warmup_failed"] = sum(1 for o in warm if o.error)
                record["phases_s"]["warmup"] = time.monotonic() - t
                mon.phase = "alone"
                t = time.monotonic()
                answers = alone_answers(root, model, specs, need, args.request_timeout)
                record["phases_s"]["alone"] = time.monotonic() - t
                wait_drained(root, 30)
                time.sleep(1.0)
                rss_base = mon.rss_now()
                mon.phase = "load"
                before = scrape(root)
                outcomes, wall = asyncio.run(run_burst(root, model, specs, jobs, args.request_timeout,
                                                       args.overall_timeout))
                record["phases_s"]["load"] = wall
                mon.phase = "drain"
                drain = wait_drained(root, args.drain_timeout)
                time.sleep(1.0)
                rss_end = mon.rss_now()
                after = scrape(root)
            record["server_log_problems"] = server_log_problems(log_path)
    except Exception as e:  # noqa: BLE001 - a crashed or hung server is a result too
        record["errors"].append(f"{type(e).__name__}: {e}")
        record["server_log_excerpt"] = error_excerpt(log_path)
        record["total_s"] = time.monotonic() - t_arch
        return record

    checks = check_outcomes(outcomes, jobs, answers)
    load_rss = [s["rss"] for s in mon.samples if s["phase"] in ("load", "drain") and s["rss"]] + [rss_end]
    tokens = sum(len(o.tokens) for o in outcomes if not o.error)
    prompt_tokens = sum(len(specs[j.spec].prompt) for j, o in zip(jobs, outcomes) if not o.error)
    pic_delta = {k.removeprefix("vllm:hysparse_pic_"): after.get(k, 0) - before.get(k, 0)
                 for k in ("vllm:hysparse_pic_segments_hit_total", "vllm:hysparse_pic_segments_cold_total",
                           "vllm:hysparse_pic_tokens_reused_total", "vllm:hysparse_pic_tokens_recomputed_total")}
    pic_delta["store_bytes"] = after.get("vllm:hysparse_pic_store_bytes")
    record.update({
        "workload": {"clients": args.clients, "distinct_prompts": len(specs),
                     "pic_clients": sum(1 for j in jobs if specs[j.spec].pic_segments),
                     "disconnecting_clients": sum(1 for j in jobs if j.disconnect_after is not None),
                     "prompt_tokens_min_max": [min(len(s.prompt) for s in specs), max(len(s.prompt) for s in specs)],
                     "prompt_tokens_mean": statistics.fmean(len(s.prompt) for s in specs),
                     "output_tokens_min_max": [min(j.max_tokens for j in jobs), max(j.max_tokens for j in jobs)],
                     "pic_documents": len(pool.docs), "pic_prefixes": len(pool.prefixes)},
        "checks": checks,
        "latency": latency_stats(outcomes),
        "latency_by_kind": {k: latency_stats([o for o in outcomes if o.kind == k]) for k in ("plain", "pic")},
        "throughput": {"output_tokens": tokens, "prompt_tokens": prompt_tokens, "wall_s": wall,
                       "output_tokens_per_s": tokens / wall, "total_tokens_per_s": (tokens + prompt_tokens) / wall,
                       "requests_per_s": len(outcomes) / wall},
        "memory": {"rss_after_warmup_bytes": rss_base, "rss_max_during_load_bytes": max(load_rss),
                   "rss_min_during_load_bytes": min(load_rss), "rss_after_drain_bytes": rss_end,
                   "max_over_base": max(load_rss) / rss_base, "min_over_base": min(load_rss) / rss_base},
        "health": mon.health_summary(),
        "drain": drain,
        "pic_counters_load": pic_delta,
        "alone": {"requests": len(answers), "mean_s": statistics.fmean(a["s"] for a in answers),
                  "min_top2_margin": min((m for a in answers for m in a["margins"] if m is not None), default=None)},
        "samples": {"ttft_s": [o.ttft for o in outcomes if o.ttft is not None],
                    "tpot_s": [o.tpot for o in outcomes if o.tpot is not None],
                    "monitor": [{k: s[k] for k in ("t", "phase", "health", "rss")} for s in mon.samples]},
    })
    record["criteria"] = criteria(record, args.rss_tolerance)
    record["total_s"] = time.monotonic() - t_arch
    return record


def criteria(rec: dict, rss_tol: float) -> dict:
    c = rec["checks"]
    crit = {
        "no_request_failed": {"pass": not c["failed"] and rec.get("warmup_failed", 0) == 0,
                              "value": f"{len(c['failed'])} failed under load, "
                                       f"{rec.get('warmup_failed', 0)} in warm-up"},
        "completed_match_alone": {"pass": not c["mismatched"] and not c["wrong_length"] and c["completed"] > 0,
                                  "value": f"{c['completed']} completed + {c['disconnected']} disconnected checked, "
                                           f"{len(c['mismatched'])} mismatched, {len(c['wrong_length'])} wrong length"},
        "health_200_throughout": {"pass": rec["health"]["not_200"] == 0 and rec["health"]["polls"] > 0,
                                  "value": f"{rec['health']['polls']} polls, {rec['health']['not_200']} not 200, "
                                           f"max {rec['health']['max_latency_s']:.3f} s"},
        "kv_and_pic_in_use_back_to_zero": {"pass": rec["drain"]["drained"],
                                           "value": f"{rec['drain']['values']} after {rec['drain']['after_s']:.1f} s"},
        "rss_within_tolerance": {"pass": rec["memory"]["max_over_base"] <= 1 + rss_tol
                                 and rec["memory"]["min_over_base"] >= 1 - rss_tol,
                                 "value": f"max {rec['memory']['max_over_base']:.3f}x, min "
                                          f"{rec['memory']['min_over_base']:.3f}x of "
                                          f"{rec['memory']['rss_after_warmup_bytes'] / 2**20:.0f} MiB"},
    }
    return crit


# ---------------------------------------------------------------- report

def _f(x, d=1):
    return "—" if x is None else f"{x:,.{d}f}"


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# Load test, {result['date']}", "",
             f"`{result['command']}`", "",
             f"{s['clients']} concurrent streaming clients per architecture ({s['pic_fraction']:.0%} PIC, "
             f"{s['disconnect_fraction']:.0%} disconnect mid-stream), prompt lengths {s['prompt_lens'][0]}-"
             f"{s['prompt_lens'][1]} tokens (log-uniform; PIC: prefix + 1-4 of 8 pool documents + query), "
             f"outputs {s['output_lens'][0]}-{s['output_lens'][1]} tokens (greedy, `ignore_eos`), "
             f"`--max-num-seqs {s['max_num_seqs']}`{', `--enforce-eager`' if s['enforce_eager'] else ''}.", "",
             "| model | requests | completed | disconnected | failed | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
             "| TPOT p99 ms | output tok/s | total tok/s | load wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rec in result["archs"].values():
        if "latency" not in rec:
            lines.append(f"| {rec['label']} | error: {'; '.join(rec['errors'])} |")
            continue
        L, T, c = rec["latency"], rec["throughput"], rec["checks"]
        lines.append(f"| {rec['label']} | {rec['workload']['clients']} | {c['completed']} | {c['disconnected']} | "
                     f"{len(c['failed'])} | {_f(L['ttft_p50_ms'])} | {_f(L['ttft_p99_ms'])} | {_f(L['tpot_p50_ms'])} "
                     f"| {_f(L['tpot_p99_ms'])} | {_f(T['output_tokens_per_s'])} | {_f(T['total_tokens_per_s'])} | "
                     f"{_f(T['wall_s'])} |")
    lines += ["", "| model | kind | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
              "| --- | --- | --- | --- | --- | --- |"]
    for rec in result["archs"].values():
        for kind, L in rec.get("latency_by_kind", {}).items():
            lines.append(f"| {rec['label']} | {kind} | {_f(L['ttft_p50_ms'])} | {_f(L['ttft_p99_ms'])} | "
                         f"{_f(L['tpot_p50_ms'])} | {_f(L['tpot_p99_ms'])} |")
    lines += ["", "| model | RSS after warm-up MiB | max during load MiB | after drain MiB | max / base | "
              "PIC hits / cold (load) | startup s | warm-up s | alone s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rec in result["archs"].values():
        if "memory" not in rec:
            continue
        m, p, ph = rec["memory"], rec["pic_counters_load"], rec["phases_s"]
        lines.append(f"| {rec['label']} | {m['rss_after_warmup_bytes'] / 2**20:,.0f} | "
                     f"{m['rss_max_during_load_bytes'] / 2**20:,.0f} | {m['rss_after_drain_bytes'] / 2**20:,.0f} | "
                     f"{m['max_over_base']:.3f} | {p['segments_hit_total']:.0f} / {p['segments_cold_total']:.0f} | "
                     f"{_f(ph.get('startup'))} | {_f(ph.get('warmup'))} | {_f(ph.get('alone'))} |")
    lines += ["", "| model | criterion | pass | value |", "| --- | --- | --- | --- |"]
    for rec in result["archs"].values():
        for name, c in rec.get("criteria", {}).items():
            lines.append(f"| {rec['label']} | {name} | {'PASS' if c['pass'] else 'FAIL'} | {c['value']} |")
    lines += ["", f"Overall: **{'PASS' if result['passed'] else 'FAIL'}**. TTFT counts from the moment all clients "
              "start (it includes queueing); TPOT = (last token - first token) / (tokens - 1) of completed requests. "
              "Machine: " + f"{result['machine']['cpu']}, {result['machine']['cpu_count']} cores shared with other "
              f"work (load average {', '.join(f'{x:.2f}' for x in result['loadavg_start'])} at start, "
              f"{', '.join(f'{x:.2f}' for x in result['loadavg_end'])} at end).", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for rec in result["archs"].values():
        if "samples" not in rec:
            continue
        for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
            v = sorted(x * 1000 for x in rec["samples"][key])
            if v:
                ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=rec["label"])
            ax.set_xlabel(f"{title} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{title} distribution (CDF)")
        mon = rec["samples"]["monitor"]
        axes[2].plot([s["t"] for s in mon], [s["rss"] / 2**20 for s in mon], label=rec["label"])
    axes[2].set_xlabel("time since server up (s)")
    axes[2].set_ylabel("server RSS (MiB)")
    axes[2].set_title("resident memory (warm-up, alone, load, drain)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--distinct", type=int, default=0, help="distinct prompts (0: one per client)")
    p.add_argument("--pic-fraction", type=float, default=0.25)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[8, 700], metavar=("MIN", "MAX"))
    p.add_argument("--output-lens", type=int, nargs=2, default=[4, 32], metavar=("MIN", "MAX"))
    p.add_argument("--warmup-clients", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-space-gib", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--request-timeout", type=float, default=300, help="per request (openai client timeout), s")
    p.add_argument("--overall-timeout", type=float, default=600, help="bound on one burst, s")
    p.add_argument("--drain-timeout", type=float, default=60)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--rss-tolerance", type=float, default=0.10)
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
    stem = result_stem(args.out_dir, "load", start, args.tag)
    result = {"date": f"{start:%Y-%m-%d %H:%M}", "command": shlex.join([sys.executable, *sys.argv]),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": machine_info(), "loadavg_start": os.getloadavg(), "archs": {}}
    logs = args.out_dir / "tmp" / stem.name  # server logs (ignored by git)
    logs.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="load_test_") as tmp:
            for arch in args.archs:
                print(f"[{arch}] starting", flush=True)
                rec = run_arch(arch, args, Path(tmp), logs)
                result["archs"][arch] = rec
                crit = rec.get("criteria", {})
                print(f"[{arch}] {rec.get('total_s', 0):.0f} s, errors {rec['errors']}, "
                      + ", ".join(f"{k}={'PASS' if v['pass'] else 'FAIL'}" for k, v in crit.items()), flush=True)
                if rec["errors"]:
                    print(rec.get("server_log_excerpt", ""), file=sys.stderr)
                # what is done so far, in case the run is stopped before the next architecture finishes
                stem.with_suffix(".partial.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    except SystemExit:
        result["archs"].setdefault("stopped", {"arch": "stopped", "label": "stopped", "errors": ["SIGTERM"]})
        raise
    finally:
        stem.with_suffix(".partial.json").unlink(missing_ok=True)
        if result["archs"]:
            finish(result, stem, start)
    return 0 if result["passed"] else 1


def finish(result: dict, stem: Path, start: datetime.datetime) -> None:
    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = (datetime.datetime.now() - start).total_seconds()
    result["passed"] = all(not r["errors"] and all(c["pass"] for c in r.get("criteria", {}).values())
                           for r in result["archs"].values())
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    report = markdown(result)
    stem.with_suffix(".md").write_text(report)
    plot(result, stem.with_suffix(".png"))
    print(report)
    print(f"wrote {stem}.json (.md, .png) in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
