# SPDX-License-Identifier: Apache-2.0
"""vLLM's forward context (vllm/forward_context.py): what the runner sets around each model call.

The model runner sets a `ForwardContext` around every model call; attention
ops read their metadata, layers and slots from it at run time. vLLM's own
models read it too, but its fields are vLLM's internal layout, so every read
and every change is here.
"""

import contextlib
import dataclasses

import torch


def attn_metadata():
    """This step's attention metadata, by layer name (None in a profiling run)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata


def slot_mapping() -> dict:
    """This step's KV cache slots by layer name: layer name -> `[num_tokens]` int64."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().slot_mapping


def attention_layers() -> dict:
    """Every attention layer by name (`ForwardContext.no_compile_layers`)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().no_compile_layers


def attention_layer(name: str):
    """The attention layer called `name`, e.g. the owner of a KV-sharing layer's cache."""
    return attention_layers()[name]


def attention_context(layer_name: str):
    """`(metadata, layer, kv_cache, slot_mapping)` of `layer_name` in this step; metadata and slots are None in a
    profiling run.

    vLLM's own helper for its attention ops (`get_attention_context`,
    vllm/model_executor/layers/attention/attention.py), used by HySparse2's bridge write op and by a HySparse
    sparse layer's op, which runs its SWA branch's layer too.
    """
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(layer_name)


def run_attention_op(layer, query, key, value, output) -> None:
    """`layer`'s attention op on an output buffer the caller made: vLLM's `unified_attention_with_output`
    (vllm/model_executor/layers/attention/attention.py), called as `Attention.forward` calls it.

    `Attention.forward` allocates the output itself; a HySparse sparse layer hands its op a buffer that carries the
    gates of both branches in, so that the op stores their gated sum (`HySparseAttentionImpl`, `gate_width`). Only
    for a layer that writes no cache of its own through vLLM's K/V write op (a KV-sharing layer, or a backend that
    writes inside its forward), whose query needs no quantisation (the HySparse backend takes none).

    query `[T, H * D]`, key `[T, G * D]`, value `[T, G * Dv]`; output: any buffer the layer's backend reads.
    """
    from vllm.model_executor.layers.attention.attention import _encode_layer_name, unified_attention_with_output

    if layer.kv_sharing_target_layer_name is None and not layer.attn_backend.forward_includes_kv_cache_update:
        raise ValueError(f"{layer.layer_name}: its K/V write runs in vLLM's own op; call the layer instead")
    query = query.view(-1, layer.num_heads, layer.head_size)
    key = key.view(-1, layer.num_kv_heads, layer.head_size)
    value = value.view(-1, layer.num_kv_heads, layer.head_size_v)
    if layer.use_direct_call:
        unified_attention_with_output(query, key, value, output, layer.layer_name)
    else:
        torch.ops.vllm.unified_attention_with_output(query, key, value, output, _encode_layer_name(layer.layer_name))


@contextlib.contextmanager
def overridden(attn_metadata, slot_mapping):
    """Run the body under a copy of the current context with other metadata and slots (PIC's virtual batches).

    Depends on `ForwardContext` being a dataclass with `attn_metadata` and `slot_mapping`
    fields and on `override_forward_context` (vllm/forward_context.py).
    """
    from vllm.forward_context import get_forward_context, override_forward_context

    context = dataclasses.replace(get_forward_context(), attn_metadata=attn_metadata, slot_mapping=slot_mapping)
    with override_forward_context(context):
        yield


def fast_prefill_logits(layer_name: str):
    """`(rows, count)` whose logits this step needs, from `layer_name`'s KV-sharing fast-prefill metadata.

    `rows` is `[n]` int64 padded by vLLM to a size it may capture, its first `count` real;
    `(None, None)` in a profiling run or when the layer's metadata is not fast prefill's
    (`KVSharingFastPrefillMetadata`, vllm/v1/attention/backends/utils.py).
    """
    from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata

    metadata = attn_metadata()
    if metadata is None:
        return None, None
    last = metadata[layer_name]
    if isinstance(last, KVSharingFastPrefillMetadata):
        return last.logits_indices_padded, last.num_logits_indices
    return None, None


@contextlib.contextmanager
def batch_described(num_tokens: int):
    """Describe a smaller batch of `num_tokens` rows to vLLM's graph dispatch while the body runs.

    HySparse2's cross-decoder runs on the logits rows only; its compiled graph is
    dispatched (and captured) by `ForwardContext.batch_descriptor` (vllm/forward_context.py),
    which describes the whole step, so it is rewritten (no request count, not uniform)
    and put back afterwards.
    """
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    saved = context.batch_descriptor
    if saved is not None:
        context.batch_descriptor = dataclasses.replace(saved, num_tokens=num_tokens, num_reqs=None, uniform=False)
    try:
        yield
    finally:
        context.batch_descriptor = saved
