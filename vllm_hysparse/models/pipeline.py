# SPDX-License-Identifier: Apache-2.0
"""Pipeline-parallel stage splits of HySparse / HySparse2 models (config logic only: the API process imports it).

vLLM assigns each pipeline stage a contiguous range of layers
(`vllm.distributed.utils.get_pp_indices`: an even split, or the
`VLLM_PP_LAYER_PARTITION` environment variable). Layers that share a KV cache
must be on one stage: vLLM's KV sharing maps a layer onto a cache tensor of
the same worker, and our sparse layers also read the index buffer their full
layer writes in the same forward pass. So every layer `i` in
`config.oracle_layer` must be on the stage of `oracle_layer[i]`:

- HySparse: a block (a full layer and its sparse followers) stays on one stage.
- HySparse2: a cross-decoder block (a cross full layer and its sparse
  followers) stays on one stage. Self-decoder layers own their caches and may
  go anywhere; a bridge is built on the stage of its cross full layer and its
  source residual stream is carried there (see `hysparse2.py`).
"""

from vllm.distributed.utils import get_pp_indices

from vllm_hysparse import envs

PARTITION_ENV = envs.PP_LAYER_PARTITION.name


def stage_ranges(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """`[start, end)` layer range of every pipeline stage, as vLLM's `make_layers` will build them."""
    return [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]


def block_starts(config) -> list[int]:
    """Layers a stage may start at: every layer that shares no cache with a layer before it."""
    return [i for i in range(config.num_hidden_layers) if i not in config.oracle_layer]


def suggest_partition(config, pp_size: int) -> str | None:
    """A `VLLM_PP_LAYER_PARTITION` value close to the even split that keeps blocks together, or None."""
    n, starts = config.num_hidden_layers, block_starts(config)
    cuts, prev = [], 0
    for rank in range(1, pp_size):
        # The even split's boundary, snapped to the nearest block start after the previous cut
        # that still leaves one block start for each remaining stage.
        left = pp_size - rank
        options = [s for s in starts if s > prev and len([t for t in starts if t > s]) >= left - 1]
        if not options:
            return None
        prev = min(options, key=lambda s: (abs(s - rank * n / pp_size), s))
        cuts.append(prev)
    bounds = [0, *cuts, n]
    return ",".join(str(b - a) for a, b in zip(bounds, bounds[1:]))


def check_pipeline_split(config, pp_size: int) -> None:
    """Raise a one-line ValueError if this split puts a layer on another stage than the cache it shares."""
    if pp_size <= 1:
        return
    ranges = stage_ranges(config.num_hidden_layers, pp_size)
    stage = {i: s for s, (a, b) in enumerate(ranges) for i in range(a, b)}
    for layer, owner in sorted(config.oracle_layer.items()):
        if stage[layer] == stage[owner]:
            continue
        split = " | ".join(f"[{a}, {b})" for a, b in ranges)
        fix = suggest_partition(config, pp_size)
        fix = (f"set {PARTITION_ENV}={fix} (layers per stage) so every block starts a stage" if fix else
               f"this model has fewer blocks than pipeline_parallel_size={pp_size}; use fewer stages")
        raise ValueError(
            f"pipeline_parallel_size={pp_size} splits layers {split}, which puts layer {layer} on stage "
            f"{stage[layer]} but layer {owner}, whose KV cache and index buffer it reads, on stage "
            f"{stage[owner]} (vLLM shares KV caches only within a stage); {fix}")
