# SPDX-License-Identifier: Apache-2.0
"""Serving benchmark on CPU: HySparse `small` vs a dense Llama of the same shape, through `vllm serve`.

    python benchmarks/serve_bench.py            # prompt lengths 512, 2048, 4096 (~25 min on 2 cores)
    python benchmarks/serve_bench.py --quick    # prompt lengths 256, 1024 (~8 min)

For each model it starts `vllm serve` with the same KV memory, drives it with
`vllm bench serve` (random dataset, one run per prompt length), reads TTFT,
TPOT and throughput from the saved JSON, HySparse's pages per query from the
`vllm:hysparse_*` counters on /metrics (delta over each run) and the KV lines
from the server log. It writes `benchmarks/results/serve_cpu_<date>[_quick].{json,md,png}`
and prints the Markdown table. Checkpoints are created once under
`benchmarks/checkpoints/` (random weights, nothing downloaded).
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
CHECKPOINT_DIR = BENCH_DIR / "checkpoints"
RESULTS_DIR = BENCH_DIR / "results"
MODELS = ("hysparse", "dense")
VLLM = Path(sys.executable).parent / "vllm"
NOTE_IMPL = ("CPU timings compare implementations, not architectures: HySparse attention runs as a "
             "PyTorch path (no C++ kernel) while dense Llama uses vLLM's C++ CPU attention.")
NOTE_VLLM_KV = ("vLLM's 'KV cache size' counts every cache group of a hybrid model as full-length, so for "
                "HySparse it understates the tokens that fit; 'ours' is the HySparse log line (full-length "
                "caches only; window caches are bounded per sequence). vLLM's count also grows with --max-model-len "
                "(the window groups' share shrinks), so compare runs at the same --max-model-len.")


# ---------------------------------------------------------------- checkpoints

def ensure_hysparse_checkpoint(path: Path) -> Path:
    """The `small` HySparse checkpoint at `path`, written once."""
    from vllm_hysparse.tools.make_checkpoint import write_checkpoint

    if not (path / "config.json").exists():
        write_checkpoint(path, "hysparse", "small", force=True)
    return path


def dense_llama_config(hysparse_config, tokenizer):
    """A LlamaConfig with the HySparse model's dimensions, every layer full attention."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=hysparse_config.vocab_size, hidden_size=hysparse_config.hidden_size,
        intermediate_size=hysparse_config.intermediate_size, num_hidden_layers=hysparse_config.num_hidden_layers,
        num_attention_heads=hysparse_config.num_attention_heads,
        num_key_value_heads=hysparse_config.num_key_value_heads, head_dim=hysparse_config.head_dim,
        max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=hysparse_config.rms_norm_eps,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")


def ensure_dense_checkpoint(path: Path, hysparse_path: Path, seed: int = 0) -> Path:
    """A randomly initialised float32 Llama with the same dimensions and tokenizer, written once."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from vllm_hysparse.configs import HySparseConfig
    from vllm_hysparse.tools.presets import TOKENIZER_VOCAB
    from vllm_hysparse.tools.tokenizer import build_hf_tokenizer

    tokenizer = build_hf_tokenizer(TOKENIZER_VOCAB)
    config = dense_llama_config(HySparseConfig.from_pretrained(hysparse_path), tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:  # written aside and moved into place, so an interrupted run leaves no half checkpoint
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


# ---------------------------------------------------------------- expectations (from configs, not measured)

def expected_kv_ratios(config, context_lens: list[int], dtype_bytes: int) -> dict:
    """Dense / HySparse KV bytes per token at each context length (layers / full layers, less the SWA share)."""
    from vllm_hysparse.configs.base import kv_bytes_per_token

    rows = {}
    for n in context_lens:
        kv = kv_bytes_per_token(config, dtype_bytes=dtype_bytes, context_len=n)
        rows[n] = {"hysparse_bytes_per_token": kv["bytes_per_token"],
                   "dense_bytes_per_token": kv["dense_bytes_per_token"],
                   "ratio_dense_over_hysparse": kv["dense_bytes_per_token"] / kv["bytes_per_token"]}
    full, windowed = config.kv_cache_layers()
    return {"layers": config.num_hidden_layers, "full_length_caches": full, "window_caches": windowed,
            "swa_window": config.swa_window, "block_size": config.sparse_block_size,
            "topk_blocks": config.sparse_topk_blocks, "upper_bound_layers_over_full": config.num_hidden_layers / full,
            "by_context_len": rows}


def paper_config():
    from vllm_hysparse.configs import HySparseConfig
    from vllm_hysparse.tools.make_checkpoint import write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        return HySparseConfig.from_pretrained(write_checkpoint(Path(tmp) / "paper", "hysparse", "paper"))


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


def parse_metrics(text: str) -> dict[str, float]:
    """`vllm:hysparse_*` samples from a Prometheus text page."""
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:hysparse_"):
            name, _, value = line.partition(" ")
            values[name.split("{")[0]] = float(value.split()[0])
    return values


def pages_per_query(before: dict[str, float], after: dict[str, float]) -> dict:
    """Pages a sparse query touched and pages a dense query would touch, over one run (counter deltas)."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("vllm:hysparse_sparse_queries_total")
    pages, dense = delta("vllm:hysparse_pages_touched_total"), delta("vllm:hysparse_dense_pages_total")
    if queries <= 0:
        return {"queries": queries, "pages_per_query": None, "dense_pages_per_query": None}
    return {"queries": queries, "pages_per_query": pages / queries, "dense_pages_per_query": dense / queries}


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(ckpt: Path, port: int, max_model_len: int) -> list[str]:
    return [str(VLLM), "serve", str(ckpt), "--dtype", "float32", "--port", str(port),
            "--max-model-len", str(max_model_len)]


def serve_env(kv_space_gib: int) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def bench_command(ckpt: Path, root_url: str, input_len: int, output_len: int, num_prompts: int,
                  concurrency: int, result_dir: Path, result_filename: str, seed: int) -> list[str]:
    return [str(VLLM), "bench", "serve", "--backend", "vllm", "--model", str(ckpt), "--base-url", root_url,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_filename]


def max_model_len_for(prompt_lens: list[int], output_len: int) -> int:
    """Room for the longest prompt plus its output (random prompts can re-tokenize a little longer)."""
    return 1024 * math.ceil((max(prompt_lens) + output_len + 64) / 1024)


def http_get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_healthy(root_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before becoming healthy")
        try:
            if http_get(f"{root_url}/health", timeout=5) is not None:
                return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vllm serve at {root_url} not healthy within {timeout_s:.0f} s")


def warm_up(root_url: str, model: str, timeout_s: float) -> None:
    """One short request so the first measured run does not pay for first-call setup."""
    body = json.dumps({"model": model, "prompt": "def f(x):\n    return", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{root_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


@contextlib.contextmanager
def running_server(cmd: list[str], env: dict, log_path: Path, start_timeout_s: float, stop_timeout_s: float = 60):
    """Start `vllm serve` in its own process group, yield (process, root url), always stop it."""
    port = cmd[cmd.index("--port") + 1]
    root_url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(root_url, proc, start_timeout_s)
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


def log_tail(path: Path, lines: int = 40) -> str:
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


# ---------------------------------------------------------------- one model

def bench_model(name: str, ckpt: Path, args, work: Path) -> dict:
    """Serve `ckpt`, run every prompt length, collect timings, pages per query and KV lines."""
    max_len = max_model_len_for(args.prompt_lens, args.output_len)
    cmd = serve_command(ckpt, free_port(), max_len)
    log_path = work / f"serve_{name}.log"
    record = {"checkpoint": str(ckpt), "params": param_count(ckpt), "serve_command": shlex.join(cmd), "serve_log": str(log_path),
              "env": {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
              "runs": {}, "errors": []}
    print(f"[{name}] {shlex.join(cmd)}  (log: {log_path})", flush=True)
    t0 = time.monotonic()
    try:
        with running_server(cmd, serve_env(args.kv_space_gib), log_path, args.start_timeout) as (proc, root):
            record["startup_s"] = time.monotonic() - t0
            warm_up(root, str(ckpt), args.bench_timeout)
            for n in args.prompt_lens:
                run = {"input_len": n}
                record["runs"][str(n)] = run
                before = parse_metrics(http_get(f"{root}/metrics"))
                fname = f"bench_{name}_{n}.json"
                bcmd = bench_command(ckpt, root, n, args.output_len, args.num_prompts, args.concurrency, work,
                                     fname, args.seed)
                run["bench_command"] = shlex.join(bcmd)
                print(f"[{name}] prompt {n}: {args.num_prompts} prompts x {args.output_len} tokens, "
                      f"concurrency {args.concurrency}", flush=True)
                t1 = time.monotonic()
                try:
                    done = subprocess.run(bcmd, capture_output=True, text=True, timeout=args.bench_timeout)
                except subprocess.TimeoutExpired:
                    run["error"] = f"vllm bench serve timed out after {args.bench_timeout} s"
                    run["server_log_excerpt"] = log_tail(log_path)
                    record["errors"].append(f"prompt {n}: {run['error']}")
                    break  # the server is still busy with the abandoned requests; longer prompts would be worse
                run["wall_s"] = time.monotonic() - t1
                if done.returncode != 0 or not (work / fname).exists():
                    run["error"] = f"vllm bench serve exited with {done.returncode}"
                    run["bench_output_tail"] = (done.stdout + done.stderr)[-3000:]
                    run["server_log_excerpt"] = error_excerpt(log_path)
                    record["errors"].append(f"prompt {n}: {run['error']}")
                    if proc.poll() is not None:
                        record["errors"].append(f"server exited with code {proc.returncode}")
                        break
                    continue
                run["bench"] = summarize_bench(json.loads((work / fname).read_text()))
                if run["bench"]["failed"]:
                    run["error"] = f"{run['bench']['failed']} of {args.num_prompts} requests failed"
                    run["server_log_excerpt"] = error_excerpt(log_path)
                    record["errors"].append(f"prompt {n}: {run['error']}")
                run["pages"] = pages_per_query(before, parse_metrics(http_get(f"{root}/metrics")))
                b = run["bench"]
                print(f"[{name}] prompt {n}: TTFT {b['mean_ttft_ms']:.0f} ms, TPOT {b['mean_tpot_ms']:.1f} ms, "
                      f"{b['output_throughput']:.2f} output tok/s ({run['wall_s']:.0f} s)", flush=True)
    except (RuntimeError, TimeoutError, OSError) as e:
        record["errors"].append(f"server: {e}")
        record["server_log_excerpt"] = error_excerpt(log_path)
        print(f"[{name}] error: {e}\n{record['server_log_excerpt']}", file=sys.stderr, flush=True)
    record["kv"] = parse_kv_log(log_path.read_text(errors="replace") if log_path.exists() else "",
                                args.kv_space_gib << 30)
    record["total_s"] = time.monotonic() - t0
    return record


# ---------------------------------------------------------------- report

def machine_info() -> dict:
    import torch
    import transformers
    import vllm

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=BENCH_DIR).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                                cwd=BENCH_DIR).stdout.strip())
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "mem_total_bytes": mem, "gpu": None,
            "versions": {"torch": torch.__version__, "vllm": vllm.__version__,
                         "transformers": transformers.__version__},
            "git_commit": commit, "git_dirty": dirty, "loadavg_1_5_15_at_start": os.getloadavg()}


def _fmt(x, digits=0):
    if x is None:
        return "—"
    if isinstance(x, float) and math.isnan(x):
        return "—"
    return f"{x:,.{digits}f}"


def _ratio(a, b, digits=2):
    return f"{a / b:.{digits}f}×" if a is not None and b else "—"


def _metric(result: dict, model: str, n: int, key: str):
    run = result["models"].get(model, {}).get("runs", {}).get(str(n), {})
    return (run.get("bench") or {}).get(key)


def _loadavg_note(machine: dict) -> str:
    start, end = machine.get("loadavg_1_5_15_at_start"), machine.get("loadavg_1_5_15_at_end")
    if start is None:
        return ""
    fmt = "/".join
    return (f" (load average 1/5/15 min: {fmt(f'{x:.1f}' for x in start)} at start, "
            f"{fmt(f'{x:.1f}' for x in end) if end else '?'} at end)")


def markdown_report(result: dict) -> str:
    """Side-by-side table per prompt length with HySparse/dense ratios, the KV table and notes."""
    lens = result["settings"]["prompt_lens"]
    s = result["settings"]
    lines = [f"# Serving on CPU: HySparse `small` vs dense Llama ({result['date']})", "",
             f"{s['num_prompts']} prompts × {s['output_len']} output tokens per prompt length, concurrency "
             f"{s['concurrency']}, `VLLM_CPU_KVCACHE_SPACE={s['kv_space_gib']}` and `--max-model-len "
             f"{max_model_len_for(lens, s['output_len'])}` for both, float32; "
             f"{result['machine']['cpu_count']} CPU cores ({result['machine']['cpu']}).", "",
             "| prompt | metric | HySparse | dense | HySparse/dense |", "| ---: | --- | ---: | ---: | ---: |"]
    rows = [("TTFT mean (ms)", "mean_ttft_ms", 0), ("TTFT median (ms)", "median_ttft_ms", 0),
            ("TTFT p99 (ms)", "p99_ttft_ms", 0), ("TPOT mean (ms)", "mean_tpot_ms", 1),
            ("TPOT median (ms)", "median_tpot_ms", 1), ("output tok/s", "output_throughput", 2),
            ("total tok/s", "total_token_throughput", 1)]
    for n in lens:
        for label, key, digits in rows:
            h, d = _metric(result, "hysparse", n, key), _metric(result, "dense", n, key)
            lines.append(f"| {n} | {label} | {_fmt(h, digits)} | {_fmt(d, digits)} | {_ratio(h, d)} |")
        pages = result["models"].get("hysparse", {}).get("runs", {}).get(str(n), {}).get("pages") or {}
        p, dp = pages.get("pages_per_query"), pages.get("dense_pages_per_query")
        lines.append(f"| {n} | KV pages per sparse query | {_fmt(p, 1)} | {_fmt(dp, 1)} (dense query) | "
                     f"{_ratio(p, dp)} |")
        exp = result["expected"]["small"]["by_context_len"].get(n) or result["expected"]["small"][
            "by_context_len"].get(str(n))
        lines.append(f"| {n} | KV bytes/token, expected from config (at this context) | "
                     f"{_fmt(exp['hysparse_bytes_per_token'])} | {_fmt(exp['dense_bytes_per_token'])} | "
                     f"{_ratio(exp['hysparse_bytes_per_token'], exp['dense_bytes_per_token'])} |")
    lines += ["", "## KV cache (same KV memory for both)", "",
              "| | HySparse | dense | dense/HySparse |", "| --- | ---: | ---: | ---: |"]
    hk, dk = result["models"].get("hysparse", {}).get("kv", {}), result["models"].get("dense", {}).get("kv", {})
    ours = hk.get("ours", {})
    h_bpt, d_bpt = ours.get("bytes_per_token"), (dk.get("vllm") or {}).get("implied_bytes_per_token")
    d_bpt_cfg = result["expected"]["small_served"]["dense_bytes_per_token_full"]
    lines.append(f"| KV bytes/token (full-length caches; dense: from config) | {_fmt(h_bpt)} | {_fmt(d_bpt_cfg)} | "
                 f"{_ratio(d_bpt_cfg, h_bpt)} |")
    lines.append(f"| KV bytes/token implied by vLLM's token count (KV memory / tokens) | "
                 f"{_fmt((hk.get('vllm') or {}).get('implied_bytes_per_token'))} | {_fmt(d_bpt)} | "
                 f"{_ratio(d_bpt, (hk.get('vllm') or {}).get('implied_bytes_per_token'))} |")
    h_tok, d_tok = ours.get("tokens_fit"), (dk.get("vllm") or {}).get("tokens_fit")
    h_vtok = (hk.get("vllm") or {}).get("tokens_fit")
    lines.append(f"| tokens that fit, ours ({ours.get('tokens_fit_source', '—')}) | {_fmt(h_tok)} | {_fmt(d_tok)} "
                 f"(vLLM) | {_ratio(h_tok, d_tok)} (HySparse/dense) |")
    lines.append(f"| tokens that fit, vLLM's 'KV cache size' | {_fmt(h_vtok)} | {_fmt(d_tok)} | "
                 f"{_ratio(h_vtok, d_tok)} (HySparse/dense) |")
    lines += ["", "## Expected KV bytes/token ratio dense/HySparse (from configs, not measured)", "",
              "| layout | layers / full-length caches (upper bound) | " +
              " | ".join(f"at {n} tokens" for n in result["expected"]["context_lens"]) + " |",
              "| --- | ---: | " + " | ".join("---:" for _ in result["expected"]["context_lens"]) + " |"]
    for key, label in (("small", "`small` [F,S,S,S]×3, 12 layers"), ("paper", "paper 49 layers, 5 full")):
        e = result["expected"][key]
        cells = [f"{e['by_context_len'][n]['ratio_dense_over_hysparse']:.2f}×" for n in result["expected"]["context_lens"]]
        lines.append(f"| {label} | {e['upper_bound_layers_over_full']:.2f}× | " + " | ".join(cells) + " |")
    small = result["expected"]["small"]
    lines += ["", "Notes:", "", f"- {NOTE_IMPL}", f"- {NOTE_VLLM_KV}",
              "- The expected ratio is `layers / full-length caches` less the sliding-window share: each of the "
              "window caches holds at most `swa_window` tokens per sequence, which per token is "
              "`swa_window / context` of a full-length cache.",
              "- Random weights; `--ignore-eos` so every request generates exactly the requested tokens.",
              "- KV pages per query: delta of `vllm:hysparse_pages_touched_total` / "
              "`vllm:hysparse_sparse_queries_total` over the run; the dense column is "
              "`vllm:hysparse_dense_pages_total` / queries (pages a full-attention query over the same context "
              "touches). A sparse query selects the top "
              f"{small['topk_blocks']} blocks of {small['block_size']} tokens, so with up to "
              f"{small['topk_blocks'] * small['block_size']:,} tokens of context it selects every block and "
              "equals dense.",
              "- The CPU is shared with other work, so timings are noisy" + _loadavg_note(result["machine"]) + "."]
    errors = [f"{m}: {e}" for m, rec in result["models"].items() for e in rec.get("errors", [])]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def plot_report(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = result["settings"]["prompt_lens"]
    colors = {"hysparse": "tab:orange", "dense": "tab:blue"}
    labels = {"hysparse": "HySparse small", "dense": "dense Llama"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))

    def line_panel(ax, key, title, ylabel):
        for model in MODELS:
            ys = [_metric(result, model, n, key) for n in lens]
            pts = [(n, y) for n, y in zip(lens, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", color=colors[model], label=labels[model])
        ax.set(title=title, xlabel="prompt length (tokens)", ylabel=ylabel)
        ax.legend()
        ax.grid(alpha=0.3)

    line_panel(axes[0, 0], "mean_ttft_ms", "TTFT (mean)", "ms")
    line_panel(axes[0, 1], "mean_tpot_ms", "TPOT (mean)", "ms")
    line_panel(axes[0, 2], "total_token_throughput", "Throughput (input + output)", "tokens/s")

    ax = axes[1, 0]
    hk, dk = result["models"].get("hysparse", {}).get("kv", {}), result["models"].get("dense", {}).get("kv", {})
    bpt = [(hk.get("ours") or {}).get("bytes_per_token") or 0,
           (hk.get("vllm") or {}).get("implied_bytes_per_token") or 0,
           result["expected"]["small_served"]["dense_bytes_per_token_full"]]
    ax.bar(["HySparse\n(ours)", "HySparse\n(vLLM count)", "dense"], bpt,
           color=[colors["hysparse"], "navajowhite", colors["dense"]])
    ax.set(title="KV bytes/token (float32)", ylabel="bytes")

    ax = axes[1, 1]
    toks = [(hk.get("ours") or {}).get("tokens_fit") or 0, (hk.get("vllm") or {}).get("tokens_fit") or 0,
            (dk.get("vllm") or {}).get("tokens_fit") or 0]
    ax.bar(["HySparse\n(ours)", "HySparse\n(vLLM count)", "dense\n(vLLM)"], toks,
           color=[colors["hysparse"], "navajowhite", colors["dense"]])
    ax.set(title=f"Tokens that fit in {result['settings']['kv_space_gib']} GiB KV", ylabel="tokens")

    ax = axes[1, 2]
    runs = result["models"].get("hysparse", {}).get("runs", {})
    pts = [(n, (runs.get(str(n), {}).get("pages") or {})) for n in lens]
    pts = [(n, p) for n, p in pts if p.get("pages_per_query") is not None]
    if pts:
        ax.plot([n for n, _ in pts], [p["pages_per_query"] for _, p in pts], "o-", color=colors["hysparse"],
                label="HySparse sparse query")
        ax.plot([n for n, _ in pts], [p["dense_pages_per_query"] for _, p in pts], "o--", color=colors["dense"],
                label="dense query (same context)")
        ax.legend()
    ax.set(title="KV pages per query", xlabel="prompt length (tokens)", ylabel="pages")
    ax.grid(alpha=0.3)

    fig.suptitle(f"vllm serve on CPU, {result['date']} — CPU timings compare implementations "
                 "(HySparse PyTorch path vs vLLM C++ attention), not architectures", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="prompt lengths 256, 1024 (about 8 minutes)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", help="default 512 2048 4096 (--quick: 256 1024)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE for both servers")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to become healthy")
    parser.add_argument("--bench-timeout", type=float, default=900, help="seconds for one `vllm bench serve` run")
    parser.add_argument("--checkpoints", type=Path, default=CHECKPOINT_DIR)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--report-from", type=Path, metavar="JSON",
                        help="only redraw the .md and .png of an earlier run's JSON; runs nothing")
    args = parser.parse_args(argv)
    if args.prompt_lens is None:
        args.prompt_lens = [256, 1024] if args.quick else [512, 2048, 4096]
    return args


def load_result(path: Path) -> dict:
    """A saved result JSON with its integer context-length keys restored (JSON stores them as strings)."""
    result = json.loads(path.read_text())
    for key in ("small", "paper"):
        rows = result["expected"][key]["by_context_len"]
        result["expected"][key]["by_context_len"] = {int(n): row for n, row in rows.items()}
    return result


def write_reports(result: dict, stem: Path) -> str:
    """The Markdown table (returned) and the plot, next to the JSON at `stem`."""
    report = markdown_report(result)
    stem.with_suffix(".md").write_text(report)
    plot_report(result, stem.with_suffix(".png"))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from:  # redraw the table and plot of an earlier run
        print(write_reports(load_result(args.report_from), args.report_from.with_suffix("")))
        return 0
    start = datetime.datetime.now()
    stem = f"serve_cpu_{start:%Y-%m-%d}" + ("_quick" if args.quick else "")
    work = args.results / "tmp" / stem
    work.mkdir(parents=True, exist_ok=True)
    ckpts = {"hysparse": ensure_hysparse_checkpoint(args.checkpoints / "hysparse-small")}
    ckpts["dense"] = ensure_dense_checkpoint(args.checkpoints / "llama-small", ckpts["hysparse"], args.seed)

    from vllm_hysparse.configs import HySparseConfig

    small = HySparseConfig.from_pretrained(ckpts["hysparse"])
    context_lens = sorted(set(args.prompt_lens) | {32768})
    expected = {"context_lens": context_lens, "small": expected_kv_ratios(small, context_lens, dtype_bytes=4),
                "paper": expected_kv_ratios(paper_config(), context_lens, dtype_bytes=2),
                "small_served": {"dense_bytes_per_token_full":
                                 2 * small.num_key_value_heads * small.head_dim * 4 * small.num_hidden_layers}}
    result = {"date": f"{start:%Y-%m-%d %H:%M}", "command": shlex.join([sys.executable, *sys.argv]),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": machine_info(), "expected": expected, "notes": [NOTE_IMPL, NOTE_VLLM_KV], "models": {}}
    for name in args.models:  # one server at a time
        result["models"][name] = bench_model(name, ckpts[name], args, work)
    result["wall_s"] = (datetime.datetime.now() - start).total_seconds()
    result["machine"]["loadavg_1_5_15_at_end"] = os.getloadavg()

    args.results.mkdir(parents=True, exist_ok=True)
    json_path = args.results / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(write_reports(result, json_path.with_suffix("")))
    print(f"wrote {json_path} (.md, .png) in {result['wall_s'] / 60:.1f} min")
    return 1 if any(rec["errors"] for rec in result["models"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
