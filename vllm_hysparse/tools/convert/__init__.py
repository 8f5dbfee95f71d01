# SPDX-License-Identifier: Apache-2.0
"""Convert a Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Qwen2-MoE checkpoint into HySparse or HySparse2 (SPEC §5).

    python scripts/convert_checkpoint.py --src Qwen3-8B --dst qwen3-8b-hysparse --arch hysparse --dry-run
    python scripts/convert_checkpoint.py --src model.gguf --dst student --arch hysparse   # GGUF: imported first
    python scripts/convert_checkpoint.py --src Qwen3-8B --dst student --arch hysparse --plan plan.json
        # the layer plan measured on the teacher by `python -m vllm_hysparse.recovery.plan`

Dense layer `i` becomes layer `i` of the target. Full layers keep their
weights; sparse and sliding layers reuse the dense q/k/v/o, with new gates at
zero weight (sigmoid = 0.5) and sinks at -30, and `o_proj` scaled so that a
layer whose branches all equal dense attention reproduces the dense layer
(x1 behind two gated branches, x2 behind one). Weights stream one tensor at a
time from the source shards into output shards of at most `--max-shard-size`,
so memory is bounded by one output shard, not by the model. MoE sources keep
their MLPs as they are (router, experts, shared expert; SPEC §2.6): only the
attention is converted.
"""

# The package is laid out by concern (each module's docstring says what it holds):
#   source.py      the dense source: config, safetensors headers, dense layout
#   plan.py        the layer plan: PlanOptions, defaults, build_config, --plan reports
#   rename.py      the rename table: source tensor -> target tensors (with scale), new tensors
#   conversion.py  Conversion, plan_conversion, describe
#   write.py       convert: staged writing of config, side files and weights
#   identity.py    the identity check against the teacher (--verify)
#   cli.py         build_parser, main
# Shards are written by vllm_hysparse.tools.checkpoint_io, shared with make_checkpoint and import_gguf.
# Every name below was importable from the single module vllm_hysparse/tools/convert.py and stays so.

from vllm_hysparse.tools.checkpoint_io import ShardWriter
from vllm_hysparse.tools.convert.cli import build_parser, calibrator, main
from vllm_hysparse.tools.convert.conversion import Conversion, describe, plan_conversion
from vllm_hysparse.tools.convert.identity import identity_depth, identity_length, identity_switches, verify
from vllm_hysparse.tools.convert.plan import (
    CONFIG_CLASSES,
    HYSPARSE2_ONLY,
    HYSPARSE_ONLY,
    PLAN_DEPENDENTS,
    PlanOptions,
    build_config,
    default_cross_full_layers,
    default_hysparse2_split,
    default_hysparse_full_layers,
    hysparse2_plan,
    hysparse_plan,
    plan_file_options,
    plan_options,
    read_plan,
)
from vllm_hysparse.tools.convert.rename import INIT_RULES, LAYER_NAME, LAYER_RULES, SINK_INIT, Rule, map_name, route
from vllm_hysparse.tools.convert.source import (
    MOE_SOURCES,
    QK_NORM,
    QKV_BIAS,
    SAFETENSORS_DTYPES,
    SOURCE_ARCHITECTURES,
    F,
    S,
    W,
    check_source,
    dense_fields,
    dense_layout,
    load_source_config,
    moe_fields,
    read_headers,
)
from vllm_hysparse.tools.convert.write import COPIED_FILES, check_written, convert, copy_side_files, write_weights

__all__ = [
    "COPIED_FILES", "CONFIG_CLASSES", "HYSPARSE2_ONLY", "HYSPARSE_ONLY", "INIT_RULES", "LAYER_NAME", "LAYER_RULES",
    "MOE_SOURCES", "PLAN_DEPENDENTS", "QKV_BIAS", "QK_NORM", "SAFETENSORS_DTYPES", "SINK_INIT", "SOURCE_ARCHITECTURES",
    "Conversion", "F", "PlanOptions", "Rule", "S", "ShardWriter", "W",
    "build_config", "build_parser", "calibrator", "check_source", "check_written", "convert", "copy_side_files",
    "default_cross_full_layers", "default_hysparse2_split", "default_hysparse_full_layers", "dense_fields",
    "dense_layout", "describe", "hysparse2_plan", "hysparse_plan", "identity_depth", "identity_length",
    "identity_switches", "load_source_config", "main", "map_name", "moe_fields", "plan_conversion",
    "plan_file_options", "plan_options", "read_headers", "read_plan", "route", "verify", "write_weights",
]
