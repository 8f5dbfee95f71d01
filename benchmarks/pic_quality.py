# SPDX-License-Identifier: Apache-2.0
"""PIC quality against full recompute: KL(plain || PIC) and greedy agreement as the seam width varies (SPEC §4).

    python benchmarks/pic_quality.py                          # trained tiny students + random `small` presets
    python benchmarks/pic_quality.py --models distilled-hysparse --prompts 2 --quick
    python benchmarks/pic_quality.py --bench-json benchmarks/results/pic/pic_bench_<...>.json   # + TTFT panel

For every model and prompt: a prefix, `--docs` documents of `--doc-len` tokens of real text (held-out
Python stdlib sources, never trained on, in a new order per prompt) and a query. Plain prefill (the
reference model on the whole prompt) against the HF PIC reference (`vllm_hysparse.reference.pic`,
which the engine matches; `--engine-check` spot-checks that with vLLM) at every seam width of
`--seams` plus one covering every segment (which must give KL ~ 0):

- KL(plain || PIC) of the next-token distribution (float64, nats), mean and max over prompts;
- top-1 agreement, and the fraction of prompts whose 16-token greedy continuation is identical.

Models (`--models`, checkpoints under `benchmarks/checkpoints/`):

- `distilled-hysparse` / `distilled-hysparse2`: the tiny trained pipeline (a dense Llama teacher
  trained on the stdlib, `convert_checkpoint.py`, then `vllm_hysparse.distill` on stdlib text outside
  the held-out split); built by `--prepare` (commands in `benchmarks/README.md`);
- `smollm2-hysparse` / `smollm2-hysparse2`: SmolLM2-135M-Instruct converted (trained weights, not
  distilled), when `checkpoints/smollm2-hysparse*` exist;
- `random-hysparse-small` / `random-hysparse2-small`: the random-weight `small` presets.

Writes `benchmarks/results/pic/pic_quality_<date>_<HHMM>.{json,md,png}`.
"""

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
CHECKPOINT_DIR = BENCH_DIR / "checkpoints"
PIPELINE_DIR = CHECKPOINT_DIR / "pic-pipeline"
RESULTS_DIR = BENCH_DIR / "results" / "pic"
KL_TARGET = 0.01
GREEDY_TOKENS = 16

MODELS = {
    "distilled-hysparse": {"path": PIPELINE_DIR / "distilled-hysparse", "label": "HySparse tiny, distilled"},
    "distilled-hysparse2": {"path": PIPELINE_DIR / "distilled-hysparse2", "label": "HySparse2 tiny, distilled"},
    "smollm2-hysparse": {"path": REPO / "checkpoints" / "smollm2-hysparse", "label": "HySparse SmolLM2-135M conv."},
    "smollm2-hysparse2": {"path": REPO / "checkpoints" / "smollm2-hysparse2",
                          "label": "HySparse2 SmolLM2-135M conv."},
    "random-hysparse-small": {"path": CHECKPOINT_DIR / "hysparse-small", "label": "HySparse small, random",
                              "make": ("hysparse", "small")},
    "random-hysparse2-small": {"path": CHECKPOINT_DIR / "hysparse2-small", "label": "HySparse2 small, random",
                               "make": ("hysparse2", "small")},
}
DEFAULT_MODELS = ["distilled-hysparse", "distilled-hysparse2", "random-hysparse-small", "random-hysparse2-small"]

# The trained pipeline (as tests/test_pipeline.py, at `tiny` size); distillation is shortened to fit CPU.
PIPELINE = [
    ["-m", "vllm_hysparse.tools.train_teacher", "--size", "tiny", "--out", "{D}/teacher", "--force"],
    ["scripts/convert_checkpoint.py", "--src", "{D}/teacher", "--dst", "{D}/student-hysparse", "--arch", "hysparse",
     "--block-size", "16", "--topk-blocks", "4", "--swa-window", "32", "--verify", "--force"],
    ["scripts/convert_checkpoint.py", "--src", "{D}/teacher", "--dst", "{D}/student-hysparse2", "--arch",
     "hysparse2", "--swa-window", "32", "--topk-tokens", "64", "--recent-window", "32", "--verify", "--force"],
    ["-m", "vllm_hysparse.distill", "--teacher", "{D}/teacher", "--student", "{D}/student-hysparse", "--text",
     "{D}/train.txt", "--out", "{D}/distilled-hysparse", "--steps", "40", "--lr", "1e-3", "--seq-len", "128",
     "--heldout-windows", "4", "--force"],
    ["-m", "vllm_hysparse.distill", "--teacher", "{D}/teacher", "--student", "{D}/student-hysparse2", "--text",
     "{D}/train.txt", "--out", "{D}/distilled-hysparse2", "--steps", "40", "--lr", "1e-3", "--seq-len", "128",
     "--heldout-windows", "4", "--force"],
]


def write_train_text(path: Path, max_bytes: int = 1_500_000) -> None:
    """Stdlib sources outside the teacher's held-out split (the distillation text)."""
    from vllm_hysparse.tools.tokenizer import corpus_files
    from vllm_hysparse.tools.train_teacher import read_text, split_corpus

    train, _ = split_corpus(corpus_files(4_000_000))
    out, n = [], 0
    for f in train:
        t = read_text(f)
        out.append(t)
        n += len(t.encode())
        if n > max_bytes:
            break
    path.write_text("\n".join(out))


def prepare(force: bool = False) -> None:
    PIPELINE_DIR.mkdir(parents=True, exist_ok=True)
    for i, cmd in enumerate(PIPELINE):
        out = Path(cmd[cmd.index("--out" if "--out" in cmd else "--dst") + 1].format(D=PIPELINE_DIR))
        if (out / "config.json").exists() and not force:
            continue
        if i == 3 and not (PIPELINE_DIR / "train.txt").exists():
            write_train_text(PIPELINE_DIR / "train.txt")
        args = [a.format(D=PIPELINE_DIR) for a in cmd]
        print("[pic_quality] python", " ".join(args), flush=True)
        subprocess.run([sys.executable, *args], check=True, cwd=REPO)


# ---------------------------------------------------------------- prompts

def heldout_text() -> str:
    path = PIPELINE_DIR / "teacher" / "heldout.txt"
    if path.exists():
        return path.read_text()
    from vllm_hysparse.tools.tokenizer import corpus_files
    from vllm_hysparse.tools.train_teacher import read_text, split_corpus

    _, held = split_corpus(corpus_files(4_000_000))
    return "\n".join(read_text(f) for f in held)


def make_prompts(tokenizer, text: str, n: int, docs: int, doc_len: int, prefix_len: int, query_len: int, seed: int):
    """`n` prompts: prefix, `docs` documents and a query, each a slice of the held-out token stream.

    The documents of all prompts come from one pool of `docs + 2` slices; each prompt takes `docs` of
    them in its own order (documents reused at new positions, as in RAG).
    """
    import random

    ids = tokenizer(text, add_special_tokens=False).input_ids
    need = prefix_len + (docs + 2) * doc_len + n * query_len
    if len(ids) < need:
        raise ValueError(f"held-out text has {len(ids)} tokens, {need} needed")
    stride = (len(ids) - query_len * n) // (docs + 3)
    prefix = ids[:prefix_len]
    pool = [ids[stride * (j + 1):stride * (j + 1) + doc_len] for j in range(docs + 2)]
    qbase = len(ids) - query_len * n
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        chosen = rng.sample(range(len(pool)), docs)
        query = ids[qbase + i * query_len:qbase + (i + 1) * query_len]
        parts = [prefix, *[pool[j] for j in chosen], query]
        prompts.append({"ids": [t for p in parts for t in p], "segments": [len(p) for p in parts],
                        "docs": chosen})
    return prompts


# ---------------------------------------------------------------- measurement

def greedy_from(model, cache, logits, steps: int) -> list[int]:
    import torch

    out = []
    for step in range(steps):
        token = int(torch.argmax(logits))
        out.append(token)
        if step + 1 < steps:
            res = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = res.past_key_values, res.logits[0, -1]
    return out


def measure_model(name: str, path: Path, prompts_cfg: dict, seams: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vllm_hysparse  # noqa: F401  (registers the model types)
    from vllm_hysparse.pic.layout import PICLayout
    from vllm_hysparse.reference.pic import pic_prefill

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(tokenizer, heldout_text(), **prompts_cfg)
    cover = max(max(p["segments"][1:-1]) for p in prompts)  # a seam >= every segment: plain prefill
    all_seams = sorted({*seams, cover})
    rows = {w: [] for w in all_seams}
    t0 = time.time()
    with torch.no_grad():
        for n, p in enumerate(prompts):
            ids = torch.tensor([p["ids"]])
            res = model(ids, use_cache=True, logits_to_keep=1)
            plain_logits = res.logits[0, -1]
            plain_lp = torch.log_softmax(plain_logits.double(), -1)
            plain_greedy = greedy_from(model, res.past_key_values, plain_logits, GREEDY_TOKENS)
            for w in all_seams:
                cache, logits = pic_prefill(model, p["ids"], PICLayout(tuple(p["segments"]), w))
                lp = torch.log_softmax(logits.double(), -1)
                kl = float((plain_lp.exp() * (plain_lp - lp)).sum())
                g = greedy_from(model, cache, logits, GREEDY_TOKENS)
                same = next((i for i, (a, b) in enumerate(zip(g, plain_greedy)) if a != b), GREEDY_TOKENS)
                rows[w].append({"prompt": n, "kl": max(kl, 0.0), "top1": g[0] == plain_greedy[0],
                                "greedy_equal": g == plain_greedy, "greedy_prefix": same})
            print(f"[pic_quality] {name}: prompt {n + 1}/{len(prompts)} "
                  + " ".join(f"w={w}:{rows[w][-1]['kl']:.2e}" for w in all_seams), flush=True)
    by_seam = {}
    for w, rs in rows.items():
        kls = [r["kl"] for r in rs]
        by_seam[str(w)] = {"kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
                           "top1_agree": sum(r["top1"] for r in rs) / len(rs),
                           "greedy16_equal": sum(r["greedy_equal"] for r in rs) / len(rs),
                           "greedy_prefix_mean": sum(r["greedy_prefix"] for r in rs) / len(rs), "prompts": rs}
    under = [w for w in all_seams if by_seam[str(w)]["kl_mean"] < KL_TARGET]
    # the smallest seam from which every wider one stays under the target
    need = next((w for w in all_seams if all(by_seam[str(v)]["kl_mean"] < KL_TARGET for v in all_seams if v >= w)),
                None)
    return {"model": name, "path": str(path), "model_type": model.config.model_type,
            "layer_types": list(model.config.layer_types), "prompt_lens": [len(p["ids"]) for p in prompts],
            "segments": [p["segments"] for p in prompts], "seams": all_seams, "cover_seam": cover,
            "by_seam": by_seam, "seam_for_kl_under_target": need, "seams_under_target": under,
            "seconds": time.time() - t0}


# ---------------------------------------------------------------- engine spot check (child process)

ENGINE_CHECK_SEAMS = (0, 8)


def engine_check(path: Path, prompts_cfg: dict) -> dict:
    """vLLM PIC vs the HF reference on 2 prompts at seams 0 and 8: greedy tokens and chosen logprobs."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm_hysparse  # noqa: F401
    from vllm_hysparse.pic.layout import PICLayout
    from vllm_hysparse.reference.pic import pic_greedy

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(tokenizer, heldout_text(), **{**prompts_cfg, "n": 2})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              enable_prefix_caching=False)
    out = []
    for n, p in enumerate(prompts):
        for w in ENGINE_CHECK_SEAMS:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5,
                                    extra_args={"pic_segments": p["segments"], "pic_seam_tokens": w})
            o = llm.generate([TokensPrompt(prompt_token_ids=p["ids"])], params, use_tqdm=False)[0].outputs[0]
            ref = pic_greedy(model, p["ids"], PICLayout(tuple(p["segments"]), w), 4)
            diffs = [abs(step[t].logprob - ref.logprobs[i][t]) for i, (t, step) in enumerate(zip(o.token_ids, o.logprobs))
                     if t in ref.logprobs[i]]
            out.append({"prompt": n, "seam": w, "engine_tokens": list(o.token_ids), "reference_tokens": ref.token_ids,
                        "tokens_equal": list(o.token_ids) == ref.token_ids,
                        "max_abs_logprob_diff": max(diffs) if diffs else None})
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    return {"model": str(path), "cases": out,
            "all_tokens_equal": all(c["tokens_equal"] for c in out),
            "max_abs_logprob_diff": max((c["max_abs_logprob_diff"] or 0) for c in out)}


# ---------------------------------------------------------------- report

def markdown(result: dict) -> str:
    pc = result["prompts_config"]
    lines = [f"# PIC quality vs full recompute ({result['date']})", "",
             f"{pc['n']} prompts per model: prefix {pc['prefix_len']} + {pc['docs']} documents of {pc['doc_len']} "
             f"tokens (held-out stdlib text, new order per prompt) + query {pc['query_len']}. KL(plain ‖ PIC) of the "
             f"next-token distribution in nats (mean / max over prompts); top-1 = first greedy token equal; "
             f"greedy {GREEDY_TOKENS} = the whole {GREEDY_TOKENS}-token greedy continuation equal (fraction of "
             "prompts). Computed with the HF reference (`vllm_hysparse.reference.pic`). The last seam covers "
             "every segment (plain prefill, KL ~ 0).", "",
             "| model | seam | KL mean | KL max | top-1 agree | greedy 16 equal | mean equal prefix (tokens) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in result["models"].items():
        if m.get("prompts_config") and m["prompts_config"] != pc:
            o = m["prompts_config"]
            lines.append(f"| {MODELS[name]['label']} ({o['n']} prompt(s) of {o['docs']} documents × "
                         f"{o['doc_len']} tokens, from `{Path(m['from']).name}`) | | | | | | |")
        for w in m["seams"]:
            s = m["by_seam"][str(w)]
            tag = f"{w} (all)" if w == m["cover_seam"] else str(w)
            lines.append(f"| {MODELS[name]['label']} | {tag} | {s['kl_mean']:.2e} | {s['kl_max']:.2e} | "
                         f"{s['top1_agree']:.0%} | {s['greedy16_equal']:.0%} | {s['greedy_prefix_mean']:.1f} |")
    lines += ["", f"## Seam width for KL < {KL_TARGET}", "", "| model | smallest seam with mean KL < 0.01 "
              "(and every wider one) | KL at seam 8 |", "| --- | ---: | ---: |"]
    for name, m in result["models"].items():
        need = m["seam_for_kl_under_target"]
        k8 = m["by_seam"].get("8", {}).get("kl_mean")
        k8s = f"{k8:.2e}" if k8 is not None else "—"
        lines.append(f"| {MODELS[name]['label']} | {need if need is not None else '—'}"
                     f"{' (all)' if need == m['cover_seam'] else ''} | {k8s} |")
    ec = result.get("engine_check")
    if ec:
        lines += ["", "## Engine spot check (vLLM PIC vs the HF reference)", "",
                  "| model | prompts × seams | greedy 4 tokens equal | max abs logprob diff |",
                  "| --- | ---: | --- | ---: |"]
        for name, c in ec.items():
            if "error" in c:
                lines.append(f"| {MODELS[name]['label']} | — | error: {c['error'][:80]} | — |")
                continue
            lines.append(f"| {MODELS[name]['label']} | {len(c['cases'])} | "
                         f"{'yes' if c['all_tokens_equal'] else 'no'} | {c['max_abs_logprob_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path, bench: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if bench else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4))
    for i, (name, m) in enumerate(result["models"].items()):
        xs = [max(w, 0.5) for w in m["seams"]]
        kl = [max(m["by_seam"][str(w)]["kl_mean"], 1e-12) for w in m["seams"]]
        axes[0].plot(xs, kl, "o-", color=f"C{i}", label=MODELS[name]["label"])
        axes[1].plot(xs, [m["by_seam"][str(w)]["greedy16_equal"] for w in m["seams"]], "o-", color=f"C{i}",
                     label=MODELS[name]["label"])
    axes[0].axhline(KL_TARGET, color="k", ls="--", lw=1, label="KL 0.01")
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xlabel("seam width w (tokens; 0 drawn at 0.5)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KL(plain ‖ PIC), nats (mean)")
    axes[0].set_title("KL vs seam")
    axes[0].legend(fontsize=6)
    axes[1].set_ylabel(f"greedy {GREEDY_TOKENS} tokens equal (fraction)")
    axes[1].set_title("Greedy agreement vs seam")
    if bench:
        ax = axes[2]
        seams = bench["config"]["seams"]
        for i, (a, s) in enumerate(bench["archs"].items()):
            sm = s["summary"]
            ax.plot([max(w, 0.5) for w in seams], [sm["ttft_warm_pic_by_seam_s"][str(w)] * 1e3 for w in seams], "o-",
                    color=f"C{i}", label=f"{a} PIC warm")
            ax.axhline(sm["ttft_prefix_cache_s"] * 1e3, color=f"C{i}", ls="--", lw=1, label=f"{a} prefix caching")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("seam width w (tokens)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"Warm TTFT vs seam ({bench['config']['preset']}, {bench['date']})")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="*", choices=list(MODELS), default=DEFAULT_MODELS,
                   help="models to measure (none: only merge --include runs into a report)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-len", type=int, default=160)
    p.add_argument("--prefix-len", type=int, default=32)
    p.add_argument("--query-len", type=int, default=16)
    p.add_argument("--seams", type=int, nargs="+", default=[0, 4, 8, 32, 128])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prepare", action="store_true", help="build the trained tiny pipeline checkpoints if missing")
    p.add_argument("--engine-check", nargs="*", choices=list(MODELS), default=None,
                   help="spot-check vLLM against the reference on these models (default: the distilled ones)")
    p.add_argument("--bench-json", type=Path, help="a pic_bench JSON: adds its TTFT-vs-seam panel to the PNG")
    p.add_argument("--include", type=Path, nargs="*", default=[],
                   help="earlier pic_quality JSONs whose models (not measured here) join this report")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--_engine_child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg = {"n": args.prompts, "docs": args.docs, "doc_len": args.doc_len, "prefix_len": args.prefix_len,
           "query_len": args.query_len, "seed": args.seed}
    if args._engine_child:
        spec = json.loads(Path(args._engine_child[0]).read_text())
        Path(args._engine_child[1]).write_text(json.dumps(engine_check(Path(spec["path"]), spec["cfg"])))
        return 0
    if args.prepare:
        prepare()
    result = {"benchmark": "pic_quality", "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
              "command": " ".join(["python", "benchmarks/pic_quality.py", *(argv if argv is not None else sys.argv[1:])]),
              "prompts_config": cfg, "greedy_tokens": GREEDY_TOKENS, "kl_target": KL_TARGET,
              "loadavg_start": os.getloadavg(), "models": {}, "skipped": {}}
    for name in args.models:
        info = MODELS[name]
        if not (info["path"] / "config.json").exists():
            if "make" in info:
                from vllm_hysparse.tools.make_checkpoint import write_checkpoint

                write_checkpoint(info["path"], *info["make"], force=True)
            else:
                result["skipped"][name] = f"no checkpoint at {info['path']} (--prepare builds the pipeline ones)"
                print(f"[pic_quality] skip {name}: {result['skipped'][name]}", file=sys.stderr)
                continue
        result["models"][name] = measure_model(name, info["path"], cfg, args.seams)
    for earlier in args.include:
        old = json.loads(earlier.read_text())
        for name, m in old["models"].items():
            if name not in result["models"]:
                result["models"][name] = {**m, "from": str(earlier), "prompts_config": old["prompts_config"]}
        for name, c in old.get("engine_check", {}).items():
            result.setdefault("engine_check", {}).setdefault(name, c)
        result.setdefault("included", []).append(str(earlier))
    checks = args.engine_check
    if checks is not None:
        checks = checks or [m for m in ("distilled-hysparse", "distilled-hysparse2") if m in result["models"]]
        result["engine_check"] = {}
        args.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = args.out_dir / "tmp"
        tmp.mkdir(exist_ok=True)
        for name in checks:
            spec, out = tmp / f"engine_check_{name}_spec.json", tmp / f"engine_check_{name}.json"
            spec.write_text(json.dumps({"path": str(MODELS[name]["path"]), "cfg": cfg}))
            log = tmp / f"engine_check_{name}.log"
            with open(log, "w") as f:
                rc = subprocess.run([sys.executable, __file__, "--_engine_child", str(spec), str(out)], stdout=f,
                                    stderr=subprocess.STDOUT, timeout=900,
                                    env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
            if rc == 0 and out.exists():
                result["engine_check"][name] = json.loads(out.read_text())
            else:
                result["engine_check"][name] = {"error": "\n".join(log.read_text().splitlines()[-5:])}
            print(f"[pic_quality] engine check {name}: {result['engine_check'][name]}", flush=True)
    result["loadavg_end"] = os.getloadavg()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"pic_quality_{datetime.datetime.now():%Y-%m-%d_%H%M}"
    while stem.with_suffix(".json").exists():
        stem = stem.with_name(stem.name + "_b")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    stem.with_suffix(".md").write_text(md)
    print(md)
    bench = json.loads(args.bench_json.read_text()) if args.bench_json else None
    try:
        plot(result, stem.with_suffix(".png"), bench)
    except Exception as e:
        print(f"[pic_quality] no PNG: {e!r}", file=sys.stderr)
    print(f"[pic_quality] wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
