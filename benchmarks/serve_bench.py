# SPDX-License-Identifier: Apache-2.0
"""Serving benchmark on CPU: HySparse2 `small` vs HySparse `small` vs a same-shape dense Llama, via `vllm serve`.

    python benchmarks/serve_bench.py            # prompt lengths 512, 2048, 4096, all four servers (~30 min on 2 cores)
    python benchmarks/serve_bench.py --quick    # prompt lengths 256, 1024
    python benchmarks/serve_bench.py --models hysparse2 hysparse2-noexit --reuse benchmarks/results/<earlier>.json
    python benchmarks/serve_bench.py --models dense hysparse hysparse2 --rounds 5   # all up, taking turns

Four server configurations, one at a time: `dense` (Llama), `hysparse`, `hysparse2` (prefill early exit on,
the default) and `hysparse2-noexit` (the same checkpoint served with `VLLM_HYSPARSE2_EARLY_EXIT=0`); with
`--rounds N` all at once, taking turns N times (ratios to dense per round: this machine's speed drifts
between runs minutes apart). Each server gets the same KV memory and `--no-enable-prefix-caching`; `vllm bench
serve` drives it (random dataset, one run per prompt length). TTFT, TPOT and throughput come from the saved
JSON, pages per query from the `vllm:hysparse_*` counters on /metrics (delta over each run), the KV lines from
the server log, and the prefill FLOPs of every configuration are computed (`vllm_hysparse/tools/prefill_flops.py`)
next to the measured TTFT. It writes `benchmarks/results/serve_cpu_<date>[_quick][_HHMM].{json,md,png}` (never
over an existing file) and prints the Markdown tables. Checkpoints are created once under
`benchmarks/checkpoints/` (random weights, nothing downloaded).
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_hysparse.tools.bench_checkpoints import ensure_dense_checkpoint, ensure_hysparse_checkpoint
from vllm_hysparse.tools.harness import (
    VLLM,
    error_excerpt,
    free_port,
    http_get,
    log_tail,
    machine_info,
    pages_per_query,
    parse_metrics,
    percentile,
    running_server,
    serve_env,
    server_env_settings,
)
from vllm_hysparse.tools.prefill_flops import flops_table, paper_ratio

BENCH_DIR = Path(__file__).resolve().parent
CHECKPOINT_DIR = BENCH_DIR / "checkpoints"
RESULTS_DIR = BENCH_DIR / "results"

MODELS = ("dense", "hysparse", "hysparse2", "hysparse2-noexit")
EARLY_EXIT_ENV = "VLLM_HYSPARSE2_EARLY_EXIT"
# name -> checkpoint directory under --checkpoints, extra server environment (None: removed), label
SERVERS = {
    "dense": {"checkpoint": "llama-small", "env": {}, "label": "dense"},
    "hysparse": {"checkpoint": "hysparse-small", "env": {}, "label": "HySparse"},
    "hysparse2": {"checkpoint": "hysparse2-small", "env": {EARLY_EXIT_ENV: None}, "label": "HySparse2 exit on"},
    "hysparse2-noexit": {"checkpoint": "hysparse2-small", "env": {EARLY_EXIT_ENV: "0"},
                         "label": "HySparse2 exit off"},
}
NOTE_IMPL = ("CPU timings compare implementations as well as architectures: HySparse's and HySparse2's "
             "attention (oracle and token-oracle layers, sparse layers, HySparse's SWA branch, HySparse2's "
             "self-decoder) runs our C++ kernels over the pages (`csrc_triton/`: the tiled oracle walk, also as "
             "the self-decoder's full attention, the window walk and the sparse kernel), while dense Llama uses "
             "vLLM's C++ CPU attention.")
NOTE_VLLM_KV = ("vLLM's 'KV cache size' counts every cache group of a hybrid model as full-length, so for "
                "HySparse / HySparse2 it understates the tokens that fit; 'ours' is our log line (full-length "
                "caches only; window caches are bounded per sequence). vLLM's count also grows with --max-model-len "
                "(the window groups' share shrinks), so compare runs at the same --max-model-len.")
NOTE_PREFIX = ("Prefix caching is off (`--no-enable-prefix-caching`, every TTFT is a full prefill) unless a "
               "model's settings say `prefix_caching: true`; `prefix_fraction` is the share of each prompt that "
               "all prompts of a run have in common.")


# ---------------------------------------------------------------- expectations (from configs, not measured)

def expected_kv_ratios(config, context_lens: list[int], dtype_bytes: int, dense_bytes_per_token: int | None = None
                       ) -> dict:
    """Dense / hybrid KV bytes per token at each context length (layers / full layers, less the SWA share).

    `dense_bytes_per_token`: the dense baseline (default: a dense model of the config's own shape).
    """
    from vllm_hysparse.configs.base import kv_bytes_per_token

    rows = {}
    for n in context_lens:
        kv = kv_bytes_per_token(config, dtype_bytes=dtype_bytes, context_len=n)
        dense = dense_bytes_per_token or kv["dense_bytes_per_token"]
        rows[n] = {"hysparse_bytes_per_token": kv["bytes_per_token"], "dense_bytes_per_token": dense,
                   "ratio_dense_over_hysparse": dense / kv["bytes_per_token"]}
    full, windowed = config.kv_cache_layers()
    per_layer = 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    dense = dense_bytes_per_token or per_layer * config.num_hidden_layers
    return {"layers": config.num_hidden_layers, "full_length_caches": full, "window_caches": windowed,
            "swa_window": config.swa_window, "block_size": getattr(config, "sparse_block_size", None),
            "topk_blocks": getattr(config, "sparse_topk_blocks", None),
            "topk_tokens": getattr(config, "sparse_topk_tokens", None),
            "recent_window": getattr(config, "recent_window", None),
            "upper_bound_layers_over_full": dense / (per_layer * full), "by_context_len": rows}


def paper_config(arch: str = "hysparse"):
    from vllm_hysparse.tools.make_checkpoint import build_config

    return build_config(arch, "paper", None)


# ---------------------------------------------------------------- parsing

_OURS_KV = re.compile(
    r"HySparse KV cache: (?P<bytes_per_token>\d+) bytes/token in (?P<full>\d+) full-length caches "
    r"\+ (?P<window_caches>\d+) window caches of (?P<window>\d+) tokens \((?P<window_bytes>\d+) bytes/sequence\); "
    r"a dense model of this shape needs (?P<dense_bytes_per_token>\d+) bytes/token"
    r"(?:; (?P<gib>[\d.]+) GiB of KV memory holds about (?P<tokens>[\d,]+) tokens)?")
_VLLM_KV = re.compile(r"KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for (?P<len>[\d,]+) "
                      r"tokens per request: (?P<conc>[\d.]+)x")


def parse_kv_log(text: str, kv_space_bytes: int) -> dict:
    """KV numbers from a server log: HySparse's own line (if any) and vLLM's 'KV cache size' line."""
    out = {}
    if m := _OURS_KV.search(text):
        ours = {k: int(m[k]) for k in ("bytes_per_token", "full", "window_caches", "window", "window_bytes",
                                       "dense_bytes_per_token")}
        if m["tokens"]:
            ours["tokens_fit"], ours["tokens_fit_source"] = int(m["tokens"].replace(",", "")), "server log"
        else:  # the model did not know the KV memory when it logged; same formula from the env setting
            ours["tokens_fit"], ours["tokens_fit_source"] = kv_space_bytes // ours["bytes_per_token"], "computed"
        out["hysparse_line"] = m[0]
        out["ours"] = ours
    if m := _VLLM_KV.search(text):
        tokens = int(m["tokens"].replace(",", ""))
        out["vllm"] = {"tokens_fit": tokens, "max_concurrency": float(m["conc"]),
                       "implied_bytes_per_token": kv_space_bytes / tokens if tokens else None}
        out["vllm_line"] = m[0]
    return out


BENCH_FIELDS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "median_itl_ms", "mean_e2el_ms", "median_e2el_ms")


def summarize_bench(result: dict) -> dict:
    return {k: result.get(k) for k in BENCH_FIELDS}


# ---------------------------------------------------------------- processes

def param_count(ckpt: Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (header only, no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                total += math.prod(st.get_slice(name).get_shape())
    return total


def serve_command(ckpt: Path, port: int, max_model_len: int, prefix_caching: bool = False) -> list[str]:
    cmd = [str(VLLM), "serve", str(ckpt), "--dtype", "float32", "--port", str(port),
           "--max-model-len", str(max_model_len)]
    return cmd + ([] if prefix_caching else ["--no-enable-prefix-caching"])


def bench_command(ckpt: Path, root_url: str, input_len: int, output_len: int, num_prompts: int,
                  concurrency: int, result_dir: Path, result_filename: str, seed: int,
                  prefix_len: int = 0) -> list[str]:
    """`vllm bench serve` on random prompts; `prefix_len` > 0: every prompt starts with one shared prefix
    of that many tokens followed by `input_len - prefix_len` of its own."""
    prefix = ["--random-prefix-len", str(prefix_len)] if prefix_len else []
    return [str(VLLM), "bench", "serve", *prefix, "--backend", "vllm", "--model", str(ckpt), "--base-url", root_url,
            "--dataset-name", "random", "--random-input-len", str(input_len - prefix_len), "--random-output-len",
            str(output_len), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_filename]


def max_model_len_for(prompt_lens: list[int], output_len: int) -> int:
    """Room for the longest prompt plus its output (random prompts can re-tokenize a little longer)."""
    return 1024 * math.ceil((max(prompt_lens) + output_len + 64) / 1024)


def warm_up(root_url: str, model: str, timeout_s: float) -> None:
    """One short request so the first measured run does not pay for first-call setup."""
    body = json.dumps({"model": model, "prompt": "def f(x):\n    return", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{root_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


# ---------------------------------------------------------------- one model

def bench_settings(args) -> dict:
    """The load one model's runs were measured under (kept per model: a reused record may differ)."""
    return {"num_prompts": args.num_prompts, "output_len": args.output_len, "concurrency": args.concurrency,
            "kv_space_gib": args.kv_space_gib, "prefix_caching": args.prefix_caching,
            "prefix_fraction": args.prefix_fraction, "warm_runs": args.warm_runs,
            "max_model_len": max_model_len_for(args.prompt_lens, args.output_len)}


_EARLY_EXIT_LOG = "HySparse2: prefill early exit on"


def new_record(name: str, ckpt: Path, args, work: Path) -> tuple[dict, list[str], Path]:
    """The result record of one server configuration, its `vllm serve` command and log path (printed)."""
    cmd = serve_command(ckpt, free_port(), max_model_len_for(args.prompt_lens, args.output_len), args.prefix_caching)
    log_path = work / f"serve_{name}.log"
    extra_env = SERVERS[name]["env"]
    record = {"checkpoint": str(ckpt), "params": param_count(ckpt), "serve_command": shlex.join(cmd),
              "serve_log": str(log_path),
              "env": server_env_settings(args.kv_space_gib, extra_env), "settings": bench_settings(args),
              "runs": {}, "errors": []}
    env_words = " ".join(f"{k}={v}" for k, v in extra_env.items() if v is not None)
    print(f"[{name}] {env_words + ' ' if env_words else ''}{shlex.join(cmd)}  (log: {log_path})", flush=True)
    return record, cmd, log_path


def start_server(stack: contextlib.ExitStack, name: str, cmd: list[str], log_path: Path, args,
                 record: dict) -> tuple[subprocess.Popen, str] | None:
    """Start `name`'s server inside `stack` and warm it up; None (the error recorded) when it does not come up."""
    t0 = time.monotonic()
    try:
        proc, root = stack.enter_context(running_server(cmd, serve_env(args.kv_space_gib, SERVERS[name]["env"]),
                                                        log_path, args.start_timeout))
        record["startup_s"] = time.monotonic() - t0
        warm_up(root, record["checkpoint"], args.bench_timeout)
        return proc, root
    except (RuntimeError, TimeoutError, OSError) as e:
        fail_server(name, record, log_path, e)
        return None


def fail_server(name: str, record: dict, log_path: Path, e: Exception) -> None:
    record["errors"].append(f"server: {e}")
    record["server_log_excerpt"] = error_excerpt(log_path)
    print(f"[{name}] error: {e}\n{record['server_log_excerpt']}", file=sys.stderr, flush=True)


def bench_commands(name: str, ckpt: Path, root: str, n: int, args, work: Path, tag: str = ""
                   ) -> tuple[list[str], list, Path]:
    """The timed `vllm bench serve` command of prompt length `n`, its untimed warm runs, its result file."""
    fname = f"bench_{name}_{n}{tag}.json"

    def command(filename):
        return bench_command(ckpt, root, n, args.output_len, args.num_prompts, args.concurrency, work, filename,
                             args.seed, prefix_len=int(n * args.prefix_fraction))

    return command(fname), [command(f"warm{w}_{fname}") for w in range(args.warm_runs)], work / fname


def bench_once(name: str, proc, n: int, bcmd: list[str], result_file: Path, args, log_path: Path,
               run: dict, record: dict) -> bool:
    """One timed `vllm bench serve` run into `run`; False when the server cannot take more (stop this model)."""
    t1 = time.monotonic()
    try:
        done = subprocess.run(bcmd, capture_output=True, text=True, timeout=args.bench_timeout)
    except subprocess.TimeoutExpired:
        run["error"] = f"vllm bench serve timed out after {args.bench_timeout} s"
        run["server_log_excerpt"] = log_tail(log_path)
        record["errors"].append(f"prompt {n}: {run['error']}")
        return False  # the server is still busy with the abandoned requests; longer prompts would be worse
    run["wall_s"] = time.monotonic() - t1
    if done.returncode != 0 or not result_file.exists():
        run["error"] = f"vllm bench serve exited with {done.returncode}"
        run["bench_output_tail"] = (done.stdout + done.stderr)[-3000:]
        run["server_log_excerpt"] = error_excerpt(log_path)
        record["errors"].append(f"prompt {n}: {run['error']}")
        if proc.poll() is not None:
            record["errors"].append(f"server exited with code {proc.returncode}")
            return False
        return True
    run["bench"] = summarize_bench(json.loads(result_file.read_text()))
    if run["bench"]["failed"]:
        run["error"] = f"{run['bench']['failed']} of {args.num_prompts} requests failed"
        run["server_log_excerpt"] = error_excerpt(log_path)
        record["errors"].append(f"prompt {n}: {run['error']}")
    b = run["bench"]
    print(f"[{name}] prompt {n}: TTFT {b['mean_ttft_ms']:.0f} ms, TPOT {b['mean_tpot_ms']:.1f} ms, "
          f"{b['output_throughput']:.2f} output tok/s ({run['wall_s']:.0f} s)", flush=True)
    return True


def finish_record(name: str, record: dict, log_path: Path, args) -> None:
    """KV lines and the early-exit check from the server log."""
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    record["kv"] = parse_kv_log(log_text, args.kv_space_gib << 30)
    if name.startswith("hysparse2"):  # the config hook logs this line when it switches early exit on
        record["early_exit_logged"] = _EARLY_EXIT_LOG in log_text
        expected = name == "hysparse2"
        if record["early_exit_logged"] != expected:
            record["errors"].append(f"server log: early exit {'off' if expected else 'on'}, expected "
                                    f"{'on' if expected else 'off'}")


def _announce(name: str, n: int, args, suffix: str = "") -> None:
    print(f"[{name}] prompt {n}: {args.num_prompts} prompts x {args.output_len} tokens, "
          f"concurrency {args.concurrency}{suffix}", flush=True)


def bench_model(name: str, ckpt: Path, args, work: Path) -> dict:
    """Serve `ckpt` alone, run every prompt length, collect timings, pages per query and KV lines."""
    record, cmd, log_path = new_record(name, ckpt, args, work)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        server = start_server(stack, name, cmd, log_path, args, record)
        try:
            for n in args.prompt_lens if server else ():
                proc, root = server
                run = {"input_len": n}
                record["runs"][str(n)] = run
                before = parse_metrics(http_get(f"{root}/metrics"))
                bcmd, warm, result_file = bench_commands(name, ckpt, root, n, args, work)
                run["bench_command"] = shlex.join(bcmd)
                for w in warm:  # the same prompts once untimed: the timed run finds them cached
                    subprocess.run(w, capture_output=True, text=True, timeout=args.bench_timeout)
                _announce(name, n, args)
                if not bench_once(name, proc, n, bcmd, result_file, args, log_path, run, record):
                    break
                if "bench" in run:
                    run["pages"] = pages_per_query(before, parse_metrics(http_get(f"{root}/metrics")))
        except OSError as e:
            fail_server(name, record, log_path, e)
    finish_record(name, record, log_path, args)
    record["total_s"] = time.monotonic() - t0
    return record


def median_bench(benches: list[dict]) -> dict:
    """Field-wise median of several runs' `vllm bench serve` summaries (counts summed)."""
    out = {}
    for k in BENCH_FIELDS:
        values = [b[k] for b in benches if b.get(k) is not None]
        if k in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
            out[k] = sum(values)
        else:
            out[k] = statistics.median(values) if values else None
    return out


def bench_turns(names: list[str], ckpts: dict, args, work: Path) -> dict:
    """All servers up at once, then `--rounds` rounds in which each model runs every prompt length in turn.

    This machine changes speed from minute to minute, so models measured one
    after another (`bench_model`) differ by 0.15-0.3 in ratio between runs;
    here the runs a ratio compares are at most a few minutes apart, and the
    order rotates each round. Each run records `rounds` (one summary per round)
    and `bench`, their median; `turns` in the result holds the per-round ratios.
    """
    records, servers, logs, t0 = {}, {}, {}, time.monotonic()
    with contextlib.ExitStack() as stack:
        for name in names:  # started one after another: each compiles its model on every core
            record, cmd, logs[name] = new_record(name, ckpts[name], args, work)
            records[name] = record
            server = start_server(stack, name, cmd, logs[name], args, record)
            if server:
                servers[name] = server
        live = list(servers)
        for n in args.prompt_lens:
            before = {}
            for name in live:
                _, root = servers[name]
                run = records[name]["runs"][str(n)] = {"input_len": n, "rounds": []}
                before[name] = parse_metrics(http_get(f"{root}/metrics"))
                bcmd, warm, _ = bench_commands(name, ckpts[name], root, n, args, work, tag="_r0")
                run["bench_command"] = shlex.join(bcmd)
                for w in warm:  # every prompt cached before any timed round (prefix caching)
                    subprocess.run(w, capture_output=True, text=True, timeout=args.bench_timeout)
            for r in range(args.rounds if live else 0):
                for name in live[r % len(live):] + live[:r % len(live)]:
                    proc, root = servers[name]
                    run = records[name]["runs"][str(n)]
                    bcmd, _, result_file = bench_commands(name, ckpts[name], root, n, args, work, tag=f"_r{r}")
                    _announce(name, n, args, f", round {r + 1} of {args.rounds}")
                    one = {"round": r}
                    if not bench_once(name, proc, n, bcmd, result_file, args, logs[name], one, records[name]):
                        live.remove(name)
                    run["rounds"].append(one)
            for name in before:  # the servers this length started on
                proc, root = servers[name]
                run = records[name]["runs"][str(n)]
                benches = [one["bench"] for one in run["rounds"] if "bench" in one]
                if benches:
                    run["bench"] = median_bench(benches)
                    if proc.poll() is None:
                        run["pages"] = pages_per_query(before[name], parse_metrics(http_get(f"{root}/metrics")))
    for name, record in records.items():
        finish_record(name, record, logs[name], args)
        record["total_s"] = time.monotonic() - t0
    return records


def turn_ratios(records: dict, lens: list[int]) -> dict:
    """Per prompt length and model: each round's TTFT and TPOT (mean) over dense's in the same round."""
    out = {}
    dense = records.get("dense", {}).get("runs", {})
    for n in lens:
        base = {one["round"]: one["bench"] for one in dense.get(str(n), {}).get("rounds", []) if "bench" in one}
        for m, rec in records.items():
            if m == "dense":
                continue
            rounds = [one for one in rec["runs"].get(str(n), {}).get("rounds", []) if "bench" in one]
            pairs = [(one["bench"], base[one["round"]]) for one in rounds if one["round"] in base]
            out.setdefault(str(n), {})[m] = {
                key: [b[key] / d[key] for b, d in pairs if b.get(key) and d.get(key)]
                for key in ("mean_ttft_ms", "mean_tpot_ms")}
    return out


# ---------------------------------------------------------------- report

def _fmt(x, digits=0):
    if x is None:
        return "—"
    if isinstance(x, float) and math.isnan(x):
        return "—"
    return f"{x:,.{digits}f}"


def _ratio(a, b, digits=2):
    return f"{a / b:.{digits}f}×" if a is not None and b else "—"


def _at(mapping: dict, n):
    """mapping[n] whether the key is an int (fresh result) or a string (loaded from JSON)."""
    if mapping is None:
        return None
    return mapping.get(n, mapping.get(str(n)))


def _run(result: dict, model: str, n: int) -> dict:
    return _at(result["models"].get(model, {}).get("runs", {}), n) or {}


def _metric(result: dict, model: str, n: int, key: str):
    return (_run(result, model, n).get("bench") or {}).get(key)


def _label(model: str) -> str:
    return SERVERS[model]["label"]


def _loadavg_note(machine: dict) -> str:
    start, end = machine.get("loadavg_1_5_15_at_start"), machine.get("loadavg_1_5_15_at_end")
    if start is None:
        return ""
    fmt = "/".join
    return (f" (load average 1/5/15 min: {fmt(f'{x:.1f}' for x in start)} at start, "
            f"{fmt(f'{x:.1f}' for x in end) if end else '?'} at end)")


def _model_settings(result: dict, model: str) -> dict:
    rec = result["models"].get(model, {})
    return rec.get("settings") or {}


def _settings_words(st: dict) -> str:
    return (f"{st.get('num_prompts', '?')} prompts × {st.get('output_len', '?')} output tokens, concurrency "
            f"{st.get('concurrency', '?')}, prefix caching {'on' if st.get('prefix_caching') else 'off'}, "
            + (f"{st['warm_runs']} untimed run(s) of the same prompts first (every prompt cached: TPOT is the "
               "concurrent decode alone, TTFT a cache hit), " if st.get("warm_runs") else "")
            + f"`--max-model-len {st.get('max_model_len', '?')}`")


TIMING_ROWS = [("TTFT mean (ms)", "mean_ttft_ms", 0), ("TTFT median (ms)", "median_ttft_ms", 0),
               ("TTFT p99 (ms)", "p99_ttft_ms", 0), ("TPOT mean (ms)", "mean_tpot_ms", 1),
               ("TPOT median (ms)", "median_tpot_ms", 1), ("output tok/s", "output_throughput", 2),
               ("total tok/s", "total_token_throughput", 1)]


def _timing_table(result: dict, lens: list[int]) -> list[str]:
    heads = " | ".join(_label(m) for m in MODELS)
    lines = [f"| prompt | metric | {heads} | HySparse/dense | HySparse2 on/HySparse | HySparse2 on/off |",
             "| ---: | --- | " + " | ".join("---:" for _ in MODELS) + " | ---: | ---: | ---: |"]
    for n in lens:
        for label, key, digits in TIMING_ROWS:
            v = {m: _metric(result, m, n, key) for m in MODELS}
            cells = " | ".join(_fmt(v[m], digits) for m in MODELS)
            lines.append(f"| {n} | {label} | {cells} | {_ratio(v['hysparse'], v['dense'])} | "
                         f"{_ratio(v['hysparse2'], v['hysparse'])} | {_ratio(v['hysparse2'], v['hysparse2-noexit'])} |")
    return lines


def _turns_table(result: dict, lens: list[int]) -> list[str]:
    lines = ["| prompt | model | rounds | TTFT / dense | TPOT / dense |", "| ---: | --- | ---: | ---: | ---: |"]
    for n in lens:
        for m, ratios in (_at(result["turns"], n) or {}).items():
            cells = []
            for key in ("mean_ttft_ms", "mean_tpot_ms"):
                q1, med, q3 = (percentile(ratios[key], q) for q in (25, 50, 75))
                cells.append("—" if med is None else f"{med:.2f}× ({q1:.2f}–{q3:.2f})")
            lines.append(f"| {n} | {_label(m)} | {len(ratios['mean_tpot_ms'])} | {cells[0]} | {cells[1]} |")
    return lines


def _pages_table(result: dict, lens: list[int]) -> list[str]:
    sparse = [m for m in MODELS if m != "dense"]
    lines = ["| prompt | " + " | ".join(f"{_label(m)}: selection | {_label(m)}: dense query | {_label(m)}: "
                                       "queries" for m in sparse) + " |",
             "| ---: | " + " | ".join("---: | ---: | ---:" for _ in sparse) + " |"]
    for n in lens:
        cells = []
        for m in sparse:
            pages = _run(result, m, n).get("pages") or {}
            p, dp = pages.get("pages_per_query"), pages.get("dense_pages_per_query")
            cells.append(f"{_fmt(p, 1)} ({_ratio(p, dp)} of dense) | {_fmt(dp, 1)} | {_fmt(pages.get('queries'))}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _flops_table(result: dict, lens: list[int]) -> list[str]:
    lines = ["| prompt | config | prefill GFLOPs (model) | GFLOPs our CPU path executes (approx.) | "
             "FLOPs HySparse/this | TTFT mean (ms) | TTFT HySparse/this | TTFT ratio ÷ FLOPs ratio | "
             "÷ CPU-path FLOPs ratio | FLOPs dense/this | TTFT dense/this | TTFT ratio ÷ FLOPs ratio |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in lens:
        row = _at(result["flops"]["lens"], n)
        ttft = {m: _metric(result, m, n, "mean_ttft_ms") for m in MODELS}
        for m in MODELS:
            f, fc = row[m]["model"], row[m]["cpu"]
            fr_h, fr_d = row["hysparse"]["model"] / f, row["dense"]["model"] / f
            fr_hc = row["hysparse"]["cpu"] / fc
            tr_h = ttft["hysparse"] / ttft[m] if ttft["hysparse"] and ttft[m] else None
            tr_d = ttft["dense"] / ttft[m] if ttft["dense"] and ttft[m] else None
            lines.append(
                f"| {n} | {_label(m)} | {f / 1e9:,.1f} | {fc / 1e9:,.1f} | {fr_h:.2f}× | {_fmt(ttft[m])} | "
                f"{_fmt(tr_h, 2)}{'×' if tr_h else ''} | {_fmt(tr_h and tr_h / fr_h, 2)} | "
                f"{_fmt(tr_h and tr_h / fr_hc, 2)} | {fr_d:.2f}× | {_fmt(tr_d, 2)}{'×' if tr_d else ''} | "
                f"{_fmt(tr_d and tr_d / fr_d, 2)} |")
    return lines


def _flops_parts_table(result: dict, lens: list[int]) -> list[str]:
    lines = ["| prompt | config | projections | MLP | attention | lm_head (1 row) |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for n in lens:
        row = _at(result["flops"]["lens"], n)
        for m in MODELS:
            parts = row[m]["model_parts"]
            lines.append(f"| {n} | {_label(m)} | " + " | ".join(
                f"{parts[k] / 1e9:,.2f}" for k in ("projections", "mlp", "attention", "lm_head")) + " |")
    return lines


def _paper_table(result: dict) -> list[str]:
    p = result["flops"]["paper"]
    lines = [f"| HySparse 80B counted with | HySparse PFLOPs | HySparse2 80B PFLOPs (early exit) | "
             f"HySparse / HySparse2 (early exit) | HySparse / HySparse2 (no exit: {p['hysparse2_noexit'] / 1e15:,.1f} "
             f"PFLOPs) | paper (Fig. 4) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in p["rows"].items():
        lines.append(f"| {label} | {r['hysparse'] / 1e15:,.1f} | {p['hysparse2'] / 1e15:,.1f} | "
                     f"**{r['ratio_exit']:.2f}×** | {r['ratio_noexit']:.2f}× | {p['paper_anchor']}× |")
    return lines


def _kv_table(result: dict) -> list[str]:
    lines = ["| | " + " | ".join(_label(m) for m in MODELS) + " |",
             "| --- | " + " | ".join("---:" for _ in MODELS) + " |"]
    kv = {m: result["models"].get(m, {}).get("kv", {}) for m in MODELS}
    dense_cfg = result["expected"]["dense_bytes_per_token_small"]

    def ours(m, key):
        return (kv[m].get("ours") or {}).get(key)

    def vllm(m, key):
        return (kv[m].get("vllm") or {}).get(key)

    bpt = {m: ours(m, "bytes_per_token") for m in MODELS}
    bpt["dense"] = dense_cfg
    lines.append("| KV bytes/token, full-length caches (dense: from config) | " +
                 " | ".join(_fmt(bpt[m]) for m in MODELS) + " |")
    lines.append("| dense / this | " + " | ".join(_ratio(dense_cfg, bpt[m]) for m in MODELS) + " |")
    lines.append("| KV bytes/token implied by vLLM's token count (KV memory / tokens) | " +
                 " | ".join(_fmt(vllm(m, "implied_bytes_per_token")) for m in MODELS) + " |")
    fit = {m: ours(m, "tokens_fit") for m in MODELS}
    fit["dense"] = vllm("dense", "tokens_fit")
    src = {m: ours(m, "tokens_fit_source") or "—" for m in MODELS}
    lines.append("| tokens that fit, ours (server log; dense: vLLM) | " + " | ".join(
        f"{_fmt(fit[m])}" + (f" ({src[m]})" if m != "dense" and src[m] not in ("server log", "—") else "")
        for m in MODELS) + " |")
    lines.append("| tokens that fit, this / dense | " + " | ".join(_ratio(fit[m], fit["dense"]) for m in MODELS) + " |")
    lines.append("| tokens that fit, vLLM's 'KV cache size' | " +
                 " | ".join(_fmt(vllm(m, "tokens_fit")) for m in MODELS) + " |")
    lines.append("| vLLM's count, this / dense | " +
                 " | ".join(_ratio(vllm(m, "tokens_fit"), vllm("dense", "tokens_fit")) for m in MODELS) + " |")
    return lines


EXPECTED_ROWS = (("hysparse_small", "HySparse `small` [F,S,S,S]×3 vs dense Llama `small`"),
                 ("hysparse2_small", "HySparse2 `small` [W,W,F,W,W,W]+[F,S,S,F,S,S] vs dense Llama `small`"),
                 ("hysparse_paper", "HySparse paper 49 layers, 5 full, vs dense of its shape"),
                 ("hysparse2_paper", "HySparse2 paper 49 layers, 1+4 full (MQA, D 256), vs dense of its shape"))


def _expected_table(result: dict) -> list[str]:
    ctx = result["expected"]["context_lens"]
    lines = ["| layout | dense / full-length caches (upper bound) | " +
             " | ".join(f"at {n} tokens" for n in ctx) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in ctx) + " |"]
    for key, label in EXPECTED_ROWS:
        e = result["expected"].get(key)
        if not e:
            continue
        cells = [f"{_at(e['by_context_len'], n)['ratio_dense_over_hysparse']:.2f}×" for n in ctx]
        lines.append(f"| {label} | {e['upper_bound_layers_over_full']:.2f}× | " + " | ".join(cells) + " |")
    return lines


def markdown_report(result: dict) -> str:
    """Timing, pages, FLOPs and KV tables for the four configurations, with the notes."""
    lens = result["settings"]["prompt_lens"]
    s = result["settings"]
    ran = [m for m in MODELS if m in result["models"] and not result["models"][m].get("reused_from")]
    reused = [m for m in MODELS if result["models"].get(m, {}).get("reused_from")]
    lines = [f"# Serving on CPU: HySparse2 `small` vs HySparse `small` vs dense Llama ({result['date']})", "",
             f"{_settings_words(bench_settings_from(s, lens))}, `VLLM_CPU_KVCACHE_SPACE={s['kv_space_gib']}` for "
             f"every server, float32; {result['machine']['cpu_count']} CPU cores ({result['machine']['cpu']}). "
             f"HySparse2 exit on / off: the same checkpoint, served without / with `{EARLY_EXIT_ENV}=0`. "
             f"Measured in this run: {', '.join(_label(m) for m in ran) or 'none'}."]
    for m in reused:
        lines.append(f"Reused from `{result['models'][m]['reused_from']}`: {_label(m)} "
                     f"({_settings_words(_model_settings(result, m))}).")
    lines += ["", "## Timing", ""] + _timing_table(result, lens)
    if result.get("turns"):
        lines += ["", "## Taking turns: ratios to dense in the same round", "",
                  f"All servers up at once; {s['rounds']} rounds, in each every model runs the prompt set once, "
                  "the order rotated each round. The timing table above holds each model's median run; here each "
                  "round's mean TTFT and TPOT are divided by dense's of the same round: median (quartiles) of "
                  "those ratios.", ""] + _turns_table(result, lens)
    lines += ["", "## Prefill FLOPs (computed) next to measured TTFT", "",
              "Ratios are speed-ups: `X/this` > 1 means this configuration needs fewer FLOPs / less time than X. "
              "`TTFT ratio ÷ FLOPs ratio` = 1 when the measured time follows the model FLOPs; < 1 when the "
              "implementation gives back part of the FLOPs saving. The CPU-path column counts what our "
              "implementation executes (see notes).", ""] + _flops_table(result, lens)
    lines += ["", "Model FLOPs by part (GFLOPs):", ""] + _flops_parts_table(result, lens)
    lines += ["", f"## Paper layouts at {result['flops']['paper']['n']:,} tokens (computed)", "",
              "Attention + projections (q/k/v/o, gates, bridges); the MoE FFN and lm_head are not modelled, "
              "so these are not the paper's whole-model FLOPs.", ""] + _paper_table(result)
    lines += ["", "## KV pages per query", "",
              "`selection`: distinct KV pages (vLLM blocks) a sparse query's selection touches; `dense query`: "
              "pages full attention over the same context touches; `queries`: queries counted over the run.", ""]
    lines += _pages_table(result, lens)
    lines += ["", "## KV cache (same KV memory for all)", ""] + _kv_table(result)
    lines += ["", "## Expected KV bytes/token ratio (from configs, not measured)", ""] + _expected_table(result)
    hs = result["expected"]["hysparse_small"]
    hs2 = result["expected"].get("hysparse2_small") or {}
    lines += ["", "Notes:", "", f"- {NOTE_IMPL}", f"- {NOTE_PREFIX}", f"- {NOTE_VLLM_KV}",
              "- Prefill FLOPs (model): 2·m·k·n per matmul; projections, SwiGLU MLP, attention scores + values "
              "counted causally (query t sees t+1 keys; windows min(t+1, 128)); HySparse's oracle scores are the "
              "full layer's own scores; a HySparse sparse layer's global branch is counted over min(t+1, topk·B = "
              f"{(hs['topk_blocks'] or 0) * (hs['block_size'] or 0):,}) keys, an upper bound (the query's own "
              "partial block holds fewer keys); HySparse2 cross full layers score every causal key, cross sparse "
              f"layers see min(t+1, k_g + w = {(hs2.get('topk_tokens') or 0) + (hs2.get('recent_window') or 0):,}) "
              "keys; with early exit the cross-decoder runs on the last prompt token only (bridges still project "
              "K/V for every token); lm_head on one row for every configuration. Top-k, softmax, norms, masks "
              "are not counted. Formula and code: `vllm_hysparse/tools/prefill_flops.py`, `benchmarks/README.md`.",
              "- CPU-path FLOPs: what our C++ CPU kernels execute, the model's count plus the token oracle's "
              "second scoring of every visible key of a HySparse2 cross full layer's prefill rows (early exit "
              "off, chunks of 2,048 whose last row sees more than 4,096 keys; `prefill_flops.py`); keys a kernel "
              "masks inside a key tile are not counted, nor the top-k selections, whose time no FLOPs count shows.",
              "- The expected ratio is `dense bytes / full-length-cache bytes` less the sliding-window share: each "
              "window cache holds at most `swa_window` tokens per sequence, which per token is "
              "`swa_window / context` of a full-length cache.",
              "- Random weights; `--ignore-eos` so every request generates exactly the requested tokens.",
              "- KV pages per query: delta of `vllm:hysparse_pages_touched_total` / "
              "`vllm:hysparse_sparse_queries_total` over the run; the dense column is "
              "`vllm:hysparse_dense_pages_total` / queries. HySparse counts every prompt and decode query at its "
              f"oracle layers (top {hs['topk_blocks']} blocks of {hs['block_size']} tokens: up to "
              f"{(hs['topk_blocks'] or 0) * (hs['block_size'] or 0):,} tokens of context it selects every block). "
              "HySparse2 counts the queries its cross full layers select tokens for: with early exit only the last "
              "prompt token and the decode tokens, without it every prompt token too.",
              "- The CPU is shared with other work, so timings are noisy" + _loadavg_note(result["machine"]) + "."]
    errors = [f"{m}: {e}" for m, rec in result["models"].items() for e in rec.get("errors", [])]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


COLORS = {"dense": "tab:blue", "hysparse": "tab:orange", "hysparse2": "tab:green", "hysparse2-noexit": "tab:red"}


def plot_report(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = result["settings"]["prompt_lens"]
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))

    def line_panel(ax, values, title, ylabel, log=False):
        for model in MODELS:
            pts = [(n, values(model, n)) for n in lens]
            pts = [(n, y) for n, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", color=COLORS[model], label=_label(model))
        ax.set(title=title, xlabel="prompt length (tokens)", ylabel=ylabel)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    line_panel(axes[0, 0], lambda m, n: _metric(result, m, n, "mean_ttft_ms"), "TTFT (mean)", "ms")
    line_panel(axes[0, 1], lambda m, n: _metric(result, m, n, "mean_tpot_ms"), "TPOT (mean)", "ms")
    line_panel(axes[0, 2], lambda m, n: _at(result["flops"]["lens"], n)[m]["model"] / 1e9,
               "Prefill FLOPs, computed (model)", "GFLOPs")

    def ms_per_gflop(m, n):
        t = _metric(result, m, n, "mean_ttft_ms")
        return t / (_at(result["flops"]["lens"], n)[m]["model"] / 1e9) if t else None

    line_panel(axes[0, 3], ms_per_gflop, "TTFT per model GFLOP (implementation cost)", "ms / GFLOP", log=True)

    kv = {m: result["models"].get(m, {}).get("kv", {}) for m in MODELS}
    names = [_label(m).replace(" exit", "\nexit") for m in MODELS]
    ax = axes[1, 0]
    bpt = [(kv[m].get("ours") or {}).get("bytes_per_token") or 0 for m in MODELS]
    bpt[0] = result["expected"]["dense_bytes_per_token_small"]
    ax.bar(names, bpt, color=[COLORS[m] for m in MODELS])
    ax.set(title="KV bytes/token, full-length caches (float32)", ylabel="bytes")

    ax = axes[1, 1]
    ours = [(kv[m].get("ours") or {}).get("tokens_fit") or 0 for m in MODELS]
    ours[0] = (kv["dense"].get("vllm") or {}).get("tokens_fit") or 0
    theirs = [(kv[m].get("vllm") or {}).get("tokens_fit") or 0 for m in MODELS]
    x = range(len(MODELS))
    ax.bar([i - 0.2 for i in x], ours, 0.4, color=[COLORS[m] for m in MODELS], label="ours (server log)")
    ax.bar([i + 0.2 for i in x], theirs, 0.4, color=[COLORS[m] for m in MODELS], alpha=0.4,
           label="vLLM's 'KV cache size'")
    ax.set_xticks(list(x), names)
    ax.set(title=f"Tokens that fit in {result['settings']['kv_space_gib']} GiB KV", ylabel="tokens")
    ax.legend(fontsize=8)

    ax = axes[1, 2]
    for m in MODELS[1:]:
        pts = [(n, _run(result, m, n).get("pages") or {}) for n in lens]
        pts = [(n, p) for n, p in pts if p.get("pages_per_query") is not None]
        if pts:
            ax.plot([n for n, _ in pts], [p["pages_per_query"] for _, p in pts], "o-", color=COLORS[m],
                    label=f"{_label(m)}: selection")
            ax.plot([n for n, _ in pts], [p["dense_pages_per_query"] for _, p in pts], "o:", color=COLORS[m],
                    alpha=0.5, label=f"{_label(m)}: dense query")
    ax.legend(fontsize=7)
    ax.set(title="KV pages per query", xlabel="prompt length (tokens)", ylabel="pages")
    ax.grid(alpha=0.3)

    ax = axes[1, 3]
    for m in MODELS:
        pts = []
        for n in lens:
            row, t_h, t = _at(result["flops"]["lens"], n), _metric(result, "hysparse", n, "mean_ttft_ms"), \
                _metric(result, m, n, "mean_ttft_ms")
            if t_h and t:
                pts.append((n, (t_h / t) / (row["hysparse"]["model"] / row[m]["model"])))
        if pts:
            ax.plot(*zip(*pts), "o-", color=COLORS[m], label=_label(m))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(title="TTFT ratio ÷ FLOPs ratio (vs HySparse)", xlabel="prompt length (tokens)", ylabel="")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    fig.suptitle(f"vllm serve on CPU, {result['date']} — CPU timings compare implementations (HySparse / HySparse2 "
                 "PyTorch attention path vs vLLM C++ attention), not architectures; shared, loaded machine",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- main

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="prompt lengths 256, 1024")
    parser.add_argument("--prompt-lens", type=int, nargs="+", help="default 512 2048 4096 (--quick: 256 1024)")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE for every server")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="serve with vLLM's prefix caching on (default off: every TTFT is a full prefill)")
    parser.add_argument("--prefix-fraction", type=float, default=0.0,
                        help="share this fraction of each prompt as one common prefix (decode-heavy workload: "
                             "--prefix-caching --prefix-fraction 0.95 --concurrency 8 --output-len 128)")
    parser.add_argument("--warm-runs", type=int, default=0,
                        help="run each prompt set this many times untimed first: with --prefix-caching the timed run "
                             "finds every prompt cached, so TPOT is the concurrent decode alone, free of which "
                             "requests vLLM's scheduler admitted before the shared prefix was cached")
    parser.add_argument("--rounds", type=int, default=1,
                        help="> 1: start every server first, then run each prompt length this many times, the models "
                             "taking turns (order rotated each round); reports the median run and the per-round "
                             "ratios to dense (their median and quartiles)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="server configurations to run, in this order (default: all)")
    parser.add_argument("--reuse", type=Path, metavar="JSON",
                        help="take the models not in --models from this earlier result JSON (marked as reused)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to become healthy")
    parser.add_argument("--bench-timeout", type=float, default=900, help="seconds for one `vllm bench serve` run")
    parser.add_argument("--checkpoints", type=Path, default=CHECKPOINT_DIR)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--report-from", type=Path, metavar="JSON",
                        help="only redraw the .md and .png of an earlier run's JSON (this version's format); "
                             "runs nothing")
    args = parser.parse_args(argv)
    if args.prompt_lens is None:
        args.prompt_lens = [256, 1024] if args.quick else [512, 2048, 4096]
    args.models = list(dict.fromkeys(args.models))  # run in the order given, each once
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.rounds > 1 and "dense" not in args.models:
        parser.error("--rounds compares each model with dense in the same round: include dense in --models")
    return args


def bench_settings_from(settings: dict, lens: list[int]) -> dict:
    return {"num_prompts": settings["num_prompts"], "output_len": settings["output_len"],
            "concurrency": settings["concurrency"], "kv_space_gib": settings["kv_space_gib"],
            # (a run recorded before the flag had it off)
            "prefix_caching": settings.get("prefix_caching", False), "warm_runs": settings.get("warm_runs", 0),
            "max_model_len": max_model_len_for(lens, settings["output_len"])}


def reused_records(path: Path, wanted: list[str]) -> dict:
    """Model records from an earlier result JSON, with the settings they were measured under."""
    old = json.loads(path.read_text())
    out = {}
    for m in wanted:
        rec = old.get("models", {}).get(m)
        if rec is None:
            continue
        rec = dict(rec)
        if "settings" not in rec:  # a JSON from before per-model settings: the run's, and vLLM's prefix caching
            st = old["settings"]
            rec["settings"] = {**bench_settings_from(st, st["prompt_lens"]),
                               "prefix_caching": "--no-enable-prefix-caching" not in rec.get("serve_command", "")}
        rec["reused_from"] = str(path)
        rec["reused_date"] = old.get("date")
        out[m] = rec
    return out


def load_result(path: Path) -> dict:
    result = json.loads(path.read_text())
    if "flops" not in result:
        raise SystemExit(f"{path}: written by an earlier version of this script (no FLOPs, two models); "
                         "its .md and .png are already next to it")
    return result


def write_reports(result: dict, stem: Path) -> str:
    """The Markdown tables (returned) and the plot, next to the JSON at `stem`."""
    report = markdown_report(result)
    stem.with_suffix(".md").write_text(report)
    plot_report(result, stem.with_suffix(".png"))
    return report


def result_stem(results: Path, start: datetime.datetime, quick: bool) -> str:
    """`serve_cpu_<date>[_quick]`, with `_HHMM` added when that name is taken (earlier results stay)."""
    stem = f"serve_cpu_{start:%Y-%m-%d}" + ("_quick" if quick else "")
    if (results / f"{stem}.json").exists():
        stem += f"_{start:%H%M}"
    return stem


def expectations(ckpts: dict, context_lens: list[int]) -> dict:
    from vllm_hysparse.configs import HySparse2Config, HySparseConfig

    small = HySparseConfig.from_pretrained(ckpts["hysparse"])
    small2 = HySparse2Config.from_pretrained(ckpts["hysparse2"])
    dense_small = 2 * small.num_key_value_heads * small.head_dim * 4 * small.num_hidden_layers
    return {"context_lens": context_lens, "dense_bytes_per_token_small": dense_small,
            "hysparse_small": expected_kv_ratios(small, context_lens, 4, dense_small),
            "hysparse2_small": expected_kv_ratios(small2, context_lens, 4, dense_small),
            "hysparse_paper": expected_kv_ratios(paper_config("hysparse"), context_lens, 2),
            "hysparse2_paper": expected_kv_ratios(paper_config("hysparse2"), context_lens, 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from:  # redraw the table and plot of an earlier run
        print(write_reports(load_result(args.report_from), args.report_from.with_suffix("")))
        return 0
    start = datetime.datetime.now()
    args.results.mkdir(parents=True, exist_ok=True)
    stem = result_stem(args.results, start, args.quick)
    work = args.results / "tmp" / stem
    work.mkdir(parents=True, exist_ok=True)
    ckpts = {"hysparse": ensure_hysparse_checkpoint(args.checkpoints / SERVERS["hysparse"]["checkpoint"])}
    ckpts["dense"] = ensure_dense_checkpoint(args.checkpoints / SERVERS["dense"]["checkpoint"], ckpts["hysparse"],
                                             args.seed)
    ckpts["hysparse2"] = ensure_hysparse_checkpoint(args.checkpoints / SERVERS["hysparse2"]["checkpoint"], "hysparse2")
    ckpts["hysparse2-noexit"] = ckpts["hysparse2"]
    max_len = max_model_len_for(args.prompt_lens, args.output_len)
    for name in args.models:  # vLLM refuses a longer --max-model-len at start: say so once, before any server
        limit = json.loads((ckpts[name] / "config.json").read_text()).get("max_position_embeddings")
        if limit is not None and max_len > limit:
            print(f"serve_bench: prompts of {max(args.prompt_lens)} tokens plus {args.output_len} output need "
                  f"--max-model-len {max_len}, past the {limit} positions of {ckpts[name]}", file=sys.stderr)
            return 2

    context_lens = sorted(set(args.prompt_lens) | {32768})
    result = {"date": f"{start:%Y-%m-%d %H:%M}", "command": shlex.join([sys.executable, *sys.argv]),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": machine_info(), "expected": expectations(ckpts, context_lens),
              "flops": {"lens": flops_table(args.prompt_lens), "paper": paper_ratio()},
              "notes": [NOTE_IMPL, NOTE_PREFIX, NOTE_VLLM_KV], "models": {}}
    if args.reuse:
        result["models"].update(reused_records(args.reuse, [m for m in MODELS if m not in args.models]))
    if args.rounds > 1:  # every server up, the models taking turns
        measured = bench_turns(args.models, ckpts, args, work)
        result["models"].update(measured)
        result["turns"] = turn_ratios(measured, args.prompt_lens)  # not the --reuse records: they have no rounds
    else:
        for name in args.models:  # one server at a time
            result["models"][name] = bench_model(name, ckpts[name], args, work)
    result["models"] = {m: result["models"][m] for m in MODELS if m in result["models"]}
    result["wall_s"] = (datetime.datetime.now() - start).total_seconds()
    result["machine"]["loadavg_1_5_15_at_end"] = os.getloadavg()

    json_path = args.results / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(write_reports(result, json_path.with_suffix("")))
    print(f"wrote {json_path} (.md, .png) in {result['wall_s'] / 60:.1f} min")
    return 1 if any(rec["errors"] for m, rec in result["models"].items() if m in args.models) else 0


if __name__ == "__main__":
    sys.exit(main())
