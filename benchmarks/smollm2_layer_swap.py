# SPDX-License-Identifier: Apache-2.0
"""Where a converted HySparse student still differs from its teacher: each sparse layer made exact in turn.

    python benchmarks/smollm2_layer_swap.py [--student checkpoints/smollm2-hysparse-recovered] [--tokens 2048]
    python benchmarks/smollm2_layer_swap.py --cumulative 18,17,23 [--tokens 4096]

On one window of the held-out text (the Python reference documentation), the student runs with every switch on,
then once per sparse layer with that layer's attention replaced by the teacher's own (its q/k/v/o projections over
the layer's input: the layer as if it had stayed a full layer). The drop in KL(teacher ‖ student) says what that
layer's conversion costs, with every other layer as it is. Two more rows: every sparse layer exact (the check:
KL 0), and every sparse layer on its window branch alone (gates forced to 0 / 1), on the first `swa_window`
positions only, where that branch alone sees every key: how far the trained SWA projections have moved from
the teacher's K/V. With `--cumulative`, the given layers are made exact together instead, one more at a time in
the given order: what a plan with that many more full layers could reach with the rest of the student as trained.
With `--write-plan PLAN.json` as well, the student's full layers plus the `--cumulative` ones are written as a
conversion plan (`convert --plan`), with this table and the KV bytes each plan keeps; `recovery carry` then moves
the trained delta onto the base converted with it (`docs/recovery.md`, "A plan measured on the trained student").

Writes `benchmarks/results/smollm2/layer_swap_<date>_<HHMM>.{md,json}` and prints the table.
"""

import argparse
import copy
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_hysparse  # noqa: F401 - registers the HySparse model types with transformers
from vllm_hysparse.configs.base import kv_bytes_per_token
from vllm_hysparse.recovery.corpus import heldout_text
from vllm_hysparse.reference import modeling_hysparse, ops
from vllm_hysparse.reference.fast_ops import fast_reference_ops
from vllm_hysparse.reference.layers import split_heads
from vllm_hysparse.validate import token_windows

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "smollm2"
SPANS = 4


def agreement(t_logits: torch.Tensor, s_logits: torch.Tensor) -> dict:
    """KL(teacher ‖ student) and top-1 agreement over every position, and over `SPANS` equal spans of them."""
    t, s = t_logits.log_softmax(-1), s_logits.log_softmax(-1)
    kl = (t.exp() * (t - s)).sum(-1)
    top = (t_logits.argmax(-1) == s_logits.argmax(-1)).float()
    n = kl.shape[0] // SPANS
    return {"kl": kl.mean().item(), "top1": top.mean().item(),
            "spans": [[kl[i * n:(i + 1) * n].mean().item(), top[i * n:(i + 1) * n].mean().item()]
                      for i in range(SPANS)]}


def teacher_attention(teacher_sd: dict, layer: int, config):
    """A sparse layer's forward replaced by the teacher's own attention of that layer (dense, causal, no sink)."""
    d = config.head_dim
    w = {n: teacher_sd[f"model.layers.{layer}.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj")}

    def forward(x, positions, rope, cache, shared, switches):
        q, k = (rope(split_heads(F.linear(x, w[n]), d), positions) for n in ("q_proj", "k_proj"))
        v = split_heads(F.linear(x, w["v_proj"]), config.v_head_dim)
        return F.linear(ops.dense_attention(q, k, v, d ** -0.5).flatten(2), w["o_proj"])
    return forward


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, default=REPO / "checkpoints" / "smollm2-135m-instruct")
    parser.add_argument("--student", type=Path, default=REPO / "checkpoints" / "smollm2-hysparse-recovered")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--cumulative", type=lambda v: [int(x) for x in v.split(",")], metavar="L1,L2,...",
                        help="make these sparse layers exact cumulatively, in this order, instead of one at a time")
    parser.add_argument("--write-plan", type=Path, metavar="PLAN.json",
                        help="with --cumulative: write the plan with those layers full (convert --plan)")
    args = parser.parse_args(argv)
    if args.write_plan and not args.cumulative:
        raise SystemExit("error: --write-plan needs --cumulative (the layers to make full)")
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32).eval()
    if student.config.model_type != "hysparse":
        raise SystemExit(f"error: --student must be a HySparse checkpoint (got {student.config.model_type})")
    sparse = [i for i, t in enumerate(student.config.layer_types) if t == "sparse_attention"]
    unknown = sorted(set(args.cumulative or ()) - set(sparse))
    if unknown:
        raise SystemExit(f"error: --cumulative: layers {unknown} are not sparse layers of the student")
    ids = token_windows(tokenizer, heldout_text(), args.tokens, 1)[0]
    t_logits = teacher(ids).logits[0]
    teacher_sd = teacher.state_dict()

    def run(swapped=(), positions=None) -> dict:
        attns = [student.model.layers[i].self_attn for i in swapped]
        for i, attn in zip(swapped, attns):
            attn.forward = teacher_attention(teacher_sd, i, student.config)
        try:
            x = ids if positions is None else ids[:, :positions]
            with fast_reference_ops():
                s_logits = student(x, use_cache=False).logits[0]
        finally:
            for attn in attns:
                del attn.forward  # back to the class's forward
        return agreement(t_logits[:x.shape[1]], s_logits)

    rows = {"student (every switch on)": run(), "every sparse layer exact": run(sparse)}
    if args.cumulative:
        for k in range(1, len(args.cumulative) + 1):
            layers = args.cumulative[:k]
            rows[f"layer{'s' if k > 1 else ''} {', '.join(map(str, layers))} exact"] = run(layers)
        code = report(args, argv, rows, t0)
        if args.write_plan:
            write_plan(args, student.config, rows)
        return code
    for i in sparse:
        rows[f"layer {i} exact"] = run([i])
    window = student.config.swa_window
    rows[f"student, first {window} positions"] = run(positions=window)
    saved = modeling_hysparse.gate_logits
    swa_gates = {id(student.model.layers[i].self_attn.swa_gate_proj) for i in sparse}

    def window_branch_alone(proj, x, num_heads):
        g = saved(proj, x, num_heads)
        return torch.full_like(g, 30.0 if id(proj) in swa_gates else -30.0)

    modeling_hysparse.gate_logits = window_branch_alone
    try:
        rows[f"window branch alone, first {window} positions"] = run(positions=window)
    finally:
        modeling_hysparse.gate_logits = saved
    return report(args, argv, rows, t0)


def report(args, argv, rows: dict, t0: float) -> int:
    """Print the table and write it as Markdown and JSON."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M")
    command = "python benchmarks/smollm2_layer_swap.py " + " ".join(sys.argv[1:] if argv is None else argv)
    base = rows["student (every switch on)"]["kl"]
    lines = [f"# Where the HySparse student differs from its teacher ({stamp})", "",
             f"`{command}`: student `{args.student.name}`, one window of {args.tokens} tokens of held-out text; "
             f"{time.perf_counter() - t0:.0f} s. KL(teacher ‖ student) and top-1 agreement, over every position and "
             f"over {SPANS} equal spans.", "",
             "| run | KL | top-1 | KL saved | spans (KL / top-1) |", "| --- | ---: | ---: | ---: | --- |"]
    for name, r in rows.items():
        saved_kl = f"{base - r['kl']:.4f}" if "positions" not in name else ""
        spans = " ".join(f"{k:.4f}/{t:.3f}" for k, t in r["spans"])
        lines.append(f"| {name} | {r['kl']:.4f} | {r['top1']:.3f} | {saved_kl} | {spans} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"layer_swap_{stamp}"
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "student": str(args.student),
                                                    "tokens": args.tokens, "rows": rows}, indent=2))
    return 0


def write_plan(args, config, rows: dict) -> None:
    """The conversion plan with the `--cumulative` layers full as well (a `convert --plan` file), and the
    measurement it was chosen from."""
    was = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    now = sorted(set(was) | set(args.cumulative))
    planned = copy.deepcopy(config)
    planned.layer_types = ["full_attention" if i in now else t for i, t in enumerate(config.layer_types)]
    kv = {}
    for n in (2048, 4096, 32768):  # float32 caches
        plan_kv, student_kv = (kv_bytes_per_token(c, 4, n) for c in (planned, config))
        kv[str(n)] = {"plan": round(plan_kv["bytes_per_token"]), "student": round(student_kv["bytes_per_token"]),
                      "dense": student_kv["dense_bytes_per_token"]}
    dense = kv["32768"]["dense"]
    plan = {"arch": "hysparse", "num_hidden_layers": config.num_hidden_layers,
            "options": {"full_layers": now, "swa_window": config.swa_window},
            "default_options": {"full_layers": was, "swa_window": config.swa_window},
            "measured_on": {"student": str(args.student), "tokens": args.tokens,
                            "method": "layer swap: each listed layer's attention replaced by the teacher's own, "
                                      "cumulatively; KL(teacher || student) and top-1 on held-out text"},
            "layer_swap": rows, "kv_bytes_per_token": kv}
    args.write_plan.parent.mkdir(parents=True, exist_ok=True)
    args.write_plan.write_text(json.dumps(plan, indent=2) + "\n")
    print(f"wrote {args.write_plan}: full layers {now} (was {was}); KV bytes per token at 32k "
          f"{kv['32768']['plan']} (was {kv['32768']['student']}, dense {dense})")


if __name__ == "__main__":
    raise SystemExit(main())
