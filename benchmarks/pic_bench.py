# SPDX-License-Identifier: Apache-2.0
"""PIC (position-independent caching, SPEC §4) TTFT on CPU: a RAG-shaped workload, HySparse and HySparse2 `small`.

    python benchmarks/pic_bench.py            # 8 documents of ~1k tokens from a pool of 32 (~15 min on 2 loaded cores)
    python benchmarks/pic_bench.py --quick    # `tiny` presets, 2 documents of 64 tokens (< 1 min)

Every prompt is a system prompt (64 tokens), `--docs` documents drawn from a pool of `--pool` (lengths
`--doc-len` ± 1/16, random token ids) and a question (32 tokens, new for every request). One offline
`LLM` per architecture (prefix caching on, `max_tokens=1`, one request at a time; TTFT = wall time of
`llm.generate`) serves four kinds of request, kept apart by vLLM's prefix-cache salt:

- **PIC**: `extra_args={"pic_segments": [...], "pic_seam_tokens": w}` and a fresh `cache_salt`, so
  vLLM's prefix cache never hits (checked: `num_cached_tokens == 0`) and only the segment store helps;
- **full recompute**: the same prompt as a plain request with a fresh `cache_salt`: every block misses,
  which is prefix caching off (checked the same way);
- **prefix caching**: the same prompt plain, without salt, after the warm-up requests were served the
  same way: vLLM's prefix cache hits up to the first block that differs, i.e. up to the first document
  that changed (`num_cached_tokens` is recorded);
- **cold**: PIC over documents never seen (the isolated pass runs) against the same prompt plain.

Warm-up: `--warm` requests (PIC, and plain for the prefix cache) that together hold every pool
document. Each measured request starts like one warm-up request (its first `j % 3` documents in the
same order, so prefix caching gets something), then the rest of its documents in a new order from the
pool. Warm PIC is measured at every seam width of `--seams` on the same prompts (the store is keyed by
content, so the seam does not change what it holds). The counters (`segments_hit/cold`,
`tokens_reused/recomputed`) and `store.stats()` are read from the worker after every request.

Writes `benchmarks/results/pic/pic_bench_<date>_<HHMM>[_quick].{json,md,png}` (or `--out-dir`).
Checkpoints are written once under `benchmarks/checkpoints/` (random weights).
"""

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vllm_hysparse.tools.harness import machine_info  # the same machine record as the serving benchmarks

BENCH_DIR = Path(__file__).resolve().parent
CHECKPOINT_DIR = BENCH_DIR / "checkpoints"
RESULTS_DIR = BENCH_DIR / "results" / "pic"

ARCHS = ("hysparse", "hysparse2")
LABELS = {"hysparse": "HySparse", "hysparse2": "HySparse2"}
DEFAULT_SEAM = 8
TARGET_WARM_SPEEDUP = 5.0  # warm PIC TTFT >= 5x lower than prefix caching at seam 8
TARGET_COLD_RATIO = 1.1  # cold PIC TTFT <= 1.1x plain prefill

FULL = dict(preset="small", system_len=64, query_len=32, doc_len=1024, docs=8, pool=32, warm=4, measure=4,
            cold=3, seams=[0, 4, 8, 32, 128], kv_space=4, enforce_eager=False)
QUICK = dict(preset="tiny", system_len=64, query_len=32, doc_len=64, docs=2, pool=4, warm=2, measure=2,
             cold=2, seams=[0, 4, 8, 32, 128], kv_space=1, enforce_eager=True)


# ---------------------------------------------------------------- workload

def build_workload(cfg: dict, vocab: int, seed: int) -> dict:
    """Token ids of every request (random ids above the special tokens), deterministic in `seed`."""
    import random

    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(16, vocab) for _ in range(n)]

    jitter = max(1, cfg["doc_len"] // 16)

    def doc():
        return toks(cfg["doc_len"] + rng.randint(-jitter, jitter))

    system = toks(cfg["system_len"])
    pool = [doc() for _ in range(cfg["pool"])]
    order = list(range(cfg["pool"]))
    rng.shuffle(order)
    k = cfg["docs"]
    warm = [[order[(i * k + j) % cfg["pool"]] for j in range(k)] for i in range(cfg["warm"])]
    measured = []
    for j in range(cfg["measure"]):
        base = warm[j % len(warm)]
        keep = min(j % 3, k - 1)
        docs = list(base[:keep])
        rest = [d for d in range(cfg["pool"]) if d not in docs]
        while True:  # the document after the kept ones differs from the warm-up request's
            tail = rng.sample(rest, k - keep)
            if tail[0] != base[keep]:
                break
        measured.append({"docs": docs + tail, "kept": keep})
    cold_docs = [[doc() for _ in range(k)] for _ in range(cfg["cold"])]
    return {"system": system, "pool": pool, "warm": warm, "measured": measured, "cold_docs": cold_docs,
            "queries": [toks(cfg["query_len"]) for _ in range(1 + cfg["warm"] + cfg["measure"] + cfg["cold"])]}


def assemble(system, docs, query):
    ids = list(system)
    for d in docs:
        ids += d
    ids += query
    return ids, [len(system), *[len(d) for d in docs], len(query)]


# ---------------------------------------------------------------- one architecture (runs in a child process)

def pic_state(worker) -> dict:
    """Runs inside the worker: PIC counters and store statistics."""
    engine = worker.model_runner._pic()
    return {**engine.counters, **engine.store.stats()}


def run_arch(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec["cfg"]["kv_space"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: no IPC in the timed call
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm_hysparse  # noqa: F401
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = spec["cfg"]
    with open(Path(spec["checkpoint"]) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    wl = build_workload(cfg, vocab, spec["seed"])
    max_len = cfg["system_len"] + cfg["docs"] * (cfg["doc_len"] + cfg["doc_len"] // 16 + 1) + cfg["query_len"] + 8
    max_len = -(-max_len // 256) * 256
    engine_args = dict(model=spec["checkpoint"], dtype="float32", max_model_len=max_len, seed=0,
                       enable_prefix_caching=True, enforce_eager=cfg["enforce_eager"])
    t0 = time.perf_counter()
    print(f"[pic_bench] {spec['arch']}: starting the engine", flush=True)
    llm = LLM(**engine_args)
    startup_s = time.perf_counter() - t0
    queries = iter(wl["queries"])
    salt_n = [0]

    def state():
        return llm.collective_rpc(pic_state)[0]

    def request(docs, query, kind, seam=DEFAULT_SEAM):
        """One request alone; (record with TTFT, prompt ids)."""
        ids, segments = assemble(wl["system"], docs, query)
        extra, salt = None, None
        if kind == "pic":
            extra = {"pic_segments": segments, "pic_seam_tokens": seam}
        if kind == "full":  # a fresh salt: no prefix-cache hit at all
            salt_n[0] += 1
            salt = f"pic-bench-{salt_n[0]}"
        # PIC requests carry no salt of their own: the plugin salts their blocks by layout already, and a
        # user salt would put their segments in the store's private pool under that salt (a miss each time).
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:
            prompt["cache_salt"] = salt
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra)
        before = state()
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        ttft = time.perf_counter() - t
        after = state()
        print(f"[pic_bench] {spec['arch']} {kind:6} seam={seam if kind == 'pic' else '-':>4} "
              f"{len(ids):6} tokens  {ttft * 1e3:9.1f} ms  cached {out.num_cached_tokens}", flush=True)
        rec = {"kind": kind, "seam": seam if kind == "pic" else None, "ttft_s": ttft, "prompt_len": len(ids),
               "num_cached_tokens": int(out.num_cached_tokens or 0), "token": out.outputs[0].token_ids[0]}
        for k in ("segments_hit", "segments_cold", "tokens_reused", "tokens_recomputed"):
            rec[k] = after[k] - before[k]
        return rec

    pool = wl["pool"]
    records = {"startup": [], "warmup_pic": [], "warmup_prefix": [], "pic_warm": [], "full": [], "prefix": [],
               "pic_cold": [], "plain_cold": []}
    # A short plain request first: the first call of an engine pays one-off costs.
    records["startup"].append(request([], next(queries), "full"))
    for docs in wl["warm"]:
        q = next(queries)
        records["warmup_pic"].append(request([pool[d] for d in docs], q, "pic"))
        records["warmup_prefix"].append(request([pool[d] for d in docs], q, "prefix"))
    mq = [next(queries) for _ in wl["measured"]]
    for j, m in enumerate(wl["measured"]):
        docs = [pool[d] for d in m["docs"]]
        records["full"].append(request(docs, mq[j], "full"))
        records["prefix"].append(request(docs, mq[j], "prefix") | {"kept_docs": m["kept"]})
        for seam in cfg["seams"]:
            records["pic_warm"].append(request(docs, mq[j], "pic", seam))
    for docs in wl["cold_docs"]:
        q = next(queries)
        records["pic_cold"].append(request(docs, q, "pic"))
        records["plain_cold"].append(request(docs, q, "full"))
    final = state()
    runner_cfg = llm.llm_engine.vllm_config
    settings = {"max_model_len": max_len, "block_size": runner_cfg.cache_config.block_size,
                "max_num_batched_tokens": runner_cfg.scheduler_config.max_num_batched_tokens,
                "enforce_eager": cfg["enforce_eager"], "enable_prefix_caching": True}
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    return {"arch": spec["arch"], "checkpoint": spec["checkpoint"], "startup_s": startup_s, "settings": settings,
            "records": records, "final_state": final,
            "doc_lens": {"pool": [len(d) for d in pool], "cold": [len(d) for c in wl["cold_docs"] for d in c]}}


# ---------------------------------------------------------------- summary and report

def median(xs):
    return statistics.median(xs) if xs else None


def summarize(res: dict, seams: list[int]) -> dict:
    r = res["records"]
    warm_by_seam = {s: median([x["ttft_s"] for x in r["pic_warm"] if x["seam"] == s]) for s in seams}
    pic_warm = warm_by_seam.get(DEFAULT_SEAM)
    prefix, full = median([x["ttft_s"] for x in r["prefix"]]), median([x["ttft_s"] for x in r["full"]])
    cold, plain_cold = median([x["ttft_s"] for x in r["pic_cold"]]), median([x["ttft_s"] for x in r["plain_cold"]])
    pic_all = r["warmup_pic"] + r["pic_warm"] + r["pic_cold"]
    reused = sum(x["tokens_reused"] for x in pic_all)
    recomputed = sum(x["tokens_recomputed"] for x in pic_all)
    fs = res["final_state"]
    s = {
        "ttft_warm_pic_s": pic_warm, "ttft_prefix_cache_s": prefix, "ttft_full_recompute_s": full,
        "ttft_cold_pic_s": cold, "ttft_plain_prefill_s": plain_cold,
        "warm_speedup_vs_prefix_cache": prefix / pic_warm if pic_warm else None,
        "warm_speedup_vs_full_recompute": full / pic_warm if pic_warm else None,
        "cold_over_plain": cold / plain_cold if plain_cold else None,
        "ttft_warm_pic_by_seam_s": {str(k): v for k, v in warm_by_seam.items()},
        "prefix_cached_tokens_median": median([x["num_cached_tokens"] for x in r["prefix"]]),
        "prompt_len_median": median([x["prompt_len"] for x in r["full"]]),
        "warm_tokens_recomputed_by_seam": {str(k): median([x["tokens_recomputed"] for x in r["pic_warm"]
                                                          if x["seam"] == k]) for k in seams},
        "warm_tokens_reused_by_seam": {str(k): median([x["tokens_reused"] for x in r["pic_warm"]
                                                      if x["seam"] == k]) for k in seams},
        "tokens_reused": reused, "tokens_recomputed": recomputed,
        "counters": {k: fs[k] for k in ("segments_hit", "segments_cold", "tokens_reused", "tokens_recomputed")},
        "store_bytes": fs["public_bytes"] + fs["private_bytes"], "store_entries": fs["public_entries"] + fs[
            "private_entries"], "store_evictions": fs["public_evictions"] + fs["private_evictions"],
        "store_stats": {k: fs[k] for k in fs if k.startswith(("public", "private", "in_use"))},
        # sanity: vLLM's prefix cache never helped the PIC / full-recompute requests, and warm PIC never ran cold
        "salted_cache_hits": sum(x["num_cached_tokens"] for k in ("pic_warm", "full", "pic_cold", "plain_cold")
                                 for x in r[k]),
        "warm_segments_cold": sum(x["segments_cold"] for x in r["pic_warm"]),
        "cold_segments_hit": sum(x["segments_hit"] for x in r["pic_cold"]),
    }
    s["targets"] = {
        "warm_5x_vs_prefix_cache": {"value": s["warm_speedup_vs_prefix_cache"], "target": f">= {TARGET_WARM_SPEEDUP}x",
                                    "met": bool(s["warm_speedup_vs_prefix_cache"]
                                                and s["warm_speedup_vs_prefix_cache"] >= TARGET_WARM_SPEEDUP)},
        "cold_le_1.1x_plain": {"value": s["cold_over_plain"], "target": f"<= {TARGET_COLD_RATIO}x",
                               "met": bool(s["cold_over_plain"] and s["cold_over_plain"] <= TARGET_COLD_RATIO)},
    }
    return s


def _ms(x):
    return "—" if x is None else f"{x * 1e3:,.0f}" if x >= 1 else f"{x * 1e3:,.1f}"


def _x(x):
    return "—" if x is None else f"{x:.2f}×"


def markdown(result: dict) -> str:
    cfg, archs = result["config"], result["archs"]
    lines = [f"# PIC TTFT on CPU ({result['date']}{', quick' if result['quick'] else ''})", "",
             f"`{cfg['preset']}` presets, float32, one request at a time, `max_tokens=1` (TTFT = wall time of "
             f"`llm.generate`, median). Prompt: system {cfg['system_len']} + {cfg['docs']} documents of "
             f"~{cfg['doc_len']} tokens (pool of {cfg['pool']}) + question {cfg['query_len']}; "
             f"{cfg['measure']} warm / {cfg['cold']} cold requests; {result['machine']['cpu_count']} CPU cores, "
             f"load average at start {', '.join(f'{x:.2f}' for x in result['loadavg_start'])}, at end "
             f"{', '.join(f'{x:.2f}' for x in result['loadavg_end'])}.", "",
             "## Warm cache (documents in the store, new order) and cold", "",
             "| model | prompt | PIC warm, seam 8 (ms) | prefix caching (ms) | cached by prefix cache (tokens) "
             "| full recompute (ms) | prefix / PIC | full / PIC | PIC cold (ms) | plain prefill (ms) | cold / plain |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a, s in archs.items():
        sm = s["summary"]
        lines.append(f"| {LABELS[a]} | {sm['prompt_len_median']:.0f} | {_ms(sm['ttft_warm_pic_s'])} | "
                     f"{_ms(sm['ttft_prefix_cache_s'])} | {sm['prefix_cached_tokens_median']:.0f} | "
                     f"{_ms(sm['ttft_full_recompute_s'])} | {_x(sm['warm_speedup_vs_prefix_cache'])} | "
                     f"{_x(sm['warm_speedup_vs_full_recompute'])} | {_ms(sm['ttft_cold_pic_s'])} | "
                     f"{_ms(sm['ttft_plain_prefill_s'])} | {_x(sm['cold_over_plain'])} |")
    lines += ["", "## Warm PIC TTFT by seam width", "",
              "| model | " + " | ".join(f"seam {w} (ms)" for w in cfg["seams"]) + " | "
              + " | ".join(f"recomputed @ {w}" for w in cfg["seams"]) + " |",
              "| --- |" + " ---: |" * (2 * len(cfg["seams"]))]
    for a, s in archs.items():
        sm = s["summary"]
        lines.append(f"| {LABELS[a]} | " + " | ".join(_ms(sm["ttft_warm_pic_by_seam_s"][str(w)]) for w in cfg["seams"])
                     + " | " + " | ".join(f"{sm['warm_tokens_recomputed_by_seam'][str(w)]:.0f}" for w in cfg["seams"])
                     + " |")
    lines += ["", "## Store and counters (after the run)", "",
              "| model | store bytes | entries | evictions | segments hit | segments cold | tokens reused "
              "| tokens recomputed | reused share |", "| --- |" + " ---: |" * 8]
    for a, s in archs.items():
        sm = s["summary"]
        c = sm["counters"]
        share = c["tokens_reused"] / max(1, c["tokens_reused"] + c["tokens_recomputed"])
        lines.append(f"| {LABELS[a]} | {sm['store_bytes']:,} ({sm['store_bytes'] / 2**20:,.1f} MiB) | "
                     f"{sm['store_entries']} | {sm['store_evictions']} | {c['segments_hit']} | {c['segments_cold']} "
                     f"| {c['tokens_reused']:,} | {c['tokens_recomputed']:,} | {share:.1%} |")
    lines += ["", "## Targets", "", "| model | target | measured | met |", "| --- | --- | ---: | --- |"]
    for a, s in archs.items():
        t = s["summary"]["targets"]
        lines.append(f"| {LABELS[a]} | warm TTFT >= 5× lower than prefix caching (seam 8) | "
                     f"{_x(t['warm_5x_vs_prefix_cache']['value'])} | "
                     f"{'met' if t['warm_5x_vs_prefix_cache']['met'] else 'missed'} |")
        lines.append(f"| {LABELS[a]} | cold TTFT <= 1.1× plain prefill | {_x(t['cold_le_1.1x_plain']['value'])} | "
                     f"{'met' if t['cold_le_1.1x_plain']['met'] else 'missed'} |")
    lines += ["", "Counters cover every PIC request of the run (warm-up, the seam sweep and cold); the store "
              "holds the pool and the cold documents. Full-recompute requests carry a fresh prefix-cache salt; PIC "
              "requests only the plugin's layout salt (their documents come in new orders, so no block repeats): "
              f"vLLM's prefix cache served them {sum(s['summary']['salted_cache_hits'] for s in archs.values())}"
              " tokens (0 expected). Prefix caching served the plain requests 0 tokens too, although some keep "
              "their first documents in place: vLLM keeps only the last window's blocks of a sliding-window group "
              "(the SWA layers), so a hybrid model gets prefix hits only for prompts shared up to their last window."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seams = result["config"]["seams"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for i, (a, s) in enumerate(result["archs"].items()):
        sm = s["summary"]
        color = f"C{i}"
        xs = [max(w, 0.5) for w in seams]  # seam 0 drawn at 0.5 on the log axis
        ax.plot(xs, [sm["ttft_warm_pic_by_seam_s"][str(w)] * 1e3 for w in seams], "o-", color=color,
                label=f"{LABELS[a]} PIC warm")
        ax.axhline(sm["ttft_prefix_cache_s"] * 1e3, color=color, ls="--", lw=1, label=f"{LABELS[a]} prefix caching")
        ax.axhline(sm["ttft_full_recompute_s"] * 1e3, color=color, ls=":", lw=1, label=f"{LABELS[a]} full recompute")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([max(w, 0.5) for w in seams], [str(w) for w in seams])
    ax.set_xlabel("seam width w (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Warm TTFT vs seam")
    ax.legend(fontsize=7)
    ax = axes[1]
    names = ["PIC warm (w=8)", "prefix caching", "full recompute", "PIC cold", "plain prefill"]
    keys = ["ttft_warm_pic_s", "ttft_prefix_cache_s", "ttft_full_recompute_s", "ttft_cold_pic_s",
            "ttft_plain_prefill_s"]
    width = 0.8 / max(1, len(result["archs"]))
    for i, (a, s) in enumerate(result["archs"].items()):
        ax.bar([j + i * width for j in range(len(keys))], [s["summary"][k] * 1e3 for k in keys], width,
               label=LABELS[a])
    ax.set_xticks([j + width * (len(result["archs"]) - 1) / 2 for j in range(len(keys))], names, rotation=20,
                  fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT by mode")
    ax.legend(fontsize=8)
    fig.suptitle(f"PIC on CPU, {result['config']['preset']} ({result['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ensure_checkpoint(arch: str, preset: str) -> Path:
    from vllm_hysparse.tools.make_checkpoint import write_checkpoint

    path = CHECKPOINT_DIR / f"{arch}-{preset}" if preset == "small" else CHECKPOINT_DIR / f"pic-{arch}-{preset}"
    if not (path / "config.json").exists():
        write_checkpoint(path, arch, preset, force=True)
    return path


def out_stem(out_dir: Path, quick: bool) -> Path:
    now = datetime.datetime.now()
    stem = f"pic_bench_{now:%Y-%m-%d_%H%M}{'_quick' if quick else ''}"
    path, n = out_dir / stem, 1
    while path.with_suffix(".json").exists():
        n += 1
        path = out_dir / f"{stem}_{n}"
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny presets, 2 documents of 64 tokens (< 1 min)")
    p.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    for key in ("doc_len", "docs", "pool", "warm", "measure", "cold"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default {FULL[key]} ({QUICK[key]} with --quick)")
    p.add_argument("--seams", type=int, nargs="+")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per architecture")
    p.add_argument("--_child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:  # architectures in a process of their own (their engines' memory goes with it)
        for spec in json.loads(args._child.read_text()):
            res = run_arch(spec)
            Path(spec["out"]).write_text(json.dumps(res))
        return 0
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("doc_len", "docs", "pool", "warm", "measure", "cold", "seams"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if DEFAULT_SEAM not in cfg["seams"]:
        cfg["seams"] = sorted({*cfg["seams"], DEFAULT_SEAM})
    if cfg["warm"] * cfg["docs"] < cfg["pool"]:
        print(f"note: {cfg['warm']} warm-up requests of {cfg['docs']} documents do not cover the pool of "
              f"{cfg['pool']}; measured requests may meet cold documents", file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_stem(args.out_dir, args.quick)
    tmp = args.out_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    load_start = os.getloadavg()
    t0 = time.time()
    result = {"benchmark": "pic_bench", "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}", "quick": args.quick,
              "command": " ".join(["python", "benchmarks/pic_bench.py", *(argv if argv is not None else sys.argv[1:])]),
              "config": cfg, "seed": args.seed, "loadavg_start": load_start, "machine": machine_info(),
              "env": {"VLLM_CPU_KVCACHE_SPACE": str(cfg["kv_space"]), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                      "VLLM_HYSPARSE_PIC_PUBLIC_MB": os.environ.get("VLLM_HYSPARSE_PIC_PUBLIC_MB", "4096")},
              "archs": {}, "failures": {}}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_HYSPARSE_PIC_PUBLIC_MB": result["env"]["VLLM_HYSPARSE_PIC_PUBLIC_MB"],
           "PYTHONPATH": os.pathsep.join([str(BENCH_DIR.parent), os.environ.get("PYTHONPATH", "")])}
    # One process per architecture (`small` engines hold GiBs); --quick runs both in one (imports once).
    groups = [list(args.archs)] if args.quick else [[a] for a in args.archs]
    for group in groups:
        specs = []
        for arch in group:
            ckpt = ensure_checkpoint(arch, cfg["preset"])
            specs.append({"arch": arch, "checkpoint": str(ckpt), "cfg": cfg, "seed": args.seed,
                          "out": str(tmp / f"{stem.name}_{arch}.json")})
        name = "_".join(group)
        spec_path, log = tmp / f"{stem.name}_{name}_spec.json", tmp / f"{stem.name}_{name}.log"
        spec_path.write_text(json.dumps(specs))
        print(f"[pic_bench] {', '.join(group)} (log {log})", flush=True)
        with open(log, "w") as f:
            try:
                rc = subprocess.run([sys.executable, __file__, "--_child", str(spec_path)], env=env, stdout=f,
                                    stderr=subprocess.STDOUT, timeout=args.timeout * len(group)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        for spec in specs:
            arch, out_path = spec["arch"], Path(spec["out"])
            if not out_path.exists():
                tail = log.read_text(errors="replace").splitlines()[-30:]
                result["failures"][arch] = {"returncode": rc, "log_tail": tail}
                print("\n".join(tail), file=sys.stderr)
                continue
            res = json.loads(out_path.read_text())
            res["summary"] = summarize(res, cfg["seams"])
            result["archs"][arch] = res
    result["loadavg_end"] = os.getloadavg()
    result["total_s"] = time.time() - t0
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    if result["archs"]:
        md = markdown(result)
        stem.with_suffix(".md").write_text(md)
        print(md)
        try:
            plot(result, stem.with_suffix(".png"))
        except Exception as e:  # the numbers are written already
            print(f"[pic_bench] no PNG: {e!r}", file=sys.stderr)
    print(f"[pic_bench] wrote {stem}.json ({result['total_s']:.0f} s)")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
