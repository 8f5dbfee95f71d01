# SPDX-License-Identifier: Apache-2.0
"""A conversion plan measured on the teacher's own activations (SPEC §5: "a layer plan chosen from calibration
statistics"), written as a report the converter reads with `--plan`.

    python -m vllm_hysparse.recovery.plan --teacher dense/ --arch hysparse --out plan.json \\
        [--calibrate TEXT] [--tokens 4096] [--seq-len 2048]
    python -m vllm_hysparse.tools.convert --src dense/ --dst student/ --arch hysparse --plan plan.json

The converter's default plan is a fixed pattern. Here the dense teacher runs
on calibration windows and every choice is scored on its activations:

- **HySparse full layers.** For every pair (full candidate f, later layer l):
  the *coverage* `M[f, l]`, the mass layer l's own dense attention puts on
  the blocks f's oracle selects (same block size and top-k as the plan;
  SPEC §3.1), the *recall* of l's own top-k blocks by f's, and how well f's
  K/V predict l's own after the best RoPE-commuting key map and linear value
  map (the fits of recovery stage 0, held-out relative error). A sparse
  layer reads the nearest full layer before it (`HySparseConfig.oracle_layer`),
  so a plan's cost is a sum over segments `[f, next full layer)`, and the
  full-layer set of the default plan's size (the papers' ratio; layer 0 and,
  as in the default, the last layer always included) minimising it is found
  exactly by dynamic programming over the segment boundaries.
  Cost of sparse layer l reading f: `(1 - M[f, l]) + kv_weight * (e_K[f, l] + e_V[f, l]) / 2`.
- **HySparse2 bridge source.** For every self-decoder layer s and cross full
  layer c: the held-out relative error of a ridge fit of c's own K and V
  (pre-RoPE, as its projections produce them) from the normed residual
  stream entering s (stage 0's bridge fit). The source minimising
  `Σ_c (e_K[s, c] + e_V[s, c]) / 2` feeds every bridge and is the self full
  layer (the config requires a bridge source to be a self full layer; one, as
  in the papers).
- **Windows.** Per layer and candidate window, the mass of the layer's own
  dense attention inside the window (rows past the largest candidate, where
  every window is full: what a long context sees), against the KV bytes per
  token the window caches add at a few context lengths. The chosen window is
  the smallest candidate, not below `--min-window` (default: the converter's
  128), whose median mass over the plan's windowed layers (HySparse sparse,
  HySparse2 sliding) reaches `--mass-threshold`; when none does, the
  smallest allowed one (a window is widened only for the exactness asked
  for). The first token's mass (an attention sink in most pretrained
  models, outside every window on those rows) is reported apart;
  `--count-first-token` counts it as inside, since the window branch has a
  learned sink logit that may take its place.

Coverage and recall average every row of every window (as the validator's
`M_l` does); rows shorter than `block_size * topk_blocks` select every block
and count as covered. The K/V fits hold out the last quarter of each window.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vllm_hysparse.configs.base import kv_bytes_per_token
from vllm_hysparse.recovery.init import (
    Calibration,
    fit_rope_map,
    fit_value_map,
    group_permutation,
    relative_error,
    ridge_lstsq,
    teacher_kv,
)
from vllm_hysparse.reference import ops
from vllm_hysparse.reference.layers import RotaryEmbedding
from vllm_hysparse.tools import convert

WINDOWS = (64, 128, 256, 512)
CONTEXTS = (2048, 4096, 32768)
DIGITS = 6


def _progress(msg: str) -> None:
    print(f"[plan] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the layer-set search


def readers(full: list[int], num_layers: int) -> dict[int, int]:
    """Sparse layer -> the full layer it reads: the nearest one before it (as `HySparseConfig.oracle_layer`)."""
    out, last = {}, None
    for i in range(num_layers):
        if i in full:
            last = i
        elif last is not None:
            out[i] = last
    return out


def plan_cost(cost: torch.Tensor, full: list[int]) -> float:
    """`Σ_l cost[f(l), l]` over the sparse layers l of the plan whose full layers are `full`; cost `[L, L]`."""
    return sum(float(cost[f, l]) for l, f in readers(full, cost.shape[0]).items())


def best_full_layers(cost: torch.Tensor, count: int, required: list[int]) -> tuple[list[int], float]:
    """(full layers, cost): the `count` full layers, `required` among them, minimising `plan_cost`.

    `cost` `[L, L]`: `cost[f, l]` (only f < l is read) is what sparse layer l
    pays for reading full layer f. Layer 0 must be required (a sparse layer
    needs a full layer before it). Exact: `best[k][e]` is the cheapest way to
    place k full layers, the last at e, paying for every layer before e; a
    segment `[f, e)` costs `Σ_{f<l<e} cost[f, l]` and may not skip a required
    layer. O(count · L²). Ties go to the first plan found (smaller layers).
    """
    n = cost.shape[0]
    req = sorted(set(required))
    if 0 not in req:
        raise ValueError("layer 0 must be full: a sparse layer needs a full layer before it")
    if not len(req) <= count <= n:
        raise ValueError(f"cannot place {count} full layers in {n} layers with {req} required")
    c = cost.double()
    # seg[f][e] = cost of layers f+1 .. e-1 reading f (e = the next full layer, or n).
    seg = [[0.0] * (n + 1) for _ in range(n)]
    for f in range(n):
        for e in range(f + 2, n + 1):
            seg[f][e] = seg[f][e - 1] + float(c[f, e - 1])
    # best[k] : last full layer -> (cost so far, previous full layer)
    best = [dict() for _ in range(count + 1)]
    best[1][0] = (0.0, None)
    for k in range(1, count):
        for f, (so_far, _) in sorted(best[k].items()):
            for e in range(f + 1, n):
                total = so_far + seg[f][e]
                if e not in best[k + 1] or total < best[k + 1][e][0]:
                    best[k + 1][e] = (total, f)
                if e in req:  # a segment may end at a required layer, never pass it
                    break
    finals = [(so_far + seg[f][n], f) for f, (so_far, _) in best[count].items() if all(r <= f for r in req)]
    if not finals:
        raise ValueError(f"no plan of {count} full layers includes {req}")
    total, last = min(finals)
    chosen, k = [], count
    while last is not None:
        chosen.append(last)
        last, k = best[k][last][1], k - 1
    return sorted(chosen), total


# --------------------------------------------------------------------------- attention statistics


def teacher_qk(teacher, layer: int, h: torch.Tensor, rope, positions: torch.Tensor):
    """Post-RoPE q `[1, T, H, D]` and k `[1, T, G, D]` of teacher layer `layer` on the residual stream `h` into it."""
    t = teacher.model.layers[layer]
    q = t.self_attn.q_proj(t.input_layernorm(h))
    q = q.view(*q.shape[:-1], teacher.config.num_attention_heads, -1)
    if getattr(t.self_attn, "q_norm", None) is not None:
        q = t.self_attn.q_norm(q)
    k = teacher_kv(teacher, layer, h)[0]
    return rope(q, positions), rope(k, positions)


def block_mass(p: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention probabilities `[B, H, T, Tk]` -> mass per key block `[B, H, T, NB]`."""
    nb = -(-p.shape[-1] // block_size)
    padded = torch.nn.functional.pad(p, (0, nb * block_size - p.shape[-1]))
    return padded.view(*p.shape[:-1], nb, block_size).sum(-1)


def coverage(mass: torch.Tensor, selected: torch.Tensor) -> tuple[float, int]:
    """(summed mass, rows): mass `[H, T, NB]` of one layer's attention on the blocks `selected` `[T, G, NB]` (bool)
    of another's oracle; head h reads group h // (H / G). The mean coverage `M` is the ratio."""
    sel = selected.repeat_interleave(mass.shape[0] // selected.shape[1], dim=1).permute(1, 0, 2)  # [H, T, NB]
    return float((mass * sel).sum()), mass.shape[0] * mass.shape[1]


def recall(used: torch.Tensor, own: torch.Tensor) -> tuple[float, int]:
    """(summed recall, rows): share of each row's `own` blocks also in `used` (both `[T, G, NB]` bool)."""
    hit = (used & own).sum(-1) / own.sum(-1).clamp_min(1)
    return float(hit.sum()), hit.numel()


@dataclass
class AttentionStats:
    """The teacher's attention on the calibration windows, per layer (per window where a list)."""

    mass: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # [H, T, NB] mass per key block
    blocks: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # [T, G, NB] bool: own oracle top-k
    window_mass: dict[int, dict[int, float]] = field(default_factory=dict)  # window -> mean mass inside
    first_mass: dict[int, float] = field(default_factory=dict)  # mean mass on the first token (outside every window)


@torch.no_grad()
def attention_statistics(teacher, calib: Calibration, rope, layers: list[int], *, windows: tuple[int, ...],
                         block_size: int | None = None, topk_blocks: int | None = None) -> AttentionStats:
    """Block masses and own oracle blocks (when `block_size` is given) and window masses of `layers`.

    Window masses are over rows `t >= max(windows)`, where every candidate
    window is full and leaves out the first token: the share a long context
    sees. The first token's own mass is kept apart (an attention sink the
    window branch's learned sink may stand in for).
    """
    stats = AttentionStats()
    first_row = max(windows)
    sums = {layer: dict.fromkeys(windows, 0.0) for layer in layers}
    first = dict.fromkeys(layers, 0.0)
    rows = 0
    for hidden, t in zip(calib.hidden, calib.seq_lens):
        if t <= first_row:
            raise ValueError(f"calibration windows of {t} tokens are not longer than the largest window {first_row}")
        positions = torch.arange(t)
        for layer in layers:
            scale = teacher.model.layers[layer].self_attn.scaling
            q, k = teacher_qk(teacher, layer, hidden[layer], rope, positions)
            p = ops.sink_softmax(ops.attention_logits(q, k, scale), None)  # [1, H, T, T]
            for w in windows:
                inside = ops.window_mask(t, t, w)[first_row:]
                sums[layer][w] += float((p[0, :, first_row:] * inside).sum())
            first[layer] += float(p[0, :, first_row:, 0].sum())
            if block_size is not None:
                stats.mass.setdefault(layer, []).append(block_mass(p, block_size)[0])
                ids = ops.oracle_block_topk(q, k, scale, block_size, topk_blocks)
                stats.blocks.setdefault(layer, []).append(ops.ids_to_mask(ids, -(-t // block_size))[0])
            del p
        rows += (t - first_row) * teacher.config.num_attention_heads
    stats.window_mass = {layer: {w: s / rows for w, s in per.items()} for layer, per in sums.items()}
    stats.first_mass = {layer: s / rows for layer, s in first.items()}
    return stats


def selection_matrices(stats: AttentionStats, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(coverage `[L, L]`, recall `[L, L]`): entry [f, l] scores layer l reading f's oracle blocks (f <= l).

    The diagonal is each layer's own top-k: coverage there is the ceiling any shared selection can reach.
    """
    cov = torch.full((num_layers, num_layers), float("nan"), dtype=torch.float64)
    rec = cov.clone()
    for l in range(num_layers):
        for f in range(l + 1):
            pairs = [coverage(m, b) for m, b in zip(stats.mass[l], stats.blocks[f])]
            cov[f, l] = sum(s for s, _ in pairs) / sum(n for _, n in pairs)
            pairs = [recall(u, o) for u, o in zip(stats.blocks[f], stats.blocks[l])]
            rec[f, l] = sum(s for s, _ in pairs) / sum(n for _, n in pairs)
    return cov, rec


# --------------------------------------------------------------------------- K/V prediction


@torch.no_grad()
def layer_kv(teacher, calib: Calibration, layers: list[int]) -> dict[int, tuple]:
    """layer -> ((K fit, K held-out), (V fit, V held-out)), each `[N, G, D]` pre-RoPE (after k_norm)."""
    return {layer: (calib.rows(lambda hid, w: teacher_kv(teacher, layer, hid[layer])[0]),
                    calib.rows(lambda hid, w: teacher_kv(teacher, layer, hid[layer])[1]))
            for layer in layers}


def kv_prediction(src: tuple, dst: tuple, rotary_dim: int, with_k: bool, ridge: float) -> tuple[float, float]:
    """Held-out (K, V) relative errors of `dst`'s own K/V predicted from `src`'s (both as from `layer_kv`).

    Per KV group pair: the RoPE-commuting key map (identity without `with_k`,
    as stage 0 does under qk_norm) and the linear value map, fitted on the
    fit rows; groups are matched by the permutation cheapest on the fit rows
    (stage 0 moves whole groups in HySparse); errors are means over groups.
    """
    (ks, ks_h), (vs, vs_h) = src
    (kd, kd_h), (vd, vd_h) = dst
    g, d = kd.shape[1], kd.shape[2]
    fit_cost = torch.zeros(g, g, dtype=torch.float64)
    held = {}
    for go in range(g):
        for gf in range(g):
            mk = fit_rope_map(ks[:, gf], kd[:, go], rotary_dim, ridge) if with_k else torch.eye(d, dtype=torch.float64)
            av = fit_value_map(vs[:, gf], vd[:, go], ridge)
            fit_cost[go, gf] = (relative_error(ks[:, gf].double() @ mk.T, kd[:, go])
                                + relative_error(vs[:, gf].double() @ av.T, vd[:, go]))
            held[go, gf] = (relative_error(ks_h[:, gf].double() @ mk.T, kd_h[:, go]),
                            relative_error(vs_h[:, gf].double() @ av.T, vd_h[:, go]))
    sigma = group_permutation(fit_cost)
    return (sum(held[go, sigma[go]][0] for go in range(g)) / g, sum(held[go, sigma[go]][1] for go in range(g)) / g)


def kv_matrices(kv: dict, num_layers: int, rotary_dim: int, with_k: bool, ridge: float):
    """(K error `[L, L]`, V error `[L, L]`): entry [f, l] (f < l) is layer l's own K/V predicted from f's."""
    ek = torch.full((num_layers, num_layers), float("nan"), dtype=torch.float64)
    ev = ek.clone()
    for l in range(1, num_layers):
        for f in range(l):
            ek[f, l], ev[f, l] = kv_prediction(kv[f], kv[l], rotary_dim, with_k, ridge)
        _progress(f"layer {l}: K/V predicted from each earlier layer; best K error {float(ek[:l, l].min()):.3f} "
                  f"(layer {int(ek[:l, l].argmin())}), V {float(ev[:l, l].min()):.3f} "
                  f"(layer {int(ev[:l, l].argmin())})")
    return ek, ev


@torch.no_grad()
def bridge_errors(teacher, calib: Calibration, sources: list[int], cross_full: list[int], ridge: float):
    """(K error, V error), each `[len(sources), len(cross_full)]`: held-out relative error of a ridge fit of
    cross full layer c's own K and V (pre-RoPE, pre-k_norm: what its projections produce) from the residual
    stream entering s, normed by c's input norm (what `bridge_norm` starts as)."""
    ek = torch.zeros(len(sources), len(cross_full), dtype=torch.float64)
    ev = ek.clone()
    for j, c in enumerate(cross_full):
        layer = teacher.model.layers[c]
        bias = layer.self_attn.k_proj.bias is not None
        k_fit, k_held = calib.rows(lambda hid, w: teacher_kv(teacher, c, hid[c], qk_normed=False)[0].flatten(-2))
        v_fit, v_held = calib.rows(lambda hid, w: teacher_kv(teacher, c, hid[c], qk_normed=False)[1].flatten(-2))
        dk = k_fit.shape[-1]
        for i, s in enumerate(sources):
            x_fit, x_held = calib.rows(lambda hid, w: layer.input_layernorm(hid[s]))
            # One solve for K and V: ridge rows are independent per output.
            w, b = ridge_lstsq(x_fit, torch.cat([k_fit, v_fit], -1), ridge, bias=bias)
            pred = x_held.double() @ w.T + (b if b is not None else 0)
            ek[i, j] = relative_error(pred[:, :dk], k_held)
            ev[i, j] = relative_error(pred[:, dk:], v_held)
        _progress(f"bridge into layer {c}: best source {sources[int((ek[:, j] + ev[:, j]).argmin())]} "
                  f"(K {float(ek[:, j].min()):.3f}, V {float(ev[:, j].min()):.3f})")
    return ek, ev


# --------------------------------------------------------------------------- windows


def choose_window(window_mass: dict[int, dict[int, float]], layers: list[int], windows: tuple[int, ...],
                  threshold: float, min_window: int) -> tuple[int, dict[int, float], bool]:
    """(window, median mass per window over `layers`, threshold reached): the smallest window >= `min_window`
    whose median mass reaches `threshold`, else the smallest window >= `min_window` (no wider window is paid for
    when none buys the exactness asked for)."""
    medians = {w: statistics.median(window_mass[l][w] for l in layers) for w in windows}
    allowed = [w for w in sorted(windows) if w >= min_window]
    if not allowed:
        raise ValueError(f"no candidate window in {sorted(windows)} is at least --min-window {min_window}")
    reached = [w for w in allowed if medians[w] >= threshold]
    return (reached[0] if reached else allowed[0]), medians, bool(reached)


def window_summary(stats: AttentionStats, layers: list[int], s: "Settings", which: str) -> dict:
    """The window choice over `layers` (which: their description) and the medians behind it, counting the
    window alone or, with `s.count_first_token`, the window and the first token."""
    with_first = {l: {w: m + stats.first_mass[l] for w, m in stats.window_mass[l].items()} for l in layers}
    args = (layers, s.windows, s.mass_threshold, s.min_window)
    alone, counted = choose_window(stats.window_mass, *args), choose_window(with_first, *args)
    window, _, reached = counted if s.count_first_token else alone
    return {"layers": which, "counts": "window and first token" if s.count_first_token else "window alone",
            "median_mass": {w: _r(m) for w, m in alone[1].items()},
            "median_mass_with_first_token": {w: _r(m) for w, m in counted[1].items()},
            "median_first_token_mass": _r(statistics.median(stats.first_mass[l] for l in layers)),
            "threshold": s.mass_threshold, "min_window": s.min_window, "threshold_reached": reached,
            "chosen": window, "chosen_counting_window_alone": alone[0],
            "chosen_counting_first_token": counted[0]}


def window_trade(arch: str, fields: dict, options: dict, windows: tuple[int, ...], contexts: tuple[int, ...],
                 dtype_bytes: int) -> list[dict]:
    """Per candidate window and context: the plan's KV bytes per token and their ratio to dense (SPEC §3.4)."""
    rows = []
    for w in windows:
        config = convert.build_config(arch, fields, convert.PlanOptions(**{**options, "swa_window": w}))
        for ctx in contexts:
            kv = kv_bytes_per_token(config, dtype_bytes, ctx)
            rows.append({"window": w, "context": ctx, "bytes_per_token": kv["bytes_per_token"],
                         "dense_bytes_per_token": kv["dense_bytes_per_token"],
                         "ratio_to_dense": kv["bytes_per_token"] / kv["dense_bytes_per_token"]})
    return rows


# --------------------------------------------------------------------------- the two plans


@dataclass
class Settings:
    block_size: int | None = None
    topk_blocks: int | None = None
    full_period: int | None = None
    kv_weight: float = 1.0
    windows: tuple[int, ...] = WINDOWS
    mass_threshold: float = 0.9
    min_window: int = 128
    count_first_token: bool = False
    contexts: tuple[int, ...] = CONTEXTS
    ridge: float = 1e-4
    num_self_layers: int | None = None  # hysparse2: the self / cross split (None: the converter's, the papers' half)
    cross_full_layers: tuple[int, ...] | None = None  # hysparse2 (None: the converter's blocks of [full, sparse x 5])


def _matrix(m: torch.Tensor) -> list[list[float | None]]:
    return [[None if v != v else round(float(v), DIGITS) for v in row] for row in m.tolist()]


def _r(x: float) -> float:
    return round(float(x), DIGITS)


def _hysparse_terms(full: list[int], cov, rec, ek, ev, num_layers: int) -> dict:
    """Means over a plan's sparse layers of the statistics behind its cost."""
    pairs = list(readers(full, num_layers).items())
    mean = lambda m: _r(sum(float(m[f, l]) for l, f in pairs) / max(len(pairs), 1))  # noqa: E731
    return {"coverage": mean(cov), "recall": mean(rec), "k_error": mean(ek), "v_error": mean(ev)}


def plan_hysparse(teacher, calib: Calibration, config, rope, s: Settings) -> dict:
    """The measured HySparse plan: full layers by DP on coverage and K/V prediction, then the window."""
    n = config.num_hidden_layers
    b, k = config.sparse_block_size, config.sparse_topk_blocks
    stats = attention_statistics(teacher, calib, rope, list(range(n)), windows=s.windows, block_size=b,
                                 topk_blocks=k)
    cov, rec = selection_matrices(stats, n)
    _progress(f"coverage and recall of {n * (n + 1) // 2} layer pairs (block {b} x top-{k})")
    with_k = not config.qk_norm
    ek, ev = kv_matrices(layer_kv(teacher, calib, list(range(n))), n, rope.rotary_dim, with_k, s.ridge)
    cost = (1 - cov) + s.kv_weight * (ek + ev) / 2
    default = config.layers_of_type(convert.F)
    required = [0, n - 1] if n - 1 in default else [0]
    chosen, objective = best_full_layers(cost, len(default), required)
    coverage_only = best_full_layers(1 - cov, len(default), required)[0]
    window = window_summary(stats, [i for i in range(n) if i not in chosen], s, "sparse layers of the chosen plan")
    layers = []
    for i in range(n):
        row = {"layer": i, "own_coverage": _r(cov[i, i]),
               "window_mass": {w: _r(m) for w, m in stats.window_mass[i].items()},
               "first_token_mass": _r(stats.first_mass[i])}
        for name, full in (("chosen", chosen), ("default", default)):
            f = readers(full, n).get(i)
            row[name] = ({"kind": "full"} if f is None else
                         {"kind": "sparse", "reads": f, "coverage": _r(cov[f, i]), "recall": _r(rec[f, i]),
                          "k_error": _r(ek[f, i]), "v_error": _r(ev[f, i]), "cost": _r(cost[f, i])})
        layers.append(row)
    return {
        "options": {"full_layers": chosen, "block_size": b, "topk_blocks": k, "swa_window": window["chosen"]},
        "default_options": {"full_layers": default, "block_size": b, "topk_blocks": k,
                            "swa_window": convert.PlanOptions().swa_window},
        "objective": {
            "definition": "sum over sparse layers l of (1 - coverage[f, l]) + kv_weight * (k_error[f, l] + "
                          "v_error[f, l]) / 2, f the nearest full layer before l; lower is better",
            "kv_weight": s.kv_weight, "required_full_layers": required, "full_layer_count": len(default),
            "chosen": _r(objective), "default": _r(plan_cost(cost, default)),
            "chosen_terms": _hysparse_terms(chosen, cov, rec, ek, ev, n),
            "default_terms": _hysparse_terms(default, cov, rec, ek, ev, n),
            "coverage_only_plan": {"full_layers": coverage_only,
                                   "terms": _hysparse_terms(coverage_only, cov, rec, ek, ev, n)},
        },
        "window": window,
        "layers": layers,
        "pairs": {"coverage": _matrix(cov), "recall": _matrix(rec), "k_error": _matrix(ek), "v_error": _matrix(ev)},
    }


def plan_hysparse2(teacher, calib: Calibration, config, rope, s: Settings) -> dict:
    """The measured HySparse2 plan: the bridge source (and so the self full layer), then the window."""
    n_self = config.num_self_decoder_layers
    cross_full = config.cross_full_layers
    sources = list(range(n_self))
    ek, ev = bridge_errors(teacher, calib, sources, cross_full, s.ridge)
    per_source = ((ek + ev) / 2).sum(1)
    default = config.bridge_sources[0]
    # Ties go to the source nearest the default (the self-decoder's middle).
    chosen = min(sources, key=lambda i: (float(per_source[i]), abs(i - default)))
    stats = attention_statistics(teacher, calib, rope, sources, windows=s.windows)
    window = window_summary(stats, [i for i in sources if i != chosen], s, "sliding layers of the chosen plan")
    base = {"num_self_layers": n_self, "cross_full_layers": cross_full}
    return {
        "options": {**base, "self_full_layers": [chosen], "bridge_sources": [chosen] * len(cross_full),
                    "swa_window": window["chosen"]},
        "default_options": {**base, "self_full_layers": [i for i in config.layers_of_type(convert.F) if i < n_self],
                            "bridge_sources": list(config.bridge_sources),
                            "swa_window": convert.PlanOptions().swa_window},
        "objective": {
            "definition": "sum over cross full layers c of (k_error[s, c] + v_error[s, c]) / 2 for the bridge "
                          "source s (held-out ridge fit from the normed residual stream entering s); lower is better",
            "chosen": _r(per_source[chosen]), "default": _r(per_source[default]),
        },
        "bridges": [{"source": src, "cost": _r(per_source[i]),
                     "k_error": {c: _r(ek[i, j]) for j, c in enumerate(cross_full)},
                     "v_error": {c: _r(ev[i, j]) for j, c in enumerate(cross_full)},
                     "window_mass": {w: _r(m) for w, m in stats.window_mass[src].items()},
                     "first_token_mass": _r(stats.first_mass[src])}
                    for i, src in enumerate(sources)],
        "window": window,
    }


PLANNERS = {"hysparse": plan_hysparse, "hysparse2": plan_hysparse2}


def _default_options(arch: str, s: Settings) -> convert.PlanOptions:
    if arch == "hysparse":
        if s.num_self_layers is not None or s.cross_full_layers is not None:
            raise ValueError("--num-self-layers and --cross-full-layers apply to --arch hysparse2 only")
        return convert.PlanOptions(block_size=s.block_size, topk_blocks=s.topk_blocks, full_period=s.full_period)
    if s.block_size or s.topk_blocks or s.full_period:
        raise ValueError("--block-size, --topk-blocks and --full-period apply to --arch hysparse only")
    cross = None if s.cross_full_layers is None else list(s.cross_full_layers)
    return convert.PlanOptions(num_self_layers=s.num_self_layers, cross_full_layers=cross)


def measure(teacher_dir: str | Path, arch: str, windows: list[torch.Tensor], s: Settings | None = None) -> dict:
    """The plan report for `arch` from the dense teacher on calibration `windows` (`[1, T]` each); writes nothing."""
    from transformers import AutoModelForCausalLM

    s = s or Settings()
    if arch not in PLANNERS:
        raise ValueError(f"--arch must be one of {sorted(PLANNERS)} (got {arch!r})")
    start_cpu, start_wall = time.process_time(), time.time()
    # The converter's own checks: the teacher must convert, and its default plan is the baseline.
    conv = convert.plan_conversion(teacher_dir, arch, _default_options(arch, s))
    config = conv.config
    fields = convert.dense_fields(*convert.load_source_config(Path(teacher_dir)))
    dtype_bytes = torch.empty((), dtype=conv.headers["model.layers.0.self_attn.q_proj.weight"][1]).element_size()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    rope = RotaryEmbedding(config.head_dim, config.rope_parameters, config)
    calib = Calibration.collect(teacher, windows)
    _progress(f"{len(windows)} calibration windows, {sum(calib.seq_lens)} tokens")
    report = PLANNERS[arch](teacher, calib, config, rope, s)
    # The default plan has as many full-length and window caches as the chosen one: the same bytes.
    report["window"]["kv_bytes"] = window_trade(arch, fields, report["options"], s.windows, s.contexts, dtype_bytes)
    return {
        "arch": arch, "teacher": str(teacher_dir), "num_hidden_layers": config.num_hidden_layers,
        "calibration": {"windows": len(windows), "seq_len": calib.seq_lens[0], "tokens": sum(calib.seq_lens),
                        "heldout_fraction": 0.25},
        "settings": {**asdict(s), "kv_dtype_bytes": dtype_bytes},
        **report,
        "cpu_seconds": round(time.process_time() - start_cpu, 1), "wall_seconds": round(time.time() - start_wall, 1),
    }


# --------------------------------------------------------------------------- CLI


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 64,128 (got {text!r})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="dense teacher checkpoint (HF Llama / Qwen layout)")
    p.add_argument("--arch", choices=sorted(PLANNERS), required=True)
    p.add_argument("--out", required=True, help="plan report to write (JSON), for `convert --plan`")
    p.add_argument("--calibrate", metavar="TEXT", help="calibration text file (default: the recovery training corpus)")
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    p.add_argument("--seq-len", type=int, default=2048, help="calibration window length")
    p.add_argument("--train-chars", type=int, default=400_000, help="characters of the default corpus to read")
    p.add_argument("--seed", type=int, default=0, help="shuffle of the default corpus")
    p.add_argument("--block-size", type=int, help="hysparse: sparse_block_size the oracle uses (default 64)")
    p.add_argument("--topk-blocks", type=int, help="hysparse: sparse_topk_blocks (default 16)")
    p.add_argument("--full-period", type=int, help="hysparse: full-layer count of this period's fixed pattern "
                   "(default: the converter's, 4 below 48 layers, else 12)")
    p.add_argument("--kv-weight", type=float, default=1.0, help="hysparse: weight of the K/V prediction error "
                   "against 1 - coverage in the cost (0: coverage alone)")
    p.add_argument("--windows", type=_ints, default=WINDOWS, help="candidate SWA windows (default 64,128,256,512)")
    p.add_argument("--mass-threshold", type=float, default=0.9, help="median attention mass the window must hold")
    p.add_argument("--min-window", type=int, default=128, help="never choose a window below this (default 128, "
                   "the converter's default)")
    p.add_argument("--count-first-token", action="store_true", help="count the first token's mass as inside "
                   "every window (the window branch's learned sink may stand in for an attention sink)")
    p.add_argument("--contexts", type=_ints, default=CONTEXTS, help="context lengths of the KV-bytes trade")
    p.add_argument("--ridge", type=float, default=1e-4, help="ridge strength of the fits, relative to the "
                   "input's power")
    p.add_argument("--num-self-layers", type=int, help="hysparse2: self-decoder depth (default: the converter's, "
                   "half the layers as in the papers); the cross full layers follow the converter's default blocks")
    p.add_argument("--cross-full-layers", type=_ints, help="hysparse2: the cross-decoder's full layers, e.g. "
                   "24,27 (default: the converter's blocks of [full, sparse x 5]); each costs a full-length cache")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from vllm_hysparse.recovery import corpus
    from vllm_hysparse.recovery.corpus import windows_of

    hf_logging.disable_progress_bar()
    settings = Settings(block_size=args.block_size, topk_blocks=args.topk_blocks, full_period=args.full_period,
                        kv_weight=args.kv_weight, windows=args.windows, mass_threshold=args.mass_threshold,
                        min_window=args.min_window, count_first_token=args.count_first_token,
                        contexts=args.contexts, ridge=args.ridge, num_self_layers=args.num_self_layers,
                        cross_full_layers=args.cross_full_layers)
    try:
        if args.tokens < args.seq_len:
            raise ValueError(f"--tokens {args.tokens} is less than one window of --seq-len {args.seq_len}")
        if not (Path(args.teacher) / "config.json").is_file():
            raise ValueError(f"{args.teacher}: no config.json (is --teacher a Hugging Face checkpoint directory?)")
        if args.calibrate:
            text = Path(args.calibrate).read_text(encoding="utf-8", errors="replace")
        else:
            text = corpus.training_text(args.train_chars, args.seed)
        tokenizer = AutoTokenizer.from_pretrained(args.teacher)
        windows = windows_of(tokenizer, text, args.seq_len, args.tokens // args.seq_len)
        report = measure(args.teacher, args.arch, windows, settings)
        default_text = f"recovery.corpus.training_text({args.train_chars}, {args.seed})"
        report["calibration"]["text"] = args.calibrate or default_text
        report["command"] = " ".join(["python -m vllm_hysparse.recovery.plan", *(argv or sys.argv[1:])])
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    obj = report["objective"]
    print(f"chosen {report['options']} (objective {obj['chosen']:.4f})")
    print(f"default {report['default_options']} (objective {obj['default']:.4f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
