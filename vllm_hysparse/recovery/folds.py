# SPDX-License-Identifier: Apache-2.0
"""Folding linear maps into a layer's existing tensors, and replaying a stage-0 record (`recovery.init`).

Stage 0 never adds a tensor: every fit becomes a change to projections the
checkpoint already has (per-head maps on q rows and o columns, head moves,
replaced bridge K/V and gates). `initialise` records what it did, and
`apply_init` redoes it on another copy of the converted checkpoint, which is
how a recovery delta trained from stage 0 applies to the converted base.
"""

import torch

# What stage 0 did, as tensors keyed `init.<attention module path>.<part>` (float32; orders int64):
# `{k,v}_proj.{weight,bias}` (replaced: bridges), `q_maps` [H, D, D] / `o_maps` [H, Dv, Dv] (folded per head
# into q rows / o columns), `swa_k_maps` / `swa_v_maps` [G, ., .] (into the SWA K/V rows), `head_order` [H]
# and `kv_order` [G] (the head moves), `{sparse,swa}_gate_proj.headwise` [H, hidden] (replaced gates).
# A recovery delta carries it, so that it applies to the converted checkpoint itself.
Record = dict[str, torch.Tensor]
INIT_PREFIX = "init."
INIT_PARTS = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "q_maps", "o_maps", "swa_k_maps",
              "swa_v_maps", "head_order", "kv_order", "sparse_gate_proj.headwise", "swa_gate_proj.headwise")


# Parts that only make sense together: the head maps and their move; the SWA inverses and their group move.
TOGETHER = ({"q_maps", "o_maps", "head_order"}, {"swa_k_maps", "swa_v_maps", "kv_order"})


def init_key(layer: int, part: str) -> str:
    return f"{INIT_PREFIX}model.layers.{layer}.self_attn.{part}"


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """`[n*D, ...]` -> a `[n, D, ...]` view."""
    return t.view(n, -1, *t.shape[1:])


def fold_query_map(q_proj: torch.nn.Linear, head: int, m: torch.Tensor) -> None:
    """Head `head`'s pre-RoPE query becomes `Mᵀ q`, so that `q' · RoPE(k) = q · RoPE(M k)`."""
    fold_rows(q_proj, head, m.T)


@torch.no_grad()
def fold_rows(proj: torch.nn.Linear, group: int, m: torch.Tensor) -> None:
    """Output slice `group` (a head or KV group, `m.shape[0]` wide) of `proj` becomes `m` times it."""
    d = m.shape[0]
    rows = slice(group * d, (group + 1) * d)
    mm = m.to(proj.weight.dtype)
    proj.weight[rows] = mm @ proj.weight[rows]
    if proj.bias is not None:
        proj.bias[rows] = mm @ proj.bias[rows]


@torch.no_grad()
def fold_value_map(o_proj: torch.nn.Linear, head: int, a: torch.Tensor) -> None:
    """`o_proj` reads head `head`'s attention output `o` as `A o`."""
    dv = a.shape[0]
    cols = slice(head * dv, (head + 1) * dv)
    o_proj.weight[:, cols] = o_proj.weight[:, cols] @ a.to(o_proj.weight.dtype)


@torch.no_grad()
def permute_heads(attn, order: list[int], kv_order: list[int] | None = None) -> None:
    """New query head `i` is old head `order[i]`: q rows, o columns, gate rows and sinks move with it.

    `kv_order` likewise permutes the layer's own SWA KV groups (HySparse),
    which must move with their heads for the SWA branch to stay the same.
    """
    cfg = attn.config
    h = cfg.num_attention_heads
    idx = torch.tensor(order)
    for lin in (attn.q_proj,):
        lin.weight.copy_(_heads(lin.weight, h)[idx].reshape(lin.weight.shape))
        if lin.bias is not None:
            lin.bias.copy_(_heads(lin.bias, h)[idx].reshape(lin.bias.shape))
    w = attn.o_proj.weight
    w.copy_(_heads(w.T, h)[idx].reshape(w.T.shape).T)
    for name in ("gate_proj", "sparse_gate_proj", "swa_gate_proj"):
        if hasattr(attn, name):
            g = getattr(attn, name).weight
            g.copy_(_heads(g, h)[idx].reshape(g.shape))
    for name in ("sinks", "sparse_sinks", "swa_sinks"):
        s = getattr(attn, name, None)
        if s is not None:
            s.copy_(s[idx])
    if kv_order is not None:
        gi = torch.tensor(kv_order)
        for lin in (attn.swa_k_proj, attn.swa_v_proj):
            lin.weight.copy_(_heads(lin.weight, cfg.num_key_value_heads)[gi].reshape(lin.weight.shape))
            if lin.bias is not None:
                lin.bias.copy_(_heads(lin.bias, cfg.num_key_value_heads)[gi].reshape(lin.bias.shape))


def _by_layer(model, record: Record) -> dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
    """`{attention path: (module, {part: tensor})}`; one-line ValueError for a key that is not a record's."""
    out: dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]] = {}
    for key, value in record.items():
        path, sep, part = key.removeprefix(INIT_PREFIX).partition(".self_attn.")
        if not key.startswith(INIT_PREFIX) or not sep or part not in INIT_PARTS:
            raise ValueError(f"{key}: not a stage-0 initialisation tensor")
        path = f"{path}.self_attn"
        if path not in out:
            try:
                out[path] = (model.get_submodule(path), {})
            except AttributeError:
                raise ValueError(f"the initialisation names {path}, which the model does not have") from None
        out[path][1][part] = value
    return out


def _expected_shapes(attn, part: str) -> tuple[int, ...]:
    """The shape a record's `part` must have to fit `attn`."""
    h, g = attn.config.num_attention_heads, attn.config.num_key_value_heads
    d, dv = attn.q_proj.out_features // h, attn.o_proj.in_features // h
    if part.startswith(("k_proj.", "v_proj.")):
        return tuple(attn.get_parameter(part).shape)
    return {"q_maps": (h, d, d), "o_maps": (h, dv, dv), "swa_k_maps": (g, d, d), "swa_v_maps": (g, dv, dv),
            "head_order": (h,), "kv_order": (g,), "sparse_gate_proj.headwise": (h, attn.q_proj.in_features),
            "swa_gate_proj.headwise": (h, attn.q_proj.in_features)}[part]


def check_init(model, record: Record) -> dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
    """Raise a one-line ValueError unless `record` fits `model` (names, shapes, orders that are permutations);
    returns the record by layer (`_by_layer`)."""
    layers = _by_layer(model, record)
    for path, (attn, parts) in layers.items():
        for part, value in parts.items():
            try:
                want = _expected_shapes(attn, part)
            except AttributeError:
                raise ValueError(f"{path}: the initialisation's {part} has nothing to act on in this layer") from None
            if tuple(value.shape) != want:
                raise ValueError(f"{path}: the initialisation's {part} is {tuple(value.shape)}, the layer needs {want}")
            if part.endswith("_order") and sorted(value.tolist()) != list(range(want[0])):
                raise ValueError(f"{path}: the initialisation's {part} {value.tolist()} is not a permutation")
        for together in TOGETHER:
            if 0 < len(together & parts.keys()) < len(together):
                raise ValueError(f"{path}: the initialisation has {sorted(together & parts.keys())} without "
                                 f"{sorted(together - parts.keys())}")
    return layers


@torch.no_grad()
def apply_init(model, record: Record) -> None:
    """Apply a stage-0 record (`initialise`'s) to the converted `model`, in place: the same folds, in the same
    order (replaced projections, per-head maps, head moves, gates), so the result is the initialised model.
    The whole record is checked first (`check_init`), so a misfit changes nothing."""
    for attn, parts in check_init(model, record).values():
        _apply_layer(attn, parts)


def _apply_layer(attn, parts: dict[str, torch.Tensor]) -> None:
    cfg = attn.config
    for part, value in parts.items():
        if part.startswith(("k_proj.", "v_proj.")):
            target = attn.get_parameter(part)
            target.copy_(value.to(target.dtype))
    if "q_maps" in parts:
        for hd in range(cfg.num_attention_heads):
            fold_rows(attn.q_proj, hd, parts["q_maps"][hd])
            fold_value_map(attn.o_proj, hd, parts["o_maps"][hd])
        if "swa_k_maps" in parts:
            for go in range(cfg.num_key_value_heads):
                fold_rows(attn.swa_k_proj, go, parts["swa_k_maps"][go])
                fold_rows(attn.swa_v_proj, go, parts["swa_v_maps"][go])
        kv_order = parts.get("kv_order")
        permute_heads(attn, parts["head_order"].tolist(), kv_order.tolist() if kv_order is not None else None)
    for gate in ("sparse_gate_proj", "swa_gate_proj"):
        w = parts.get(f"{gate}.headwise")
        if w is not None:
            proj = getattr(attn, gate)
            rows = proj.weight.shape[0] // w.shape[0]  # Dv (elementwise: repeated) or 1 (headwise)
            proj.weight.copy_(w.repeat_interleave(rows, 0).to(proj.weight.dtype).view_as(proj.weight))
