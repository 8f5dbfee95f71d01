# SPDX-License-Identifier: Apache-2.0
"""The layer plan: `PlanOptions` (None = the default derived from the model's depth), the defaults (the
papers' full-layer periods, HySparse2's self / cross split and bridges), `build_config` (the dense fields
plus the plan, validated by the target config class), and the `--plan` reports of
`python -m vllm_hysparse.recovery.plan`: reading one, checking it fits the source, and merging it under the
options given on the command line.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from vllm_hysparse.configs import HySparse2Config, HySparseConfig
from vllm_hysparse.configs.base import HySparseBaseConfig
from vllm_hysparse.tools.convert.source import F, S, W, load_source_config

CONFIG_CLASSES = {"hysparse": HySparseConfig, "hysparse2": HySparse2Config}


@dataclass
class PlanOptions:
    """Layer plan; None means the default derived from the model's depth."""

    full_period: int | None = None
    full_layers: list[int] | None = None
    block_size: int | None = None
    topk_blocks: int | None = None
    swa_window: int = 128
    gate_type: str = "elementwise"
    num_self_layers: int | None = None
    self_full_layers: list[int] | None = None
    cross_full_layers: list[int] | None = None
    bridge_sources: list[int] | None = None
    topk_tokens: int | None = None
    recent_window: int | None = None


HYSPARSE_ONLY = ("full_period", "full_layers", "block_size", "topk_blocks")
# An option given on the command line drops the `--plan` options chosen under it: a plan's bridge sources
# are self full layers of its own split, its full layers follow its own count.
PLAN_DEPENDENTS = {
    "full_period": ("full_layers",),
    "num_self_layers": ("self_full_layers", "cross_full_layers", "bridge_sources"),
    "self_full_layers": ("bridge_sources",),
    "cross_full_layers": ("bridge_sources",),
}
HYSPARSE2_ONLY = ("num_self_layers", "self_full_layers", "cross_full_layers", "bridge_sources",
                  "topk_tokens", "recent_window")


def default_hysparse_full_layers(num_layers: int, period: int | None = None) -> list[int]:
    """Every `period`-th layer plus the last; period 4 (1:3, 7B paper) below 48 layers, else 12 (1:11, 80B)."""
    period = period or (12 if num_layers >= 48 else 4)
    return sorted({i for i in range(0, num_layers, period)} | {num_layers - 1})


def default_hysparse2_split(num_layers: int) -> int:
    """Self-decoder depth: half the layers, rounded up (25 of 49 in the paper)."""
    if num_layers < 2:
        raise ValueError(f"hysparse2 needs at least 2 layers (a self and a cross decoder); got {num_layers}")
    return (num_layers + 1) // 2


def default_cross_full_layers(num_layers: int, num_self: int) -> list[int]:
    """Cross-decoder blocks of [full, sparse x 5] (paper), [full, sparse x 2] below 16 layers."""
    block = 6 if num_layers >= 16 else 3
    return list(range(num_self, num_layers, block))


def _check_layers(option: str, layers: list[int], lo: int, hi: int, where: str) -> None:
    bad = [i for i in layers if not lo <= i < hi]
    if bad:
        raise ValueError(f"plan: --{option} has layer(s) {bad} outside {where} [{lo}, {hi})")
    if len(set(layers)) != len(layers):
        raise ValueError(f"plan: --{option} lists a layer twice: {layers}")


def _or(value, default):
    return default if value is None else value


def hysparse_plan(num_layers: int, opts: PlanOptions) -> dict:
    if opts.full_period is not None and opts.full_period <= 0:
        raise ValueError(f"plan: --full-period must be a positive integer (got {opts.full_period})")
    full = opts.full_layers
    if full is None:
        full = default_hysparse_full_layers(num_layers, opts.full_period)
    _check_layers("full-layers", full, 0, num_layers, "the model's layers")
    return {
        "layer_types": [F if i in full else S for i in range(num_layers)],
        "sparse_block_size": _or(opts.block_size, 64), "sparse_topk_blocks": _or(opts.topk_blocks, 16),
    }


def hysparse2_plan(num_layers: int, opts: PlanOptions) -> dict:
    n_self = opts.num_self_layers
    if n_self is None:
        n_self = default_hysparse2_split(num_layers)
    if not 0 < n_self < num_layers:
        raise ValueError(f"plan: --num-self-layers must be in [1, {num_layers - 1}] (got {n_self})")
    self_full = _or(opts.self_full_layers, [n_self // 2])
    cross_full = opts.cross_full_layers
    if cross_full is None:
        cross_full = default_cross_full_layers(num_layers, n_self)
    _check_layers("self-full-layers", self_full, 0, n_self, "the self-decoder")
    _check_layers("cross-full-layers", cross_full, n_self, num_layers, "the cross-decoder")
    bridges = opts.bridge_sources
    if bridges is None:
        # All bridge from one self full layer (paper): the one nearest the self-decoder's middle.
        mid = min(self_full, key=lambda i: abs(i - n_self // 2), default=0)
        bridges = [mid] * len(cross_full)
    types = [(F if i in self_full else W) if i < n_self else (F if i in cross_full else S)
             for i in range(num_layers)]
    return {
        "layer_types": types, "num_self_decoder_layers": n_self, "bridge_sources": list(bridges),
        "sparse_topk_tokens": _or(opts.topk_tokens, 1024), "recent_window": _or(opts.recent_window, 128),
    }


def build_config(arch: str, fields: dict, opts: PlanOptions) -> HySparseBaseConfig:
    """Target config: the dense fields plus the layer plan, validated by the config class."""
    wrong = HYSPARSE2_ONLY if arch == "hysparse" else HYSPARSE_ONLY
    given = [f"--{name.replace('_', '-')}" for name in wrong if getattr(opts, name) is not None]
    if given:
        raise ValueError(f"plan: {', '.join(given)} do(es) not apply to --arch {arch}")
    if opts.full_period is not None and opts.full_layers is not None:
        raise ValueError("plan: give --full-period or --full-layers, not both")
    num_layers = fields["num_hidden_layers"]
    plan = hysparse_plan(num_layers, opts) if arch == "hysparse" else hysparse2_plan(num_layers, opts)
    if arch == "hysparse2":
        # Dense models are RoPE models: keep RoPE on full/sparse layers and
        # rotate whole heads with the dense theta on sliding layers.
        plan.update(full_rope=True, swa_rope_theta=fields["rope_parameters"]["rope_theta"],
                    swa_rotary_dim=fields["head_dim"])
    try:
        return CONFIG_CLASSES[arch](**fields, **plan, swa_window=opts.swa_window, gate_type=opts.gate_type)
    except ValueError as e:
        raise ValueError(f"plan: {e}") from None


def read_plan(path: str, arch: str) -> dict:
    """A `vllm_hysparse.recovery.plan` report, checked to be one for `arch` whose options are PlanOptions fields."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--plan {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--plan {path}: unreadable ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("options"), dict):
        raise ValueError(f"--plan {path}: no \"options\" (is it a report of python -m vllm_hysparse.recovery.plan?)")
    if report.get("arch") != arch:
        raise ValueError(f"--plan {path} is a plan for --arch {report.get('arch')}, not {arch}")
    unknown = sorted(set(report["options"]) - set(PlanOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"--plan {path}: unknown option(s) {unknown}")
    return report


def plan_file_options(report: dict, path: str, num_layers: int) -> dict:
    """The plan's chosen options, once it is known to fit a model of `num_layers` layers."""
    if report.get("num_hidden_layers") != num_layers:
        raise ValueError(f"--plan {path} was measured on a model of {report.get('num_hidden_layers')} layers; "
                         f"--src has {num_layers}")
    options = report["options"]
    for name, value in options.items():
        if isinstance(value, list):
            bad = [i for i in value if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
            if bad:
                raise ValueError(f"--plan {path}: {name} has layer(s) {bad} outside the model's layers "
                                 f"[0, {num_layers})")
    return options


def plan_options(args, src: str, plan: dict | None) -> PlanOptions:
    """Options given on the command line, over the `--plan` report's chosen options (see PLAN_DEPENDENTS)."""
    given = {name: getattr(args, name) for name in PlanOptions.__dataclass_fields__ if getattr(args, name) is not None}
    chosen = {}
    if plan is not None:
        chosen = dict(plan_file_options(plan, args.plan, load_source_config(Path(src))[1].num_hidden_layers))
        for name in given:
            for dependent in PLAN_DEPENDENTS.get(name, ()):
                chosen.pop(dependent, None)
        print(f"plan: {args.plan} chose {chosen}" + (f"; from the command line: {given}" if given else ""))
    return PlanOptions(**{**chosen, **given})
