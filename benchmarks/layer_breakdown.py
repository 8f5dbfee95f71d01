# SPDX-License-Identifier: Apache-2.0
"""Where one engine step's time goes: per layer kind and per op, HySparse and HySparse2 `small` beside dense.

    python benchmarks/layer_breakdown.py                          # 512 and 8192 tokens, 8 decode requests
    python benchmarks/layer_breakdown.py --contexts 512 --models dense hysparse
    python benchmarks/layer_breakdown.py --contexts 8192 --prefix-fraction 0.95   # serve_bench's shared-prefix runs

Drives the real vLLM engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, float32, prefix caching
on, chunked prefill of `--chunk` tokens), so every step goes through vLLM's scheduler, input preparation,
metadata builders (ours and vLLM's CPU one), the model, the sampler and our metrics, as when serving.
It runs eager (`enforce_eager=True`): module hooks can then open a `torch.profiler` range per module,
which a compiled graph would not call. `vllm serve` compiles the model outside the attention ops
(elementwise ops fused), so the non-attention rows here are an upper bound of the served ones; the
attention ops are opaque custom ops in both modes and run the same code. The same steps are then timed once
more on a second engine that compiles the model as `vllm serve` does (`step, compiled as served`): the step
time of the served model without the API server and the benchmark client, which share the CPU with the engine
when serving (on a 2-core machine they move a served TPOT by tens of ms between runs).

Per model and context it measures two steps: the last prefill chunk of one request (its rows attend the
whole context) and one decode step of `--num-reqs` requests on one shared prompt (prefilled once, then
shared through the prefix cache, as `serve_bench.py`'s shared-prefix workload; with `--prefix-fraction F` the
requests share its first F and add a random tail of their own, as `serve_bench.py --prefix-fraction F`).
Each is timed without the profiler (median of `--reps` steps) and profiled once; the profile gives each range's
inclusive time and attributes every op's self time to its innermost range. Writes
`benchmarks/results/layer_breakdown_<date>_<HHMM>.{json,md}`.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402

from vllm_hysparse.tools.bench_checkpoints import small_checkpoint  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
CHECKPOINT_DIR = BENCH_DIR / "checkpoints"  # the same checkpoints as benchmarks/serve_bench.py
RESULTS_DIR = BENCH_DIR / "results"
MODELS = ("dense", "hysparse", "hysparse2")
PREFIX = "bd:"  # names of our profiler ranges
# Leaf modules of a decoder layer timed as their own range (others are covered by their parent's range).
TIMED = ("qkv_proj", "q_swa_kv_proj", "q_proj", "kv_proj", "o_proj", "gate_proj", "gate_up_proj", "down_proj",
         "act_fn", "rotary_emb", "q_norm", "k_norm", "swa_k_norm", "attn", "swa_attn", "bridge",
         "input_layernorm", "post_attention_layernorm")
# Inside a HySparse sparse layer's one attention op (`fused_window`): its window branch, the SWA cache write and
# the window layer's attention (`HySparseAttentionImpl._window_branch`); counted once per such layer.
WINDOW_RANGE = "window branch (inside each sparse attention op)"


def attention_roles(module) -> str:
    """The roles of the `Attention` modules under `module`, e.g. `oracle` or `block_sparse+vllm-window`."""
    from vllm.model_executor.layers.attention import Attention

    roles = []
    for m in module.modules():
        if isinstance(m, Attention):
            role = getattr(m.impl, "role", None)
            roles.append(role or ("vllm-window" if getattr(m, "sliding_window", None) else "vllm"))
    return "+".join(roles) or "none"


def layer_kind(layer) -> str:
    attn = getattr(layer, "self_attn", None)
    return f"{type(attn).__name__}[{attention_roles(attn)}]" if attn is not None else type(layer).__name__


def install_ranges(model) -> tuple[list, dict[str, int]]:
    """Profiler ranges `bd:<layer kind>/<module>` around the timed modules of every decoder layer,
    and `bd:model` around the model. Returns the hook handles and the number of layers of each kind."""
    handles, counts = [], defaultdict(int)

    def wrap(module, name):
        state = {}

        def pre(mod, args, kwargs=None):
            state.setdefault("stack", []).append(torch.profiler.record_function(PREFIX + name).__enter__())

        def post(mod, args, out, kwargs=None):
            state["stack"].pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    layers = [m for n, m in model.named_modules() if n.count(".") >= 1 and n.split(".")[-2] == "layers"]
    # a module several layers share (vLLM caches rotary embeddings) gets one range, under "shared/"
    owners = defaultdict(set)
    for i, layer in enumerate(layers):
        for _, m in layer.named_modules():
            owners[id(m)].add(i)
    wrapped = set()
    for layer in layers:
        kind = layer_kind(layer)
        counts[kind] += 1
        fused = sum(getattr(getattr(m, "impl", None), "fused_window", None) is not None for m in layer.modules())
        if fused:
            counts[WINDOW_RANGE] += fused
        wrap(layer, f"{kind}")
        for name, m in layer.named_modules():
            leaf = name.split(".")[-1]
            if not ((leaf in TIMED and name.count(".") <= 1) or name in ("self_attn", "mlp")) or id(m) in wrapped:
                continue
            wrapped.add(id(m))
            wrap(m, f"shared/{leaf}" if len(owners[id(m)]) > 1 else f"{kind}/{name}")
    wrap(model, "model")
    return handles, dict(counts)


@contextlib.contextmanager
def patched_ranges():
    """Profiler ranges around host work outside the model (metadata builders, our metrics) and around the window
    branch inside a HySparse sparse layer's attention op."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from vllm_hysparse.attention.backend import HySparseAttentionImpl, HySparseMetadataBuilder
    from vllm_hysparse.metrics import PagesPerQueryStats

    saved = []

    def patch(cls, attr, label):
        original = getattr(cls, attr)

        def ranged(*args, **kwargs):
            with torch.profiler.record_function(PREFIX + label):
                return original(*args, **kwargs)

        saved.append((cls, attr, original))
        setattr(cls, attr, ranged)

    patch(HySparseMetadataBuilder, "build", "host/metadata build (HySparse)")
    patch(CPUAttentionMetadataBuilder, "build", "host/metadata build (vLLM CPU)")
    patch(PagesPerQueryStats, "add", "metrics (pages touched)")
    patch(HySparseAttentionImpl, "_window_branch", WINDOW_RANGE)
    try:
        yield
    finally:
        for cls, attr, original in saved:
            setattr(cls, attr, original)


def step_ms(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t0) * 1e3


def profile_step(engine) -> dict:
    """One engine step under torch.profiler -> {range: inclusive ms}, {(range, op): self ms}, total ms."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(PREFIX + "step"):
            engine.step()
    ranges, ops = defaultdict(float), defaultdict(float)
    for ev in prof.events():
        if ev.name.startswith(PREFIX):
            ranges[ev.name[len(PREFIX):]] += ev.cpu_time_total / 1e3
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith(PREFIX):
            parent = parent.cpu_parent
        if parent is None:
            continue
        # only top-level ops inside a range: nested aten calls are in their caller's self time otherwise
        if ev.cpu_parent is not None and not ev.cpu_parent.name.startswith(PREFIX):
            continue
        ops[(parent.name[len(PREFIX):], ev.name)] += ev.cpu_time_total / 1e3
    return {"ranges": dict(ranges), "ops": {f"{r} :: {o}": ms for (r, o), ms in ops.items()}}


def preload_cpu_kernels() -> None:
    """Build / load our C++ kernels before any engine starts, so no timed step pays a build."""
    from csrc_triton import cpu_ext

    for name in getattr(cpu_ext, "NAMES", ("oracle_decode", "sparse")):
        cpu_ext.load(name)


def run_model(name: str, ckpt: Path, ctx: int, args, compiled: bool = False) -> dict:
    """The profiled steps of one model (eager), or with `compiled` the same steps timed only, the model compiled
    as `vllm serve` runs it (no module hooks, no profiler)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=ctx + 64, enforce_eager=not compiled, seed=0,
              enable_prefix_caching=True, max_num_batched_tokens=args.chunk, max_num_seqs=args.num_reqs,
              block_size=args.block_size)
    engine = llm.llm_engine
    handles, counts = ([], {}) if compiled else llm.apply_model(install_ranges)[0]
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(10, 1000, (ctx,), generator=gen).tolist()
    # enough output tokens that every request is still decoding at the profiled steps
    params = SamplingParams(max_tokens=2 * args.reps + 16, temperature=0.0, ignore_eos=True)
    result = {"layer_counts": counts}
    with contextlib.nullcontext() if compiled else patched_ranges():
        # request 0 alone, so that its last prefill chunk attends the whole context
        engine.add_request("r0", TokensPrompt(prompt_token_ids=prompt), params)
        chunks = -(-ctx // args.chunk)
        for _ in range(chunks - 1):
            engine.step()
        # the last chunk, profiled (then timed below on a fresh prompt without the prefix cache), or timed
        result["prefill"] = {"step_ms_unprofiled": step_ms(engine)} if compiled else profile_step(engine)
        result["prefill"]["rows"] = ctx - (chunks - 1) * args.chunk
        # the other requests share the prompt (prefix cache) and add one token of their own, or with
        # `--prefix-fraction` share its first part and add their own tail, as `serve_bench.py --prefix-fraction`
        shared = ctx - 1 if args.prefix_fraction is None else int(ctx * args.prefix_fraction)
        for i in range(1, args.num_reqs):
            tail = ([1000 + i] if args.prefix_fraction is None
                    else torch.randint(10, 1000, (ctx - shared,), generator=gen).tolist())
            engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt[:shared] + tail), params)
        started = {"r0"}
        while len(started) < args.num_reqs:  # their prefills, until every request decodes
            started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
        engine.step()
        times = [step_ms(engine) for _ in range(args.reps)]
        result["decode"] = {} if compiled else profile_step(engine)
        result["decode"]["step_ms_unprofiled"] = statistics.median(times)
        result["decode"]["rows"] = args.num_reqs
        if not compiled:  # prefill timing without the profiler: a fresh prompt of that length (no cache hit)
            prompt2 = torch.randint(10, 1000, (ctx,), generator=gen).tolist()
            while engine.has_unfinished_requests():
                engine.step()
            engine.add_request("p", TokensPrompt(prompt_token_ids=prompt2), SamplingParams(max_tokens=1))
            for _ in range(chunks - 1):
                engine.step()
            result["prefill"]["step_ms_unprofiled"] = step_ms(engine)
            while engine.has_unfinished_requests():
                engine.step()
    for h in handles:
        h.remove()
    del llm, engine
    import gc

    gc.collect()
    return result


def summarise(profile: dict) -> dict:
    """Inclusive ms per layer kind (summed over its layers), per module of a kind, and outside the model."""
    r = profile["ranges"]
    kinds = {k: v for k, v in r.items() if "/" not in k and k not in ("step", "model")}
    modules = {k: v for k, v in r.items() if "/" in k and not k.startswith("host/")}
    kinds.update({k: v for k, v in r.items() if k.startswith("shared/")})
    step, model = r.get("step", 0.0), r.get("model", 0.0)
    host = {k: v for k, v in r.items() if k.startswith("host/") or k.startswith("metrics")}
    return {"step": step, "model": model, "outside_model": step - model, "layer_kinds": kinds,
            "modules": modules, "host": host}


def markdown(result: dict) -> str:
    lines = ["# Per-layer breakdown of one engine step (CPU, float32, `small` presets)", "",
             f"`{result['command']}` on {result['machine']}, torch {result['torch']}, load before the run: "
             f"{result['load']}, OMP_WAIT_POLICY {result.get('omp_wait_policy') or 'unset'}. vLLM engine in "
             f"process, eager, prefix caching on, chunked prefill of {result['chunk']} tokens, "
             f"{result['num_reqs']} decode requests on one shared prompt"
             + (f" (its first {result['prefix_fraction']:.0%}, then a tail of their own). "
                if result.get("prefix_fraction") is not None else ". ") +
             "Times are profiled (inclusive, ms, one step); `unprofiled` is the same step's wall time "
             "without the profiler (decode: median of the timed steps).", ""]
    for ctx, models in result["contexts"].items():
        for phase in ("decode", "prefill"):
            lines += [f"## {ctx} tokens, {phase}", ""]
            names = list(models)
            sums = {m: summarise(models[m][phase]) for m in names}
            lines.append("| | " + " | ".join(names) + " |")
            lines.append("| --- | " + " | ".join("---:" for _ in names) + " |")

            def row(label, values):
                lines.append(f"| {label} | " + " | ".join("—" if v is None else f"{v:.1f}" for v in values) + " |")

            row("step, unprofiled", [models[m][phase].get("step_ms_unprofiled") for m in names])
            compiled = [models[m].get("compiled", {}).get(phase, {}).get("step_ms_unprofiled") for m in names]
            row("step, compiled as served (unprofiled)", compiled)
            if names[0] == "dense" and compiled[0]:
                lines.append("| compiled step / dense | " + " | ".join(
                    "—" if c is None else f"{c / compiled[0]:.2f}x" for c in compiled) + " |")
            row("step, profiled", [sums[m]["step"] for m in names])
            row("model forward", [sums[m]["model"] for m in names])
            row("outside the model (scheduler, inputs, sampler)", [sums[m]["outside_model"] for m in names])
            for m in names:
                for k, v in sorted(sums[m]["host"].items()):
                    row(f"{m}: {k}", [v if n == m else None for n in names])
            lines.append("")
            lines.append("| model | layer kind / module | layers | ms (all layers) | ms per layer |")
            lines.append("| --- | --- | ---: | ---: | ---: |")
            for m in names:
                counts = models[m]["layer_counts"]
                for kind, ms in sorted(sums[m]["layer_kinds"].items(), key=lambda kv: -kv[1]):
                    n = counts.get(kind, 1)
                    lines.append(f"| {m} | **{kind}** | {n} | {ms:.1f} | {ms / n:.2f} |")
                    mods = {k.split("/", 1)[1]: v for k, v in sums[m]["modules"].items() if k.split("/")[0] == kind}
                    for mod, mms in sorted(mods.items(), key=lambda kv: -kv[1]):
                        lines.append(f"| {m} | {kind} / {mod} | {n} | {mms:.1f} | {mms / n:.2f} |")
            lines.append("")
            lines.append("Top ops by time inside our ranges (ms, summed over layers):")
            lines.append("")
            lines.append("| model | range :: op | ms |")
            lines.append("| --- | --- | ---: |")
            for m in names:
                ops = sorted(models[m][phase]["ops"].items(), key=lambda kv: -kv[1])[:result["top_ops"]]
                for k, v in ops:
                    lines.append(f"| {m} | `{k}` | {v:.2f} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--num-reqs", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top-ops", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-fraction", type=float, default=None,
                        help="share of the prompt the decode requests have in common (default: all but one token)")
    parser.add_argument("--checkpoints", type=Path, default=CHECKPOINT_DIR)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    preload_cpu_kernels()
    result = {"command": "python benchmarks/layer_breakdown.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{platform.machine()} {torch.get_num_threads()} threads", "torch": torch.__version__,
              "load": " ".join(f"{x:.2f}" for x in os.getloadavg()), "chunk": args.chunk,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "num_reqs": args.num_reqs, "prefix_fraction": args.prefix_fraction, "reps": args.reps,
              "top_ops": args.top_ops, "contexts": {}}
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"layer_breakdown_{datetime.datetime.now():%Y-%m-%d_%H%M}{args.tag}"
    for ctx in args.contexts:
        result["contexts"][ctx] = {}
        for name in args.models:
            print(f"[layer_breakdown] {name} at {ctx} tokens", flush=True)
            ckpt = small_checkpoint(name, args.checkpoints)
            result["contexts"][ctx][name] = run_model(name, ckpt, ctx, args)
            result["contexts"][ctx][name]["compiled"] = run_model(name, ckpt, ctx, args, compiled=True)
            # written after every model, so a run cut short keeps what it measured
            text = markdown(result)
            stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
            stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
