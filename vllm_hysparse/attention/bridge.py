# SPDX-License-Identifier: Apache-2.0
"""The KV-bridge write of HySparse2: store bridged K/V into a cross full layer's cache.

The cache is owned by an `Attention` that is never attended directly; its K/V
are computed in the self-decoder pass (from the residual stream entering the
bridge source) and stored here, for every scheduled token, so the
cross-decoder may run on the logits rows only. The op is opaque to
`torch.compile` and declares a mutated argument: inductor removes custom ops
with no used result and no mutation.
"""

import torch
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_hysparse.vllm_glue.forward_context import attention_context

OP_NAME = "hysparse_bridge_kv_write"


def _bridge_kv_write(key: torch.Tensor, value: torch.Tensor, dependency: torch.Tensor, layer_name: str) -> None:
    """key, value `[T, G, D]` -> the pages of `layer_name` at this step's slots; `dependency` is only ordered."""
    _, layer, kv_cache, slot_mapping = attention_context(layer_name)
    if slot_mapping is None:  # profiling run: no cache yet
        return
    layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


def _bridge_kv_write_fake(key, value, dependency, layer_name) -> None:
    return None


# Registered once per process, on import (vLLM imports model code in every worker).
if not hasattr(torch.ops.vllm, OP_NAME):
    direct_register_custom_op(OP_NAME, _bridge_kv_write, mutates_args=["dependency"],
                              fake_impl=_bridge_kv_write_fake)


def bridge_kv_write(key: torch.Tensor, value: torch.Tensor, dependency: torch.Tensor, layer_name: str) -> None:
    getattr(torch.ops.vllm, OP_NAME)(key, value, dependency, layer_name)
