# SPDX-License-Identifier: Apache-2.0
"""Recovery stage 0: closed-form initialisation of a converted student from teacher activations.

    python -m vllm_hysparse.recovery init --teacher dense/ --student converted/ --out initialised/ \\
        [--calibrate TEXT] [--tokens 4096]

The converter copies weights: a HySparse sparse layer's global branch reads
the full layer's K/V through its own `q_proj` / `o_proj`, and a HySparse2
cross full layer applies its own `k_proj` / `v_proj` to the bridge source's
input. Here each of those is refitted by linear least squares on a few
thousand calibration tokens, and every fit is folded into tensors the
checkpoint already has, so the format and the served model are unchanged:

- **Bridges** (HySparse2 cross full layers): ridge regression of the
  teacher layer's own K and V (pre-RoPE; before `k_norm` with qk_norm, i.e.
  what the projection itself produces) on the bridge source's normed input.
- **Key maps** (HySparse sparse / HySparse2 cross sparse layers): per RoPE
  frequency pair, the complex scalar `c` (a scale and a rotation, which
  commutes with RoPE) with `k_own ≈ c · k_full`. Since
  `q · RoPE(c k) = (conj(c) q) · RoPE(k)`, `conj(c)` is folded into the
  head's `q_proj` rows; a HySparse SWA branch shares that query, so `1 / c`
  is folded into `swa_k_proj` and its logits do not change. Not with
  qk_norm: a per-head norm between `q_proj` and RoPE breaks the fold.
- **Value maps**: `v_own ≈ A v_full` (a `Dv x Dv` matrix per head), folded
  into the head's `o_proj` columns; a HySparse SWA branch gets `A^-1` in
  `swa_v_proj`. Exact as long as the gates are constant within a head,
  which is why fitted gates are headwise (rows repeated across `Dv`).
- **Head assignment**: query heads are permuted so that each reads the full
  layer's KV group whose keys and values its own are best fitted from. The
  format has no head-to-group map, so q rows, o columns, gate rows and sinks
  move with the head (and a HySparse layer's own SWA KV groups with it:
  there whole groups move, never single heads).
- **Gates** (HySparse sparse layers): per token and head, the mix
  `a o_sa + b o_swa` closest to the teacher's attention output, then a ridge
  fit of `logit(a)`, `logit(b)` on the layer's input (the gates have no
  bias).

Every step is kept only where it beats the copied weights on held-out
calibration tokens (the last quarter of each window), layer by layer; the
report says which were kept and by how much.
"""

import itertools
import math
import sys
from dataclasses import dataclass

import torch

from vllm_hysparse.recovery.folds import (INIT_PREFIX, Record, apply_init, fold_query_map, fold_rows,  # noqa: F401
                                          fold_value_map, init_key, permute_heads)
from vllm_hysparse.recovery.local import teacher_activations
from vllm_hysparse.reference import ops
from vllm_hysparse.reference.fast_ops import fast_reference_ops

HOLDOUT_FRACTION = 0.25
# The steps, in the order they are fitted and applied, and the architectures each applies to.
STEP_ORDER = ("bridges", "kv_maps", "gates")
STEP_ARCHS = {"bridges": ("hysparse2",), "kv_maps": ("hysparse", "hysparse2"), "gates": ("hysparse",)}
# --------------------------------------------------------------------------- the fits


def ridge_lstsq(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-4, bias: bool = False):
    """`(W [dout, din], b [dout] or None)` minimising `‖x Wᵀ + b - y‖² + λ‖W‖²`; x `[N, din]`, y `[N, dout]`.

    `λ = ridge · mean(diag(xᵀx))` makes `ridge` independent of the input's
    scale. Solved in float64 by Cholesky of the normal equations; the bias,
    when asked for, is not penalised (x and y are centred first).
    """
    x64, y64 = x.double(), y.double()
    if bias:
        mx, my = x64.mean(0), y64.mean(0)
        x64, y64 = x64 - mx, y64 - my
    gram = x64.T @ x64
    lam = ridge * float(gram.diagonal().mean().clamp_min(1e-30))
    gram = gram + lam * torch.eye(gram.shape[0], dtype=torch.float64)
    w = torch.linalg.solve(gram, x64.T @ y64).T
    b = (my - w @ mx) if bias else None
    return w, b


def to_pairs(k: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """`[..., D]` -> complex `[..., rotary_dim / 2]`: pair i is dims (i, i + rotary_dim / 2), as RoPE rotates them."""
    half = rotary_dim // 2
    return torch.complex(k[..., :half].double(), k[..., half:rotary_dim].double())


def fit_rope_map(k_src: torch.Tensor, k_dst: torch.Tensor, rotary_dim: int, ridge: float = 1e-4) -> torch.Tensor:
    """Real `[D, D]` map `M` with `k_dst ≈ M k_src` that commutes with RoPE; k_* `[N, D]` (pre-RoPE).

    On each rotated pair `M` multiplies by a complex scalar (a scale and a
    rotation): `c = Σ conj(z_src) z_dst / (Σ |z_src|² + λ)`. Dims past
    `rotary_dim` are not rotated and get a per-dim scale.
    """
    d = k_src.shape[-1]
    zs, zd = to_pairs(k_src, rotary_dim), to_pairs(k_dst, rotary_dim)
    power = (zs.abs() ** 2).sum(0)
    c = (zs.conj() * zd).sum(0) / (power + ridge * power.mean().clamp_min(1e-30))
    half = rotary_dim // 2
    m = torch.zeros(d, d, dtype=torch.float64)
    idx = torch.arange(half)
    m[idx, idx], m[idx, idx + half] = c.real, -c.imag
    m[idx + half, idx], m[idx + half, idx + half] = c.imag, c.real
    if rotary_dim < d:
        rs, rd = k_src[:, rotary_dim:].double(), k_dst[:, rotary_dim:].double()
        p = (rs**2).sum(0)
        rest = torch.arange(rotary_dim, d)
        m[rest, rest] = (rs * rd).sum(0) / (p + ridge * p.mean().clamp_min(1e-30))
    return m


def fit_value_map(v_src: torch.Tensor, v_dst: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """`[Dv, Dv]` map `A` with `v_dst ≈ A v_src` (no intercept: softmax weights do not sum to 1 with a sink)."""
    return ridge_lstsq(v_src, v_dst, ridge)[0]


def _progress(msg: str) -> None:
    print(f"[init] {msg}", file=sys.stderr, flush=True)


def relative_error(pred: torch.Tensor, target: torch.Tensor) -> float:
    return float((pred.double() - target.double()).pow(2).sum() / target.double().pow(2).sum().clamp_min(1e-30))


def group_permutation(cost: torch.Tensor) -> list[int]:
    """`sigma` minimising `Σ_g cost[g, sigma[g]]` (own group g reads full group sigma[g]); brute force up to 7 groups."""
    g = cost.shape[0]
    if g <= 7:
        return list(min(itertools.permutations(range(g)), key=lambda p: float(sum(cost[i, p[i]] for i in range(g)))))
    return greedy_assignment(cost, 1)


def greedy_assignment(cost: torch.Tensor, capacity: int) -> list[int]:
    """Row i -> column: cheapest pairs first, at most `capacity` rows per column."""
    n, g = cost.shape
    out, used = [-1] * n, [0] * g
    for flat in torch.argsort(cost.flatten()).tolist():
        i, j = divmod(flat, g)
        if out[i] < 0 and used[j] < capacity:
            out[i], used[j] = j, used[j] + 1
    return out


def head_assignment(cost: torch.Tensor, capacity: int) -> list[int]:
    """Query head -> KV group `[H]` minimising `Σ cost[h, group[h]]`, `capacity` heads per group.

    Exhaustive over the distinct splits when there are few (9 heads in 3
    groups: 1680), greedy otherwise.
    """
    h, g = cost.shape
    if math.factorial(h) // math.factorial(capacity) ** g > 50_000:
        return greedy_assignment(cost, capacity)
    best, best_cost = None, math.inf
    base = [j for j in range(g) for _ in range(capacity)]
    for perm in set(itertools.permutations(base)):
        c = float(cost[torch.arange(h), torch.tensor(perm)].sum())
        if c < best_cost:
            best, best_cost = list(perm), c
    return best


def slots_for(group_of_head: list[int], capacity: int) -> list[int]:
    """Head order such that new slot `i` (group `i // capacity`) holds a head assigned to that group."""
    order = []
    for g in range(max(group_of_head) + 1):
        order += [h for h, gh in enumerate(group_of_head) if gh == g]
    assert len(order) == len(group_of_head) and all(group_of_head[h] == i // capacity for i, h in enumerate(order))
    return order


# --------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """Teacher residual streams on the calibration windows: `hidden[w][i]` `[1, T, hidden]` enters layer i."""

    hidden: list[list[torch.Tensor]]
    seq_lens: list[int]

    @classmethod
    @torch.no_grad()
    def collect(cls, teacher, windows: list[torch.Tensor]) -> "Calibration":
        acts = [teacher_activations(teacher, w, []) for w in windows]
        return cls([a.hidden for a in acts], [w.shape[1] for w in windows])

    def rows(self, fn) -> tuple[torch.Tensor, torch.Tensor]:
        """`fn(hidden, window)` `[1, T, ...]` on every window -> (fit rows, held-out rows), each `[N, ...]`.

        The last quarter of each window is held out.
        """
        fit, held = [], []
        for w, hidden in enumerate(self.hidden):
            y = fn(hidden, w)[0]
            cut = int(round(y.shape[0] * (1 - HOLDOUT_FRACTION)))
            fit.append(y[:cut])
            held.append(y[cut:])
        return torch.cat(fit), torch.cat(held)


def _split(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.view(*x.shape[:-1], n, -1)


def teacher_kv(teacher, layer: int, h: torch.Tensor, qk_normed: bool = True):
    """The teacher layer's own pre-RoPE K `[.., G, D]` and V `[.., G, Dv]` from the residual stream entering it."""
    t = teacher.model.layers[layer]
    x = t.input_layernorm(h)
    g = teacher.config.num_key_value_heads
    k, v = _split(t.self_attn.k_proj(x), g), _split(t.self_attn.v_proj(x), g)
    if qk_normed and getattr(t.self_attn, "k_norm", None) is not None:
        k = t.self_attn.k_norm(k)
    return k, v


# --------------------------------------------------------------------------- the stage


@torch.no_grad()
def fit_bridges(teacher, student, calib: Calibration, ridge: float, record: Record) -> list[dict]:
    """HySparse2: refit each cross full layer's K/V projection on its bridge source's normed input (into `record`)."""
    cfg, report = student.config, []
    for c, src in cfg.bridge_source.items():
        attn = student.model.layers[c].self_attn
        x_fit, x_held = calib.rows(lambda hid, w: attn.bridge_norm(hid[src]))
        entry = {"layer": c, "source": src}
        for name in ("k_proj", "v_proj"):
            proj = getattr(attn, name)
            tproj = getattr(teacher.model.layers[c].self_attn, name)
            # Pre-norm, pre-RoPE: what the projection itself produces at the teacher's depth.
            y_fit, y_held = calib.rows(lambda hid, w: tproj(teacher.model.layers[c].input_layernorm(hid[c])))
            w_new, b_new = ridge_lstsq(x_fit, y_fit, ridge, bias=proj.bias is not None)
            copied = relative_error(proj(x_held), y_held)
            fitted_pred = x_held.double() @ w_new.T + (b_new if b_new is not None else 0)
            fitted = relative_error(fitted_pred, y_held)
            keep = fitted < copied
            if keep:
                record[init_key(c, f"{name}.weight")] = w_new.float()
                if b_new is not None:
                    record[init_key(c, f"{name}.bias")] = b_new.float()
            entry[name[0]] = {"copied": copied, "fitted": fitted, "kept": keep}
        report.append(entry)
        _progress(f"bridge {src} -> {c}: held-out K error {entry['k']['copied']:.3f} -> {entry['k']['fitted']:.3f}, "
                  f"V {entry['v']['copied']:.3f} -> {entry['v']['fitted']:.3f}")
    return report


def _source_kv(student, calib_hidden, src_layer: int):
    """Pre-RoPE K `[1, T, G, D]` and V of the layer whose cache a sparse layer reads (after any bridge fit)."""
    cfg = student.config
    attn = student.model.layers[src_layer].self_attn
    if cfg.model_type == "hysparse2":
        source = cfg.bridge_source[src_layer]
        return attn.project_kv(attn.bridge_norm(calib_hidden[source]))
    x = student.model.layers[src_layer].input_layernorm(calib_hidden[src_layer])
    k, v = _split(attn.k_proj(x), cfg.num_key_value_heads), _split(attn.v_proj(x), cfg.num_key_value_heads)
    return (attn.k_norm(k) if cfg.qk_norm else k), v


def _query(student, hidden, layer: int):
    attn = student.model.layers[layer].self_attn
    q = _split(attn.q_proj(student.model.layers[layer].input_layernorm(hidden[layer])), student.config.num_attention_heads)
    return attn.q_norm(q) if student.config.qk_norm else q


@torch.no_grad()
def fit_kv_maps(teacher, student, calib: Calibration, ridge: float, record: Record) -> list[dict]:
    """Key / value maps and head assignment for every layer that reads another layer's cache (into `record`)."""
    cfg = student.config
    h, g = cfg.num_attention_heads, cfg.num_key_value_heads
    per = h // g
    rope = student.model.rotary_emb
    rotary_dim = rope.rotary_dim if rope is not None else 0
    with_k = not cfg.qk_norm and rope is not None
    report = []
    for layer, src in cfg.oracle_layer.items():
        ks_fit, ks_held = calib.rows(lambda hid, w: _source_kv(student, hid, src)[0])
        vs_fit, vs_held = calib.rows(lambda hid, w: _source_kv(student, hid, src)[1])
        kd_fit, kd_held = calib.rows(lambda hid, w: teacher_kv(teacher, layer, hid[layer])[0])
        vd_fit, vd_held = calib.rows(lambda hid, w: teacher_kv(teacher, layer, hid[layer])[1])
        q_fit, _ = calib.rows(lambda hid, w: _query(student, hid, layer))
        maps_k, maps_v = {}, {}
        # cost[h, g'] of head h reading full group g': its query-weighted key error plus its value error.
        cost_fit = torch.zeros(h, g, dtype=torch.float64)
        held = {}
        for go in range(g):
            for gf in range(g):
                mk = (fit_rope_map(ks_fit[:, gf], kd_fit[:, go], rotary_dim, ridge) if with_k
                      else torch.eye(cfg.head_dim, dtype=torch.float64))
                av = fit_value_map(vs_fit[:, gf], vd_fit[:, go], ridge)
                maps_k[go, gf], maps_v[go, gf] = mk, av
                rk = kd_fit[:, go].double() - ks_fit[:, gf].double() @ mk.T
                rv = relative_error(vs_fit[:, gf].double() @ av.T, vd_fit[:, go])
                for head in range(go * per, (go + 1) * per):
                    sq = q_fit[:, head].double().T @ q_fit[:, head].double()
                    sk = kd_fit[:, go].double().T @ kd_fit[:, go].double()
                    cost_fit[head, gf] = float(torch.trace(sq @ (rk.T @ rk)) / torch.trace(sq @ sk)) + rv
                held[go, gf] = (relative_error(ks_held[:, gf].double() @ mk.T, kd_held[:, go]),
                                relative_error(vs_held[:, gf].double() @ av.T, vd_held[:, go]))
        copied = [(relative_error(ks_held[:, go], kd_held[:, go]), relative_error(vs_held[:, go], vd_held[:, go]))
                  for go in range(g)]
        if cfg.model_type == "hysparse":
            # The SWA branch's own KV groups move with their heads: whole groups only.
            sigma = group_permutation(cost_fit.view(g, per, g).sum(1))
            group_of_head = [sigma[hd // per] for hd in range(h)]
        else:
            group_of_head = head_assignment(cost_fit, per)
        fitted = [held[hd // per, group_of_head[hd]] for hd in range(h)]
        copied_h = [copied[hd // per] for hd in range(h)]
        kept = sum(f[0] + f[1] for f in fitted) < sum(c[0] + c[1] for c in copied_h)
        entry = {"layer": layer, "source": src, "key_maps": with_k, "kept": kept, "group_of_head": group_of_head,
                 "heldout_k_copied": sum(c[0] for c in copied_h) / h, "heldout_k_fitted": sum(f[0] for f in fitted) / h,
                 "heldout_v_copied": sum(c[1] for c in copied_h) / h, "heldout_v_fitted": sum(f[1] for f in fitted) / h}
        report.append(entry)
        _progress(f"layer {layer} reads {src}: held-out K error {entry['heldout_k_copied']:.3f} -> "
                  f"{entry['heldout_k_fitted']:.3f}, V {entry['heldout_v_copied']:.3f} -> "
                  f"{entry['heldout_v_fitted']:.3f}, heads -> groups {group_of_head}{'' if kept else ' (not kept)'}")
        if not kept:
            continue
        pick = [(hd // per, group_of_head[hd]) for hd in range(h)]
        record[init_key(layer, "q_maps")] = torch.stack([maps_k[p].T for p in pick]).float()
        record[init_key(layer, "o_maps")] = torch.stack([maps_v[p] for p in pick]).float()
        record[init_key(layer, "head_order")] = torch.tensor(slots_for(group_of_head, per))
        if cfg.model_type == "hysparse":
            # The SWA branch keeps its logits and values: the inverse maps go into its own K/V.
            own = [(go, group_of_head[go * per]) for go in range(g)]
            record[init_key(layer, "swa_k_maps")] = torch.stack([torch.linalg.inv(maps_k[p]) for p in own]).float()
            record[init_key(layer, "swa_v_maps")] = torch.stack([torch.linalg.inv(maps_v[p]) for p in own]).float()
            kv_order = [0] * g
            for go in range(g):
                kv_order[group_of_head[go * per]] = go
            record[init_key(layer, "kv_order")] = torch.tensor(kv_order)
            entry["value_map_cond"] = max(float(torch.linalg.cond(maps_v[p])) for p in own)
    return report


def _branches(student, hidden, layer: int, positions):
    """HySparse sparse layer on teacher inputs: (x, o_sa, o_swa, o_target), o_* `[1, T, H, Dv]`.

    `o_target` is the layer's dense attention over its own (folded) SWA K/V,
    i.e. the teacher's attention output in the folded layer's coordinates.
    """
    cfg = student.config
    rope = student.model.rotary_emb
    attn = student.model.layers[layer].self_attn
    x = student.model.layers[layer].input_layernorm(hidden[layer])
    q = rope(_query(student, hidden, layer), positions)
    g = cfg.num_key_value_heads
    k_swa, v_swa = _split(attn.swa_k_proj(x), g), _split(attn.swa_v_proj(x), g)
    if cfg.qk_norm:
        k_swa = attn.swa_k_norm(k_swa)
    k_swa = rope(k_swa, positions)
    src = cfg.oracle_layer[layer]
    k_f, v_f = _source_kv(student, hidden, src)
    k_f = rope(k_f, positions)
    q_f = rope(_query(student, hidden, src), positions)
    ids = ops.oracle_block_topk(q_f, k_f, attn.scale, cfg.sparse_block_size, cfg.sparse_topk_blocks)
    o_sa = ops.block_sparse_attention(q, k_f, v_f, ids, cfg.sparse_block_size, attn.scale, attn.sparse_sinks)
    o_swa = ops.dense_attention(q, k_swa, v_swa, attn.scale, attn.swa_sinks, window=cfg.swa_window)
    o_t = ops.dense_attention(q, k_swa, v_swa, attn.scale)
    return x, o_sa, o_swa, o_t


@torch.no_grad()
def fit_gates(student, calib: Calibration, ridge: float, record: Record, eps: float = 0.02) -> list[dict]:
    """HySparse: headwise gate weights fitted to the per-token mix of the two branches closest to the teacher
    (into `record`, `[H, hidden]` per gate)."""
    cfg = student.config
    h = cfg.num_attention_heads
    report = []
    for layer in cfg.oracle_layer:
        attn = student.model.layers[layer].self_attn
        parts = [[], [], [], []]
        for hidden, t in zip(calib.hidden, calib.seq_lens):
            for acc, val in zip(parts, _branches(student, hidden, layer, torch.arange(t))):
                acc.append(val[0])
        x, o_sa, o_swa, o_t = (torch.cat(p).double() for p in parts)
        # Per token and head: [a, b] = argmin ‖o_t - a o_sa - b o_swa‖², a 2 x 2 system.
        basis = torch.stack([o_sa, o_swa], -1)  # [N, H, Dv, 2]
        gram = basis.transpose(-1, -2) @ basis + 1e-6 * torch.eye(2, dtype=torch.float64)
        ab = torch.linalg.solve(gram, (basis.transpose(-1, -2) @ o_t[..., None]))[..., 0]  # [N, H, 2]
        target = torch.logit(ab.clamp(eps, 1 - eps))
        n = x.shape[0]
        cut = int(round(n * (1 - HOLDOUT_FRACTION)))
        held = torch.zeros(n, dtype=torch.bool)
        start = 0
        for t in calib.seq_lens:
            held[start + int(round(t * (1 - HOLDOUT_FRACTION))): start + t] = True
            start += t
        del cut
        ws = [ridge_lstsq(x[~held], target[~held, :, i], ridge)[0] for i in range(2)]  # [H, hidden] each

        def mix(wa, wb):
            ga = torch.sigmoid(x[held] @ wa.T)[..., None]
            gb = torch.sigmoid(x[held] @ wb.T)[..., None]
            return ga * o_sa[held] + gb * o_swa[held]

        zero = torch.zeros(h, x.shape[1], dtype=torch.float64)
        # Errors after o_proj, where the heads are summed as the model sums them.
        w_o = attn.o_proj.weight.double()
        copied = relative_error(mix(zero, zero).flatten(1) @ w_o.T, o_t[held].flatten(1) @ w_o.T)
        fitted = relative_error(mix(*ws).flatten(1) @ w_o.T, o_t[held].flatten(1) @ w_o.T)
        kept = fitted < copied
        report.append({"layer": layer, "heldout_copied": copied, "heldout_fitted": fitted, "kept": kept,
                       "mean_sparse_gate": float(torch.sigmoid(x[held] @ ws[0].T).mean()),
                       "mean_swa_gate": float(torch.sigmoid(x[held] @ ws[1].T).mean())})
        _progress(f"layer {layer} gates: held-out output error {copied:.3f} -> {fitted:.3f}"
                  f"{'' if kept else ' (not kept)'}")
        if kept:
            record[init_key(layer, "sparse_gate_proj.headwise")] = ws[0].float()
            record[init_key(layer, "swa_gate_proj.headwise")] = ws[1].float()
    return report


def initialise(teacher, student, windows: list[torch.Tensor], *, ridge: float = 1e-4,
               steps: tuple[str, ...] = ("bridges", "kv_maps", "gates")) -> tuple[dict, Record]:
    """Fit `steps` in order into `student` (in place) on teacher activations over `windows` (`[1, T]` each).

    Returns (report, record): `apply_init(converted, record)` turns another
    copy of the converted student into this one.
    """
    bad = set(steps) - set(STEP_ORDER)
    if bad:
        raise ValueError(f"unknown init step(s) {sorted(bad)}; choose from bridges, kv_maps, gates")
    calib = Calibration.collect(teacher, windows)
    report = {"tokens": sum(calib.seq_lens), "windows": len(windows), "ridge": ridge, "steps": list(steps)}
    cfg, record = student.config, {}
    # Each step fits on the student as the previous steps left it (the key maps read the bridged K/V, the
    # gates the folded branches), so each is applied before the next is fitted.
    for step in STEP_ORDER:
        if step not in steps or cfg.model_type not in STEP_ARCHS[step]:
            continue
        part: Record = {}
        if step == "bridges":
            report[step] = fit_bridges(teacher, student, calib, ridge, part)
        elif step == "kv_maps":
            report[step] = fit_kv_maps(teacher, student, calib, ridge, part)
        else:
            # The same math as the reference ops, on fused kernels (tested against them).
            with fast_reference_ops():
                report[step] = fit_gates(student, calib, ridge, part)
        apply_init(student, part)
        record.update(part)
    return report, record


def initialise_checkpoint(teacher_dir, student_dir, text: str, *, tokens: int = 4096, seq_len: int = 2048,
                          ridge: float = 1e-4, steps: tuple[str, ...] = ("bridges", "kv_maps", "gates")):
    """(initialised student, report): load both checkpoints, fit on windows of `text`; writes nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_hysparse.recovery.corpus import windows_of
    from vllm_hysparse.recovery.distill import load_student

    if tokens < seq_len:
        raise ValueError(f"calibration: {tokens} tokens is less than one window of {seq_len}")
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = load_student(str(student_dir), "cpu")
    windows = windows_of(tokenizer, text, seq_len, tokens // seq_len)
    return student, initialise(teacher, student, windows, ridge=ridge, steps=steps)[0]
