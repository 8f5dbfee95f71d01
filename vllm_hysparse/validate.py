# SPDX-License-Identifier: Apache-2.0
"""Validate a converted HySparse / HySparse2 student against its dense teacher, switch by switch (SPEC §5).

    python -m vllm_hysparse.validate --teacher teacher/ --student student/ --text heldout.txt --out report/

Both models run as plain PyTorch references on the same token windows. The
student's architecture switches are enabled one at a time in SPEC §5's order,
so the report says at which switch, and at which layer, the error jumps.
Metrics per layer: hidden-state cosine and max-abs error against the teacher
after that layer; for sparse layers the oracle coverage `M_l` (probability
mass that the layer's own dense attention puts on the selected keys), its
complement `ε_l`, and the recall of the used selection against the layer's own
dense top-k. Final logits: KL(teacher ‖ student), top-1 agreement, perplexity.

The first stage is the dense student: with every switch off a converted
student computes what its teacher computes. For HySparse2 that needs K/V
projections the student does not have: a HySparse2 checkpoint keeps none for
cross sparse layers (SPEC §2.4; the converter drops them), so while
`cross_kv_sharing` is off each cross sparse layer borrows the teacher's
`k_proj` / `v_proj` (and `k_norm`) of the same layer index — the layer it was
converted from. They are attached to the in-memory reference student for those
stages only and removed afterwards; the student checkpoint is never changed.
"""

import argparse
import json
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_hysparse  # noqa: F401  (registers our configs and models)
from vllm_hysparse.reference.evaluation import cut_windows, kl_rows
from vllm_hysparse.reference.fast_ops import fast_reference_ops
from vllm_hysparse.reference.modeling_hysparse2 import CrossSparseAttention
from vllm_hysparse.reference.probes import SELECTION

# SPEC §5: switches enabled one at a time, cumulatively, starting from the dense student.
STAGES = {
    "hysparse": [
        ("dense", {"sparse_selection": False, "kv_sharing": False, "swa_branch": False}),
        ("oracle indices (own KV)", {"sparse_selection": True}),
        ("KV sharing", {"kv_sharing": True}),
        ("SWA branch", {"swa_branch": True}),
    ],
    # Dense: every cross layer on its own K/V (cross sparse: the teacher's projections), sliding layers
    # over the whole context. Then KV sharing and the window (SPEC §5's "KV sharing; SWA branch"), then
    # the HySparse2 switches.
    "hysparse2": [
        ("dense", {"cross_kv_sharing": False, "sliding_window": False, "token_selection": False,
                   "forced_window": False, "bridge": False, "early_exit": False}),
        ("cross KV sharing", {"cross_kv_sharing": True}),
        ("sliding window", {"sliding_window": True}),
        ("token selection", {"token_selection": True}),
        ("forced window", {"forced_window": True}),
        ("bridge", {"bridge": True}),
        ("early exit", {"early_exit": True}),
    ],
}
# Rows per window on which early exit runs the cross-decoder alone, to compare with the stage before.
EXIT_ROWS = 8
# KL and top-1 are also reported for this many equal spans of a window's positions: a student's error often grows
# with the distance its sparse layers must reach (past its window, past the windows it was trained on).
POSITION_SPANS = 8


@dataclass
class LayerStats:
    """Sums over evaluated tokens for one student layer."""

    cos: float = 0.0
    max_err: float = 0.0
    coverage: float = 0.0
    recall: float = 0.0
    tokens: int = 0
    sparse_rows: int = 0

    def row(self) -> dict:
        out = {"cosine": self.cos / max(self.tokens, 1), "max_abs_err": self.max_err}
        if self.sparse_rows:
            m = self.coverage / self.sparse_rows
            out.update(coverage=m, epsilon=1 - m, recall=self.recall / self.sparse_rows)
        return out


@dataclass
class StageResult:
    name: str
    switches: dict
    layers: dict[int, LayerStats] = field(default_factory=dict)
    kl: float = 0.0
    top1: float = 0.0
    nll: float = 0.0
    nll_tokens: int = 0
    tokens: int = 0
    # Per window, the logits `[1, R, vocab]` at `sample_rows`: what the next stage's early exit is checked against.
    sample_logits: list = field(default_factory=list)
    early_exit_check: dict | None = None
    # position span start -> [end, KL sum, top-1 count, rows]
    spans: dict[int, list] = field(default_factory=dict)

    def summary(self) -> dict:
        n = max(self.tokens, 1)
        ppl = float(torch.exp(torch.tensor(self.nll / self.nll_tokens))) if self.nll_tokens else None
        out = {"stage": self.name, "switches": self.switches, "rows": self.tokens, "kl": self.kl / n,
               "top1": self.top1 / n, "perplexity": ppl,
               "by_position": [{"start": a, "end": e, "kl": kl / rows, "top1": top1 / rows, "rows": rows}
                               for a, (e, kl, top1, rows) in sorted(self.spans.items())],
               "layers": {i: s.row() for i, s in sorted(self.layers.items())}}
        if self.early_exit_check is not None:
            out["early_exit_check"] = self.early_exit_check
        return out


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int) -> list[torch.Tensor]:
    """Non-overlapping `[1, seq_len]` windows of the tokenized text."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = cut_windows(ids, seq_len)[:max(max_windows, 0)]
    if len(windows) == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of --seq-len {seq_len}")
    return [w[None].clone() for w in windows]


def _probe(attn, args, stats: LayerStats) -> None:
    measured = SELECTION[type(attn)](attn, args)
    if measured is None:
        return
    coverage, recall = measured
    stats.coverage += float(coverage.mean(dim=1).sum())
    stats.recall += float(recall.mean(dim=-1).sum())
    stats.sparse_rows += coverage.shape[0] * coverage.shape[2]


def _install_probes(student, result: StageResult) -> list:
    handles = []
    for i, layer in enumerate(student.model.layers):
        if type(layer.self_attn) in SELECTION:
            stats = result.layers.setdefault(i, LayerStats())
            handles.append(layer.self_attn.register_forward_pre_hook(lambda m, a, s=stats: _probe(m, a, s)))
    return handles


def teacher_cross_kv(teacher, student) -> dict[int, dict[str, torch.Tensor]]:
    """The teacher's K/V tensors for every cross sparse layer of a HySparse2 student, by layer index.

    Named as `CrossSparseAttention.set_own_kv` takes them. Layer `i` of a
    converted student comes from layer `i` of its teacher; a teacher without
    them (or, when attached, with other shapes) cannot be this student's.
    """
    cfg, sd = student.config, teacher.state_dict()
    names = ["k_proj.weight", "v_proj.weight"]
    names += ["k_proj.bias", "v_proj.bias"] if cfg.attention_bias else []
    names += ["k_norm.weight"] if cfg.qk_norm else []
    out = {}
    for i, layer in enumerate(student.model.layers):
        if isinstance(layer.self_attn, CrossSparseAttention):
            prefix = f"model.layers.{i}.self_attn."
            missing = [prefix + n for n in names if prefix + n not in sd]
            if missing:
                raise ValueError(f"--teacher has no {missing[0]}: the dense stage gives cross sparse layer {i} the "
                                 "teacher's K/V projections of that layer (is the student converted from it?)")
            out[i] = {n: sd[prefix + n] for n in names}
    return out


def _set_own_kv(student, tensors: dict[int, dict] | None) -> None:
    """Attach (None: remove) the teacher's K/V to the student's cross sparse layers, in memory only."""
    for i, layer in enumerate(student.model.layers):
        if isinstance(layer.self_attn, CrossSparseAttention):
            try:
                layer.self_attn.set_own_kv(None if tensors is None else tensors[i])
            except ValueError as e:
                raise ValueError(f"--teacher's K/V for the dense stage: {e}") from None


def sample_rows(seq_len: int) -> torch.Tensor:
    """`EXIT_ROWS` rows spread over a window, first and last included."""
    return torch.linspace(0, seq_len - 1, min(EXIT_ROWS, seq_len)).round().long().unique()


@torch.no_grad()
def evaluate_stage(teacher_runs, student, windows, name: str, switches: dict, teacher_kv: dict | None = None,
                   previous: StageResult | None = None) -> StageResult:
    """Student with `switches` against cached teacher outputs on every window.

    Every stage compares every row. `teacher_kv` (see `teacher_cross_kv`) is
    attached to the student's cross sparse layers while this stage runs, when
    it has `cross_kv_sharing` off. The stage that turns HySparse2 early exit on
    also runs the cross-decoder on `sample_rows` alone and compares those
    logits with `previous`'s (`early_exit_check`; SPEC §3.3 says they are equal).
    """
    student.set_switches(**switches)
    arch = student.config.model_type
    # The switches of this architecture (the dense stage names them all).
    names = STAGES[arch][0][1] if arch in STAGES else vars(student.switches)
    result = StageResult(name, {k: v for k, v in vars(student.switches).items() if k in names})
    # Without teacher_kv the student itself says that it has no K/V of its own.
    own_kv = teacher_kv is not None and arch == "hysparse2" and not student.switches.cross_kv_sharing
    rows, sw = sample_rows(windows[0].shape[1]), student.switches
    handles = _install_probes(student, result)
    try:
        if own_kv:
            _set_own_kv(student, teacher_kv)
        for ids, (t_logits, t_hidden) in zip(windows, teacher_runs):
            out = student(ids, use_cache=False, output_hidden_states=True)
            _accumulate(result, out, t_logits, t_hidden, ids)
            result.sample_logits.append(out.logits[:, rows])
        for h in handles:
            h.remove()
        handles = []
        if arch == "hysparse2" and sw.early_exit and previous is not None and not previous.switches["early_exit"]:
            # Observed, not assumed: how many rows enter the first cross-decoder layer.
            seen, cross = [], student.model.layers[student.config.num_self_decoder_layers]
            handles.append(cross.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])))
            diff = 0.0
            for ids, ref in zip(windows, previous.sample_logits):
                got = student(ids, use_cache=False, logits_to_keep=rows).logits
                diff = max(diff, float((got - ref).abs().max()))
            result.early_exit_check = {"rows": rows.tolist(), "taken": all(n == len(rows) for n in seen),
                                       "max_abs_logit_diff": diff}
    finally:
        for h in handles:
            h.remove()
        if own_kv:
            _set_own_kv(student, None)
    return result


def _accumulate(result: StageResult, out, t_logits, t_hidden, ids) -> None:
    s_logp = torch.log_softmax(out.logits.double(), -1)
    t_logp = torch.log_softmax(t_logits.double(), -1)
    kl, agree = kl_rows(t_logp, s_logp), s_logp.argmax(-1) == t_logp.argmax(-1)  # [B, L]
    result.kl += float(kl.sum())
    result.top1 += int(agree.sum())
    span = -(-kl.shape[1] // POSITION_SPANS)
    for a in range(0, kl.shape[1], span):
        e = min(a + span, kl.shape[1])
        acc = result.spans.setdefault(a, [e, 0.0, 0, 0])
        acc[1] += float(kl[:, a:e].sum())
        acc[2] += int(agree[:, a:e].sum())
        acc[3] += kl[:, a:e].numel()
    targets = ids[:, 1:]
    result.nll -= float(s_logp[:, :-1].gather(-1, targets.unsqueeze(-1)).sum())
    result.nll_tokens += targets.numel()
    result.tokens += ids.shape[1]
    for i, (s_h, t_h) in enumerate(zip(out.hidden_states[1:], t_hidden[1:])):
        stats = result.layers.setdefault(i, LayerStats())
        stats.cos += float(torch.nn.functional.cosine_similarity(s_h.double(), t_h.double(), dim=-1).sum())
        stats.max_err = max(stats.max_err, float((s_h - t_h).abs().max()))
        stats.tokens += s_h.shape[0] * s_h.shape[1]


def find_jumps(summaries: list[dict]) -> list[dict]:
    """Per stage: the KL and top-1 change from the previous stage and the layer whose cosine drops most.

    `worst_layer` is None when no layer's cosine drops (a stage that changes nothing).
    """
    jumps = []
    for prev, cur in zip(summaries, summaries[1:]):
        drops = {i: prev["layers"][i]["cosine"] - cur["layers"][i]["cosine"]
                 for i in cur["layers"] if "cosine" in prev["layers"].get(i, {}) and "cosine" in cur["layers"][i]}
        layer = max(drops, key=drops.get) if drops else None
        if layer is not None and drops[layer] <= 0:
            layer = None
        jumps.append({"stage": cur["stage"], "kl_change": cur["kl"] - prev["kl"],
                      "top1_change": cur["top1"] - prev["top1"], "worst_layer": layer,
                      "cosine_drop": drops[layer] if layer is not None else 0.0})
    return jumps


def coverage_by_position(config, layers: dict) -> dict[int, float]:
    """Mean coverage M_l of sparse layers grouped by their distance r from the oracle layer."""
    groups: dict[int, list[float]] = {}
    for i, row in layers.items():
        if "coverage" in row:
            groups.setdefault(int(i) - config.oracle_layer[int(i)], []).append(row["coverage"])
    return {r: sum(v) / len(v) for r, v in sorted(groups.items())}


def validate(teacher_dir: str, student_dir: str, text: str, seq_len: int = 256, max_windows: int = 4,
             fused: bool = False, final_only: bool = False) -> dict:
    """The switch-by-switch report. `fused` runs the models' attention through `reference.fast_ops`
    (the same math on fused attention, checked against the reference ops by its tests): much faster
    on long windows; the coverage and recall probes always use the reference ops. `final_only`
    evaluates the last stage alone (the real architecture), for long windows where every stage costs."""
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    arch = student.config.model_type
    if arch not in STAGES:
        raise ValueError(f"--student: model_type must be hysparse or hysparse2 (got {arch!r})")
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError("teacher and student vocabularies differ "
                         f"({teacher.config.vocab_size} vs {student.config.vocab_size})")
    windows = token_windows(tokenizer, text, seq_len, max_windows)
    with torch.no_grad():
        teacher_runs = [(o.logits, o.hidden_states) for o in
                        (teacher(ids, output_hidden_states=True, use_cache=False) for ids in windows)]
    teacher_kv = teacher_cross_kv(teacher, student) if arch == "hysparse2" else None
    summaries, switches, previous = [], {}, None
    with fast_reference_ops() if fused else nullcontext():
        for i, (name, change) in enumerate(tqdm(STAGES[arch], desc="switches", unit="stage")):
            switches.update(change)
            if final_only and i < len(STAGES[arch]) - 1:
                continue
            previous = evaluate_stage(teacher_runs, student, windows, name, dict(switches), teacher_kv, previous)
            summaries.append(previous.summary())
    teacher_ppl = _teacher_perplexity(teacher_runs, windows)
    return {"arch": arch, "teacher": str(teacher_dir), "student": str(student_dir), "seq_len": seq_len,
            "fused_attention": fused, "windows": len(windows), "teacher_perplexity": teacher_ppl, "stages": summaries,
            "jumps": find_jumps(summaries),
            "coverage_by_position": coverage_by_position(student.config, summaries[-1]["layers"])}


def _teacher_perplexity(teacher_runs, windows) -> float:
    nll, n = 0.0, 0
    for (logits, _), ids in zip(teacher_runs, windows):
        logp = torch.log_softmax(logits[:, :-1].double(), -1)
        nll -= float(logp.gather(-1, ids[:, 1:].unsqueeze(-1)).sum())
        n += ids.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / n)))


DENSE_STAGE = {
    "hysparse": "every layer's global branch sees every causal key over its own K/V, without the SWA branch",
    "hysparse2": ("sliding layers see the whole causal context, every cross-decoder layer attends over its own "
                  "K/V and every causal key; cross sparse layers have no K/V projections, so they use the "
                  "teacher's of the same layer while `cross_kv_sharing` is off"),
}


def markdown_report(report: dict) -> str:
    lines = [f"# Validation: {report['student']} vs teacher {report['teacher']}", "",
             f"{report['arch']}, {report['windows']} windows of {report['seq_len']} tokens; teacher perplexity "
             f"{report['teacher_perplexity']:.2f}. Switches are enabled one at a time (SPEC §5), every stage on "
             f"every row. Stage 'dense' has them all off: {DENSE_STAGE[report['arch']]}.", "",
             "| stage | KL(teacher‖student) | top-1 agreement | perplexity | worst layer cosine |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for s in report["stages"]:
        cos = [row["cosine"] for row in s["layers"].values() if "cosine" in row]
        worst = f"{min(cos):.4f}" if cos else "n/a"
        ppl = "n/a" if s["perplexity"] is None else f"{s['perplexity']:.2f}"
        lines.append(f"| {s['stage']} | {s['kl']:.4g} | {s['top1']:.3f} | {ppl} | {worst} |")
    for s in report["stages"]:
        check = s.get("early_exit_check")
        if check:
            rows = ", ".join(map(str, check["rows"]))
            how = (f"the cross-decoder run on rows {rows} of each window alone" if check["taken"] else
                   f"asked for rows {rows} only, the cross-decoder still ran on every row (early exit not taken); it")
            lines += ["", f"Stage '{s['stage']}': {how} gives logits within {check['max_abs_logit_diff']:.3g} "
                      "(max abs) of the stage before (SPEC §3.3: exact)."]
    final = report["stages"][-1]
    if final.get("by_position"):
        lines += ["", f"## By position at stage '{final['stage']}'", "", "| positions | KL | top-1 |",
                  "| --- | ---: | ---: |"]
        lines += [f"| {p['start']}-{p['end'] - 1} | {p['kl']:.4g} | {p['top1']:.3f} |" for p in final["by_position"]]
    lines += ["", "## Where the error jumps", "",
              "| stage | KL change | top-1 change | layer with the largest cosine drop | drop |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for j in report["jumps"]:
        layer = "– (none drops)" if j["worst_layer"] is None else j["worst_layer"]
        lines.append(f"| {j['stage']} | {j['kl_change']:+.4g} | {j['top1_change']:+.3f} | {layer} "
                     f"| {j['cosine_drop']:.4f} |")
    last_with_layers = next(s for s in reversed(report["stages"]) if any("cosine" in r for r in s["layers"].values()))
    lines += ["", f"## Per layer at stage '{last_with_layers['stage']}'", "",
              "| layer | cosine | max abs err | coverage M | ε | recall |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for i, row in last_with_layers["layers"].items():
        extra = (f"{row['coverage']:.4f} | {row['epsilon']:.4f} | {row['recall']:.3f}" if "coverage" in row
                 else "– | – | –")
        lines.append(f"| {i} | {row.get('cosine', float('nan')):.5f} | {row.get('max_abs_err', float('nan')):.4g} "
                     f"| {extra} |")
    lines += ["", "## Coverage by position in the hybrid block", "", "| r | mean M |", "| ---: | ---: |"]
    lines += [f"| {r} | {m:.4f} |" for r, m in report["coverage_by_position"].items()]
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for s in report["stages"]:
        rows = {int(i): r for i, r in s["layers"].items() if "cosine" in r}
        if rows:
            ax1.plot(list(rows), [1 - r["cosine"] for r in rows.values()], marker="o", label=s["stage"])
    ax1.set(xlabel="layer", ylabel="1 - cosine to teacher", yscale="log", title="hidden-state error per layer")
    ax1.legend(fontsize=8)
    cov = report["coverage_by_position"]
    ax2.bar([str(r) for r in cov], list(cov.values()))
    ax2.set(xlabel="position r after the oracle layer", ylabel="coverage M", ylim=(0, 1),
            title="oracle coverage by position in block")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True, help="dense teacher checkpoint directory")
    parser.add_argument("--student", required=True, help="converted HySparse / HySparse2 checkpoint directory")
    parser.add_argument("--text", required=True, help="held-out text file")
    parser.add_argument("--out", default="validation", help="report directory (report.md, report.json, plots.png)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-windows", type=int, default=4)
    parser.add_argument("--fused-attention", action="store_true",
                        help="run the models' attention on fused kernels (same math; for long windows)")
    parser.add_argument("--final-only", action="store_true", help="evaluate the real architecture only")
    args = parser.parse_args(argv)
    try:
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
        report = validate(args.teacher, args.student, text, args.seq_len, args.max_windows, args.fused_attention,
                          args.final_only)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown_report(report))
    plot_report(report, out / "plots.png")
    print(markdown_report(report))
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'plots.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
