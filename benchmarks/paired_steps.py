# SPDX-License-Identifier: Apache-2.0
"""HySparse and HySparse2 against dense, one engine step at a time: the engines run side by side and take turns.

    python benchmarks/paired_steps.py                                 # 512 and 8192 tokens, 8 decode requests
    python benchmarks/paired_steps.py --contexts 512 --num-reqs 1 --rounds 60

Each model's vLLM engine lives in its own process (float32, prefix caching on, chunked prefill of `--chunk`
tokens, the model compiled as `vllm serve` compiles it). They are all started first; then, round after round,
each engine in turn runs one step while the others wait on a pipe, and the next round starts with the next
engine (after a pause of `--gap-ms`). A round's ratio (HySparse step / dense step) compares two steps taken
within a second of each other, so a slow minute of a shared machine (on the 2-core CI machine one vLLM kernel
call on the same input took 4.6 to 10.2 ms within ten minutes) moves both; models measured one after the other,
as `serve_bench.py` and `layer_breakdown.py` do, get different minutes. This measures the engine's step only: no
API server, no client. Run it as a server runs, without `OMP_WAIT_POLICY=PASSIVE` (which the test suite sets):
with it every parallel region wakes sleeping threads, and one request's decode step at 512 tokens took 40.7 ms
instead of 24.1 for dense (the policy is recorded in the results).

Per context: `--rounds` decode steps of `--num-reqs` requests on one shared prompt (request 0 prefills it, the
others share it through the prefix cache), then `--prefill-rounds` whole prefills of a fresh prompt of that
length (one request, the time until its first token: the engine's TTFT). Reports the median, quartiles and
mean of the per-round ratios and the median step times. Writes
`benchmarks/results/paired_steps_<date>_<HHMM>[_<tag>].{json,md,png}` (the plot: each round's ratio, as boxes).
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from vllm_hysparse.tools.bench_checkpoints import small_checkpoint
from vllm_hysparse.tools.harness import machine_info, percentile, result_stem, save_report

BENCH_DIR = Path(__file__).resolve().parent
CHECKPOINT_DIR = BENCH_DIR / "checkpoints"  # the same checkpoints as serve_bench.py and layer_breakdown.py
RESULTS_DIR = BENCH_DIR / "results"
MODELS = ("dense", "hysparse", "hysparse2")


def engine_worker(conn, ckpt: str, ctx: int, args: dict) -> None:
    """One model's engine: answers "decode" (one step of the decode batch, ms), "prefill" (a fresh prompt's
    time to its first token, ms; the decode batch is dropped first) and "stop"."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args["kv_space_gib"]))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=ckpt, dtype="float32", max_model_len=ctx + args["rounds"] + 64, seed=0,
              enable_prefix_caching=True, max_num_batched_tokens=args["chunk"], max_num_seqs=args["num_reqs"],
              block_size=args["block_size"])
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(args["seed"])
    prompt = torch.randint(10, 1000, (ctx,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args["rounds"] + 16, temperature=0.0, ignore_eos=True)
    engine.add_request("r0", TokensPrompt(prompt_token_ids=prompt), params)
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    for i in range(1, args["num_reqs"]):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt[:-1] + [1000 + i]), params)
    for _ in range(4):  # their prefills (one page at most each), then every request decoding
        engine.step()
    conn.send("ready")
    decoding, fresh = True, 0
    while (msg := conn.recv()) != "stop":
        if msg == "decode":
            t0 = time.perf_counter()
            engine.step()
        else:
            if decoding:
                engine.abort_request([f"r{i}" for i in range(args["num_reqs"])])
                while engine.has_unfinished_requests():
                    engine.step()
                decoding = False
            fresh += 1
            tokens = torch.randint(10, 1000, (ctx,), generator=gen).tolist()
            t0 = time.perf_counter()
            engine.add_request(f"p{fresh}", TokensPrompt(prompt_token_ids=tokens), SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
        conn.send((time.perf_counter() - t0) * 1e3)


def paired(ctx: int, names: list[str], args) -> dict:
    """Start one engine per model, then `rounds` decode and `prefill_rounds` prefill rounds in rotating order."""
    spawn = mp.get_context("spawn")
    workers = {}
    for name in names:
        ckpt = str(small_checkpoint(name, args.checkpoints))
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=engine_worker, args=(child, ckpt, ctx, vars(args)), daemon=True)
        proc.start()
        workers[name] = (proc, parent)
    try:
        for name, (proc, conn) in workers.items():
            if conn.recv() != "ready":
                raise RuntimeError(f"{name}: engine did not start")
        times = {phase: {name: [] for name in names} for phase in ("decode", "prefill")}
        for phase, rounds in (("decode", args.rounds), ("prefill", args.prefill_rounds)):
            for r in range(rounds):
                for k in range(len(names)):
                    name = names[(r + k) % len(names)]
                    time.sleep(args.gap_ms / 1e3)  # the previous engine's spinning OpenMP threads go to sleep
                    workers[name][1].send(phase)
                    times[phase][name].append(workers[name][1].recv())
        for _, conn in workers.values():
            conn.send("stop")
    finally:
        for proc, _ in workers.values():
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    out = {}
    for phase, by_model in times.items():
        if not by_model[names[0]]:
            continue
        base = by_model["dense"]
        out[phase] = {"median_ms": {m: statistics.median(t) for m, t in by_model.items()}, "ms": by_model,
                      "ratio": {}}
        for m in names:
            if m == "dense":
                continue
            ratios = [a / b for a, b in zip(by_model[m], base)]
            out[phase]["ratio"][m] = {"median": statistics.median(ratios), "p25": percentile(ratios, 25),
                                      "p75": percentile(ratios, 75), "mean": statistics.fmean(ratios),
                                      "rounds": len(ratios)}
    return out


def markdown(result: dict) -> str:
    lines = ["# Paired engine steps: HySparse / HySparse2 against dense (CPU, float32, `small` presets)", "",
             f"`{result['command']}` on {result['machine']['cpu']}, torch {result['machine']['versions']['torch']}, "
             f"vLLM {result['machine']['versions']['vllm']}, commit {result['machine']['git_commit'][:10]}. "
             f"Engines side by side, compiled as `vllm serve` compiles them, taking turns step by step; decode: "
             f"{result['num_reqs']} requests on one shared prompt; prefill: one fresh prompt's time to its first "
             f"token (chunks of {result['chunk']} tokens); OMP_WAIT_POLICY "
             f"{result.get('omp_wait_policy') or 'unset'}. Ratio: the model's step over dense's step in the same "
             "round.", "",
             "| context | phase | model | rounds | ratio median | p25-p75 | mean | model ms (median) | dense ms |",
             "| ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for ctx, phases in result["contexts"].items():
        for phase, r in phases.items():
            for m, q in r["ratio"].items():
                lines.append(f"| {ctx} | {phase} | {m} | {q['rounds']} | **{q['median']:.2f}x** | "
                             f"{q['p25']:.2f}-{q['p75']:.2f} | {q['mean']:.2f}x | {r['median_ms'][m]:.1f} | "
                             f"{r['median_ms']['dense']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Per context and phase, each model's per-round ratios to dense (box: quartiles; line at 1: dense)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(ctx, phase, r) for ctx, phases in result["contexts"].items() for phase, r in phases.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
    for ax, (ctx, phase, r) in zip(axes[0], panels):
        models = list(r["ratio"])
        ax.boxplot([[a / b for a, b in zip(r["ms"][m], r["ms"]["dense"])] for m in models])
        ax.set_xticks(range(1, len(models) + 1), models)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{ctx} tokens, {phase}", fontsize=9)
        ax.set_ylabel("step / dense step, same round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(result: dict, stem: Path) -> None:
    save_report(stem, result, markdown(result))
    plot(result, stem.with_suffix(".png"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--models", nargs="+", default=[m for m in MODELS if m != "dense"],
                        choices=[m for m in MODELS if m != "dense"], help="compared with dense")
    parser.add_argument("--num-reqs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=40, help="decode rounds per context")
    parser.add_argument("--prefill-rounds", type=int, default=3, help="prefill rounds per context (0: none)")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each engine")
    parser.add_argument("--gap-ms", type=float, default=20.0,
                        help="pause before each engine's turn: libgomp's threads spin a while after a parallel "
                             "region (OMP_WAIT_POLICY unset, as served), and would take the next engine's cores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoints", type=Path, default=CHECKPOINT_DIR)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default=None, help="suffix of the result files")
    parser.add_argument("--report-from", type=Path, metavar="JSON",
                        help="only redraw the .md and .png of an earlier run's JSON; runs nothing")
    args = parser.parse_args(argv)
    if args.report_from:
        write_reports(json.loads(args.report_from.read_text()), args.report_from.with_suffix(""))
        return 0
    start = datetime.datetime.now()
    result = {"command": "python benchmarks/paired_steps.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(), "num_reqs": args.num_reqs, "chunk": args.chunk, "gap_ms": args.gap_ms,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "contexts": {}}
    stem = result_stem(args.results, "paired_steps", start, args.tag)
    for ctx in args.contexts:
        print(f"[paired_steps] {ctx} tokens: dense, {', '.join(args.models)}", flush=True)
        result["contexts"][ctx] = paired(ctx, ["dense", *args.models], args)
        write_reports(result, stem)  # after every context, so a run cut short keeps its rounds
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
