# SPDX-License-Identifier: Apache-2.0
"""vLLM's V1 model runner (vllm/v1/worker/gpu_model_runner.py; the CPU one, cpu_model_runner.py, extends it).

PIC runs inside the runner: a mixin overrides `execute_model` and
`_model_forward`, and the PIC engine builds attention metadata for virtual
batches, taps and redirects KV cache writes. Whatever of that touches the
runner's or its layers' state is here.
"""

import contextlib
from collections.abc import Callable

import numpy as np
import torch


def mix_into_runner(runner, mixin: type) -> None:
    """Give a model runner instance `mixin` first in its MRO (once), keeping its state.

    vLLM's worker builds its runner in `init_device` (vllm/v1/worker/gpu_worker.py,
    cpu_worker.py) with no way to choose the class, so the instance's `__class__` is
    swapped for `PIC<Runner>(mixin, <Runner>)`. The mixin overrides `execute_model`
    and `_model_forward` (vllm/v1/worker/gpu_model_runner.py) and calls them via `super()`.
    """
    cls = type(runner)
    if not issubclass(cls, mixin):
        runner.__class__ = type(f"{mixin.__name__.removesuffix('Mixin')}{cls.__name__}", (mixin, cls), {})


class CPUSeededSamplingMixin:
    """A seeded request's random stream on CPU, whatever the chunking of its prompt (mixed into the runner).

    In a step where a request's prompt is only partly computed (chunked prefill, or a batch over the token
    budget), vLLM samples a token for it anyway and discards it, then rewinds that request's generator so the
    discarded draw leaves no trace: `gen.set_offset(gen.get_offset() - 4)` in `_bookkeeping_sync`
    (vllm/v1/worker/gpu_model_runner.py), offsets of CUDA's Philox generator. torch's CPU generator (MT19937)
    has no offset and raises, and the exception kills the engine core: any request with a `seed` whose
    prefill spans steps shut the server down. Here the state of each such generator is saved before sampling
    (`sample_tokens`) and restored after it, and vLLM's rewind does not see those generators.
    """

    _cpu_generator_states: dict = {}

    def sample_tokens(self, grammar_output):
        batch = self.input_batch
        if not batch.generators:  # no seeded request in the batch: nothing to save
            return super().sample_tokens(grammar_output)
        discarded = np.nonzero(self.discard_request_mask.np[:batch.num_reqs])[0]
        self._cpu_generator_states = {
            int(i): gen.get_state() for i in discarded
            if (gen := batch.generators.get(int(i))) is not None and gen.device.type == "cpu"}
        try:
            return super().sample_tokens(grammar_output)
        finally:
            self._cpu_generator_states = {}

    def _bookkeeping_sync(self, *args, **kwargs):
        saved = self._cpu_generator_states
        if not saved:
            return super()._bookkeeping_sync(*args, **kwargs)
        generators = self.input_batch.generators
        hidden = {i: generators.pop(i) for i in saved}
        for i, gen in hidden.items():
            gen.set_state(saved[i])
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(hidden)


def logits_row_counts(runner, num_draft_tokens) -> np.ndarray:
    """`[num_reqs]` int64: how many of each request's last scheduled rows need logits in this step.

    vLLM samples each request's last scheduled row and, before it, one row per draft token
    (`num_draft_tokens`, `[num_reqs]`; `_prepare_inputs`, vllm/v1/worker/gpu_model_runner.py). A request
    still in `runner.num_prompt_logprobs` (req id -> count, those still prefilling) needs every scheduled
    row: `_get_prompt_logprobs_dict` computes logits from the hidden states of all of them. Under
    KV-sharing fast prefill these are the rows HySparse2's cross-decoder must run on. Reads
    `input_batch.req_id_to_index` and `query_start_loc.np`; loops over the prompt-logprob requests only.
    """
    batch = runner.input_batch
    counts = np.asarray(num_draft_tokens, dtype=np.int64)[:batch.num_reqs] + 1
    qsl = runner.query_start_loc.np
    for rid in runner.num_prompt_logprobs:
        i = batch.req_id_to_index.get(rid)
        if i is not None and i < batch.num_reqs:
            counts[i] = qsl[i + 1] - qsl[i]
    return counts


def last_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The last `counts[i]` rows before each `ends[i]`, in order: `[sum(counts)]` int64."""
    starts = np.repeat(ends - counts, counts)
    return starts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class FastPrefillPromptLogprobsMixin:
    """Prompt logprobs per request under KV-sharing fast prefill (HySparse2's early exit; mixed into the runner).

    vLLM 0.32 runs the layers after the last KV-owning one on the logits rows only (`logits_indices`, one per
    request and draft token) and asserts, in `execute_model` (vllm/v1/worker/gpu_model_runner.py), that no
    request in the batch wants prompt logprobs: the other prompt rows never reach the last layer. Here the rows
    those layers run on are widened for the requests that ask, to every row they have in the step, while the
    sampler keeps vLLM's own `logits_indices`; the rest of the batch still exits early.

    - `_update_states` fills `num_prompt_logprobs`; it is held aside until `_prepare_inputs`, which vLLM
      calls right after the assertion (and put back at the next `_update_states` if the step had no tokens,
      so finished requests are still dropped from it).
    - `_prepare_inputs` returns vLLM's logits rows; the widened rows (`logits_row_counts`) are kept for the
      `_build_attention_metadata` call that follows, which hands them to the KV-sharing layers' builders
      (`logits_indices` and `max_num_sampled_tokens`, read only under fast prefill).
    """

    _held_prompt_logprobs: dict | None = None
    _widened_logits: tuple | None = None

    def _restore_prompt_logprobs(self) -> None:
        if self._held_prompt_logprobs is not None:
            self.num_prompt_logprobs, self._held_prompt_logprobs = self._held_prompt_logprobs, None

    def _update_states(self, scheduler_output):
        self._restore_prompt_logprobs()
        corrections = super()._update_states(scheduler_output)
        if self.cache_config.kv_sharing_fast_prefill and self.num_prompt_logprobs:
            self._held_prompt_logprobs, self.num_prompt_logprobs = self.num_prompt_logprobs, {}
        return corrections

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self._restore_prompt_logprobs()
        logits_indices, spec_decode_metadata, max_sampled = super()._prepare_inputs(scheduler_output,
                                                                                    num_scheduled_tokens)
        self._widened_logits = None
        if self.cache_config.kv_sharing_fast_prefill and self.num_prompt_logprobs:
            num_reqs = self.input_batch.num_reqs
            drafts = (np.zeros(num_reqs, dtype=np.int64) if spec_decode_metadata is None
                      else spec_decode_metadata.num_draft_tokens)
            counts = logits_row_counts(self, drafts)
            rows = last_rows(self.query_start_loc.np[1:num_reqs + 1].astype(np.int64), counts)
            self._widened_logits = (torch.from_numpy(rows).to(logits_indices.device), int(counts.max()))
        return logits_indices, spec_decode_metadata, max_sampled

    def _build_attention_metadata(self, *args, **kwargs):
        widened, self._widened_logits = self._widened_logits, None
        if widened is not None and kwargs.get("logits_indices") is not None:
            kwargs["logits_indices"], kwargs["max_num_sampled_tokens"] = widened
        return super()._build_attention_metadata(*args, **kwargs)


def check_lora_adapters(runner, check: Callable) -> None:
    """Call `check(factors)` on every LoRA adapter the runner loads, before vLLM uses it; it raises to refuse one.

    `factors`: module name -> (lora_a shape, lora_b shape), as `LoRAModel.loras` holds them
    (`LoRALayerWeights`, vllm/lora/lora_weights.py). Wraps the instance attribute `_load_adapter` of
    `runner.lora_manager` (`WorkerLoRAManager`, vllm/lora/worker_manager.py), which `load_lora_model`
    (vllm/v1/worker/lora_model_runner_mixin.py) sets when LoRA is enabled; its errors reach the client as
    vLLM's own (e.g. `/v1/load_lora_adapter`). No-op without LoRA.
    """
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        return
    original = manager._load_adapter

    def _load_adapter(lora_request):
        lora = original(lora_request)
        check({name: (tuple(w.lora_a.shape), tuple(w.lora_b.shape)) for name, w in lora.loras.items()
               if isinstance(w.lora_a, torch.Tensor) and isinstance(w.lora_b, torch.Tensor)})
        return lora

    manager._load_adapter = _load_adapter


def ensure_intermediate_tensors(runner) -> None:
    """The receive buffers of a later pipeline stage, as vLLM's dummy run would allocate them.

    vLLM 0.32's CPU worker runs no dummy forward in eager mode (its warm-up
    returns early without compilation), so on a stage other than the first the
    runner's `intermediate_tensors` stays None and the first step fails an
    assertion in `sync_and_gather_intermediate_tensors` (vllm/v1/worker/gpu_model_runner.py).
    """
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def attention_layers(runner) -> dict:
    """Every attention layer of the runner's model by name (`CompilationConfig.static_forward_context`,
    vllm/config/compilation.py, filled as the layers are built); valid outside a forward context."""
    return runner.compilation_config.static_forward_context


def wrap_kv_cache_update(layer, before: Callable) -> None:
    """Call `before(key, value, slot_mapping)` on every cache write of `layer`, then write as usual.

    vLLM's attention op writes K/V through `layer.impl.do_kv_cache_update(layer, key, value,
    kv_cache, slot_mapping)` (`unified_kv_cache_update`, vllm/model_executor/layers/attention/
    attention.py), called at run time even from a compiled graph; the instance attribute is
    replaced. `key` is `[T, G, D]` with T >= `slot_mapping.shape[0]` (padding rows past it).
    The unwrapped write stays available to `write_kv_unobserved`.
    """
    impl = layer.impl
    original = impl.do_kv_cache_update

    def do_kv_cache_update(layer_, key, value, kv_cache, slot_mapping):
        before(key, value, slot_mapping)
        return original(layer_, key, value, kv_cache, slot_mapping)

    impl.do_kv_cache_update = do_kv_cache_update
    impl.pic_original_kv_update = original


def write_kv_unobserved(layer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """key `[n, G, D]`, value `[n, G, Dv]` -> `layer`'s own cache at `slots [n]`, past `wrap_kv_cache_update`'s tap."""
    layer.impl.pic_original_kv_update(layer, key, value, layer.kv_cache, slots)


@contextlib.contextmanager
def swapped_kv_caches(caches: dict):
    """Point each layer in `caches` (layer -> tensor) at that tensor as its `kv_cache` while the body runs.

    `Attention.kv_cache` (vllm/model_executor/layers/attention/attention.py) is the
    tensor vLLM binds to the layer; its attention op reads it through the forward context's
    layers at run time, so the swap reaches compiled graphs too. Put back afterwards, always.
    """
    saved = {}
    for layer, cache in caches.items():
        saved[layer] = layer.kv_cache
        layer.kv_cache = cache
    try:
        yield
    finally:
        for layer, cache in saved.items():
            layer.kv_cache = cache


def step_block_tables(runner, requests, rows: torch.Tensor, step_slots: dict) -> dict:
    """Per KV cache group id: (the block-table rows of `requests`, this step's slots at batch `rows`).

    `requests` are batch indices (one per virtual request, repeats allowed); the tables
    come from `runner.input_batch.block_table[gid]` (vllm/v1/worker/block_table.py) as
    `[len(requests), pages]` int32, the slots from `step_slots` (`forward_context.slot_mapping()`)
    of each group's first layer, `[len(rows)]` int64.
    """
    device = rows.device
    req_index = torch.as_tensor(requests, dtype=torch.long, device=device)
    tables = {}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        table = runner.input_batch.block_table[gid].get_device_tensor(runner.input_batch.num_reqs)
        tables[gid] = (table.index_select(0, req_index), step_slots[group.layer_names[0]][rows])
    return tables


def build_attention_metadata(runner, query_start_loc, seq_lens, positions: torch.Tensor, block_tables: dict,
                             logits, max_logits: int = 1) -> tuple[dict, dict]:
    """Attention metadata and slot mappings of a virtual batch, for every KV cache group's builders.

    Args:
        query_start_loc: `[V + 1]` int32 host offsets of V virtual requests' rows.
        seq_lens: `[V]` int32 host: each virtual request's context length, its rows included.
        positions: `[T]` the rows' positions, on the runner's device.
        block_tables: group id -> (`[V, pages]` int32 block table, `[T]` int64 slots).
        logits: the rows whose logits are sampled (KV-sharing fast prefill only), at most
            `max_logits` per virtual request.
    Returns:
        (metadata by layer name, slots by layer name), as the forward context holds them.

    Builds `CommonAttentionMetadata` (vllm/v1/attention/backend.py) by hand, as the runner's
    `_build_attention_metadata` would, and runs the runner's `attn_groups` builders
    (`AttentionGroup.build_metadata`, vllm/v1/worker/utils.py) on it.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata

    device = positions.device
    num_v = len(seq_lens)
    qsl_cpu = torch.from_numpy(np.asarray(query_start_loc, dtype=np.int32))
    seq_cpu = torch.from_numpy(np.asarray(seq_lens, dtype=np.int32))
    metadata, slot_by_layer = {}, {}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        table, slot = block_tables[gid]
        cm = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(device), query_start_loc_cpu=qsl_cpu, seq_lens=seq_cpu.to(device),
            seq_lens_cpu_upper_bound=seq_cpu, num_reqs=num_v, num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(np.diff(query_start_loc).max()), max_seq_len=int(seq_cpu.max()),
            block_table_tensor=table, slot_mapping=slot, causal=True, positions=positions,
            is_prefilling=torch.ones(num_v, dtype=torch.bool))
        if runner.cache_config.kv_sharing_fast_prefill:
            cm.logits_indices_padded = torch.as_tensor(logits, dtype=torch.int64, device=device)
            cm.num_logits_indices = len(logits)
            cm.max_logits_per_req = max_logits
        for attn_group in runner.attn_groups[gid]:
            built = attn_group.build_metadata(cm)
            for name in attn_group.layer_names:
                metadata[name] = built
        for name in group.layer_names:
            slot_by_layer[name] = slot
    return metadata, slot_by_layer
