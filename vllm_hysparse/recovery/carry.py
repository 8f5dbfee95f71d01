# SPDX-License-Identifier: Apache-2.0
"""Carry a trained delta over to a plan with more full layers.

    python -m vllm_hysparse.recovery carry --delta deltas/smollm2-hysparse --base converted-more-full/ --out delta/

A plan measured on the trained student (`benchmarks/smollm2_layer_swap.py --cumulative ... --write-plan`) keeps
the layers whose conversion costs most as full layers. Converting with it and recovering again from the copy
takes hours on a CPU; most of the trained delta still applies. A layer the new plan keeps full has nothing to
train (it is the teacher's own attention), so its tensors are dropped; every other tensor is kept as trained,
and the base digest is recomputed on the new base so that `apply` and `train --resume` accept it.

The new plan may only add full layers (a layer full in the delta's base and sparse in the new one has no
trained tensors), and nothing but the layer types may differ. A sparse layer whose oracle changes (e.g. layer
19 reading a new full layer 18 instead of 16) keeps factors trained against the old oracle's K/V: the report
lists such layers, since they need training again; a plan that promotes whole runs of layers ending before a
full layer changes no oracle, and the carried student is exactly the layer swap's bound.
"""

import json
from pathlib import Path

from safetensors.torch import save_file

from vllm_hysparse.configs import HySparseConfig
from vllm_hysparse.recovery.delta_io import BASE_CONFIG, DELTA_FILE, REPORT_FILE, read_delta
from vllm_hysparse.recovery.distill import load_student
from vllm_hysparse.recovery.folds import INIT_PREFIX
from vllm_hysparse.recovery.lora import base_digest, check_delta, converted_linears
from vllm_hysparse.tools.staging import check_replaceable, staged_output


def _layer(name: str) -> int:
    return int(name.removeprefix(INIT_PREFIX).split(".")[2])


def plan_change(old: dict, new: dict) -> dict:
    """What a new HySparse base changes against the delta's (both config dicts): the layers it promotes to
    full, and the sparse layers whose oracle moved. Raises a one-line ValueError where the delta cannot carry."""
    if old.get("model_type") != "hysparse" or new.get("model_type") != "hysparse":
        raise ValueError(f"carry: HySparse deltas and bases only (delta base {old.get('model_type')}, "
                         f"new base {new.get('model_type')})")
    differ = sorted(k for k in set(old) | set(new)
                    if k not in ("layer_types", "transformers_version", "_name_or_path") and old.get(k) != new.get(k))
    if differ:
        raise ValueError(f"carry: the new base differs from the delta's in {differ}, not only in its layer types")
    was, now = old["layer_types"], new["layer_types"]
    demoted = [i for i, (a, b) in enumerate(zip(was, now)) if a == "full_attention" and b != "full_attention"]
    if demoted:
        raise ValueError(f"carry: layer(s) {demoted} are full in the delta's base and sparse in the new one "
                         "(nothing was trained for them)")
    promoted = [i for i, (a, b) in enumerate(zip(was, now)) if a != b]
    # sparse layer -> the full layer whose K/V it reads; the new base's sparse layers are sparse in the old one
    before, after = (HySparseConfig.from_dict(c).oracle_layer for c in (old, new))
    moved = {i: [before[i], src] for i, src in sorted(after.items()) if before[i] != src}
    return {"promoted": promoted, "oracle_moved": moved}


def carry(delta: Path, base: str, out: Path, force: bool = False) -> dict:
    """Write `out`: the delta carried over to `base` (see the module docstring). Returns the carry report."""
    check_replaceable(out, force)
    tensors, meta = read_delta(delta)
    config_file = delta / BASE_CONFIG
    if not config_file.is_file():
        raise ValueError(f"{delta}: no {BASE_CONFIG} (the delta's base layout, written by `recovery train`)")
    old = json.loads(config_file.read_text())
    model = load_student(base, "cpu")
    new = json.loads((Path(base) / "config.json").read_text())
    change = plan_change(old, new)
    promoted = set(change["promoted"])
    kept = {k: v for k, v in tensors.items() if _layer(k) not in promoted}
    meta = dict(meta, base_digest=base_digest(model, converted_linears(model)))
    check_delta(model, kept, meta)
    report = {"carried_from": str(delta), "base": str(base), **change,
              "tensors_kept": len(kept), "tensors_dropped": len(tensors) - len(kept)}
    previous = delta / REPORT_FILE
    with staged_output(out) as tmp:
        save_file({k: v.contiguous() for k, v in kept.items()}, str(tmp / DELTA_FILE), metadata=meta)
        history = json.loads(previous.read_text()) if previous.is_file() else {}
        (tmp / REPORT_FILE).write_text(json.dumps({**history, "carry": report}, indent=2))
        (tmp / BASE_CONFIG).write_text((Path(base) / "config.json").read_text())
    return report
