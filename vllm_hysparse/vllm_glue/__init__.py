# SPDX-License-Identifier: Apache-2.0
"""Every place the plugin touches vLLM's internals, and the vLLM versions they were written against.

vLLM's plugin API (`general_plugins`, `ModelRegistry.register_model`, model
and attention-backend classes) does not reach everything HySparse needs: PIC
validates requests in the input processor, splices K/V inside the model
runner, and HySparse2's early exit re-describes the batch to vLLM's graph
dispatch. Each such touch sits in one small function of this package (one
module per area of vLLM), and `TOUCH_POINTS` lists them all with the vLLM
file each depends on. The rest of the plugin calls these functions and never
patches vLLM, swaps its classes, writes its tables or reads its private state
itself (tests/test_vllm_glue.py checks that).

`vllm_0_33.md` beside this file records which touch points still hold in vLLM 0.33.0 (all 29 audited; one changes
behaviour; `run_attention_op`, added later, is not audited) and what else 0.33 breaks.

Importing this package imports nothing from vLLM (the plugin's import stays
light); each function imports what it touches when it runs.
"""

import logging
import re
from dataclasses import dataclass

logger = logging.getLogger("vllm.hysparse")

# vLLM minor versions every touch point was written and tested against (setup.py pins 0.32.0).
TESTED_MINORS = ((0, 32),)
# Older than this, touch points are known to be missing (e.g. `vllm.entrypoints.launchers`, the input
# processor's `_validate_params` with `supported_tasks`, `CommonAttentionMetadata.is_prefilling`).
OLDEST_WORKING = (0, 32)


@dataclass(frozen=True)
class TouchPoint:
    name: str  # "<glue module>.<function>", the function that owns the touch
    vllm_file: str  # the vLLM source file (path under vllm/) the touch depends on
    target: str  # "module:Qualified.name" that must exist in that file, checked by `missing_touch_points`
    does: str  # what it changes or reads, in one line


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    # Requests, before vLLM registers them (offline LLM and the OpenAI server alike).
    TouchPoint("input_processor.wrap_validate_params", "v1/engine/input_processor.py",
               "vllm.v1.engine.input_processor:InputProcessor._validate_params",
               "replaces the class method with one that runs our check first (prompt-logprobs / msgspec guard)"),
    TouchPoint("input_processor.wrap_process_inputs", "v1/engine/input_processor.py",
               "vllm.v1.engine.input_processor:InputProcessor.process_inputs",
               "replaces the class method with one that checks and salts the EngineCoreRequest (PIC frontend)"),
    # The OpenAI server's engine client.
    TouchPoint("async_llm.wrap_async_llm_config", "v1/engine/async_llm.py",
               "vllm.v1.engine.async_llm:AsyncLLM.add_request",
               "replaces AsyncLLM.__init__ with one that gives the client a config view with kv_sharing_fast_prefill "
               "off, so add_request lets prompt logprobs through to our runner"),
    # The OpenAI API server.
    TouchPoint("launcher.add_api_server_middleware", "entrypoints/launchers/app.py",
               "vllm.entrypoints.launchers.app:init_entrypoints_middleware",
               "replaces the module global build_app calls, to add PICTextMiddleware innermost"),
    TouchPoint("launcher.served_vllm_config", "entrypoints/launchers/api_server/app_state.py",
               "vllm.entrypoints.launchers.api_server.app_state:init_app_state",
               "reads app.state.vllm_config / .engine_client (tokenizer) / .args (API keys) in our middleware"),
    TouchPoint("launcher.request_authorized", "entrypoints/serve/middleware/authenticate.py",
               "vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.verify_token",
               "runs vLLM's API-key check, so unauthorised requests reach vLLM's 401 untouched"),
    TouchPoint("launcher.validation_error_response", "entrypoints/serve/exception_handling/error_response.py",
               "vllm.entrypoints.serve.exception_handling.error_response:create_error_response",
               "answers a malformed text-level PIC request with vLLM's own 400 ErrorResponse"),
    # Registries and tables.
    TouchPoint("registry.register_attention_backend", "v1/attention/backends/registry.py",
               "vllm.v1.attention.backends.registry:register_backend",
               "adds HYSPARSE to AttentionBackendEnum"),
    TouchPoint("registry.register_config_updater", "model_executor/models/config.py",
               "vllm.model_executor.models.config:MODELS_CONFIG_MAP",
               "adds our architectures' VllmConfig hooks to vLLM's per-architecture table"),
    # Engine configuration, from those hooks.
    TouchPoint("engine_config.switch_to_v1_model_runner", "envs.py", "vllm.envs:disable_envs_cache",
               "sets VLLM_USE_V2_MODEL_RUNNER=0 and refills vLLM's cached environment"),
    TouchPoint("engine_config.choose_default_worker", "config/parallel.py",
               "vllm.config.parallel:ParallelConfig.worker_cls",
               "sets worker_cls to our PIC worker where vLLM would pick its 'auto' one"),
    # The model runner and its workers.
    TouchPoint("runner.mix_into_runner", "v1/worker/gpu_model_runner.py",
               "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
               "swaps the runner instance's __class__ for a subclass with PICRunnerMixin "
               "(which overrides execute_model and _model_forward)"),
    TouchPoint("runner.CPUSeededSamplingMixin", "v1/worker/gpu_model_runner.py",
               "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync",
               "overrides sample_tokens / _bookkeeping_sync: saves and restores the CPU generators of the step's "
               "discarded draws (discard_request_mask, input_batch.generators) around vLLM's CUDA-only rewind"),
    TouchPoint("runner.FastPrefillPromptLogprobsMixin", "v1/worker/gpu_model_runner.py",
               "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
               "overrides _update_states / _prepare_inputs / _build_attention_metadata: holds num_prompt_logprobs "
               "aside past execute_model's fast-prefill assertion and widens the KV-sharing layers' logits rows"),
    TouchPoint("runner.logits_row_counts", "v1/worker/gpu_model_runner.py",
               "vllm.v1.worker.gpu_model_runner:GPUModelRunner.num_prompt_logprobs",
               "reads num_prompt_logprobs, input_batch.req_id_to_index and query_start_loc for the rows that need "
               "logits"),
    TouchPoint("runner.check_lora_adapters", "lora/worker_manager.py",
               "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
               "wraps the runner's lora_manager._load_adapter (instance attribute) to check each loaded adapter's "
               "factor shapes (LoRAModel.loras)"),
    TouchPoint("runner.ensure_intermediate_tensors", "v1/worker/gpu_model_runner.py",
               "vllm.v1.worker.gpu_model_runner:GPUModelRunner.intermediate_tensors",
               "allocates a later pipeline stage's receive buffers that vLLM's CPU worker skips"),
    TouchPoint("runner.attention_layers", "config/compilation.py",
               "vllm.config.compilation:CompilationConfig.static_forward_context",
               "reads the attention layers by name"),
    TouchPoint("runner.wrap_kv_cache_update", "model_executor/layers/attention/attention.py",
               "vllm.model_executor.layers.attention.attention:unified_kv_cache_update",
               "wraps each KV-owning layer's impl.do_kv_cache_update (the instance attribute "
               "unified_kv_cache_update calls) to record the K/V it writes"),
    TouchPoint("runner.swapped_kv_caches", "model_executor/layers/attention/attention.py",
               "vllm.model_executor.layers.attention.attention:Attention.kv_cache",
               "points layers' kv_cache at scratch caches for PIC's isolated pass, then back"),
    TouchPoint("runner.step_block_tables", "v1/worker/block_table.py",
               "vllm.v1.worker.block_table:BlockTable.get_device_tensor",
               "reads the step's block tables (input_batch.block_table) and slot mappings"),
    TouchPoint("runner.build_attention_metadata", "v1/attention/backend.py",
               "vllm.v1.attention.backend:CommonAttentionMetadata.is_prefilling",
               "builds CommonAttentionMetadata by hand and runs the runner's attn_groups builders on it"),
    # The forward context (set by the runner around each model call).
    TouchPoint("forward_context.attn_metadata", "forward_context.py",
               "vllm.forward_context:ForwardContext.attn_metadata", "reads this step's attention metadata"),
    TouchPoint("forward_context.slot_mapping", "forward_context.py",
               "vllm.forward_context:ForwardContext.slot_mapping", "reads this step's slots by layer"),
    TouchPoint("forward_context.attention_layer", "forward_context.py",
               "vllm.forward_context:ForwardContext.no_compile_layers", "reads attention layers by name"),
    TouchPoint("forward_context.overridden", "forward_context.py", "vllm.forward_context:override_forward_context",
               "runs the model on a virtual batch under a copy of the context with other metadata and slots"),
    TouchPoint("forward_context.batch_described", "forward_context.py",
               "vllm.forward_context:ForwardContext.batch_descriptor",
               "rewrites batch_descriptor while HySparse2's cross-decoder runs on the logits rows"),
    TouchPoint("forward_context.fast_prefill_logits", "v1/attention/backends/utils.py",
               "vllm.v1.attention.backends.utils:KVSharingFastPrefillMetadata",
               "reads the logits rows of KV-sharing fast prefill"),
    TouchPoint("forward_context.attention_context", "model_executor/layers/attention/attention.py",
               "vllm.model_executor.layers.attention.attention:get_attention_context",
               "reads a layer, its metadata, kv_cache and slots (HySparse2's bridge write, HySparse's SWA branch)"),
    TouchPoint("forward_context.run_attention_op", "model_executor/layers/attention/attention.py",
               "vllm.model_executor.layers.attention.attention:unified_attention_with_output",
               "calls a layer's attention op on a buffer of the caller's (HySparse's gates ride in it)"),
)


def _minor(version: str) -> tuple[int, int] | None:
    """`"0.32.1.dev3+g1234"` -> `(0, 32)`; None for what is not a release number (e.g. vLLM's `"dev"`)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


_WARNED = False


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM known to break the touch points; warn once per process about an untested one.

    `version` defaults to the installed `vllm.__version__`. Raises `RuntimeError` (one line) below
    `OLDEST_WORKING`; logs one warning naming every touch point for a version outside `TESTED_MINORS`.
    """
    global _WARNED
    if version is None:
        import vllm

        version = vllm.__version__
    minor = _minor(version)
    if minor in TESTED_MINORS:
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_MINORS)
    if minor is not None and minor < OLDEST_WORKING:
        raise RuntimeError(f"vllm_hysparse needs vLLM {tested}; vLLM {version} is installed and lacks internals the "
                           f"plugin patches (see vllm_hysparse.vllm_glue.TOUCH_POINTS)")
    if _WARNED:
        return
    _WARNED = True
    logger.warning("vllm_hysparse is tested with vLLM %s, not %s; these touches of vLLM internals may break "
                   "(vllm_hysparse.vllm_glue.TOUCH_POINTS): %s", tested, version,
                   ", ".join(tp.name for tp in TOUCH_POINTS))


def missing_touch_points() -> list[str]:
    """Touch points whose vLLM file or target is absent from the installed vLLM: `"name: why"` each.

    A target is found as an attribute, a dataclass field, or an attribute the class sets on `self`.
    """
    import dataclasses
    import importlib
    import inspect
    from pathlib import Path

    import vllm

    root = Path(vllm.__file__).parent
    missing = []
    for tp in TOUCH_POINTS:
        if not (root / tp.vllm_file).is_file():
            missing.append(f"{tp.name}: no vllm/{tp.vllm_file}")
            continue
        module_name, _, qualname = tp.target.partition(":")
        try:
            owner = importlib.import_module(module_name)
        except ImportError as e:
            missing.append(f"{tp.name}: cannot import {module_name} ({e})")
            continue
        *path, last = qualname.split(".")
        try:
            for part in path:
                owner = getattr(owner, part)
        except AttributeError:
            missing.append(f"{tp.name}: no {module_name}:{'.'.join(path)}")
            continue
        if hasattr(owner, last):
            continue
        if dataclasses.is_dataclass(owner) and last in {f.name for f in dataclasses.fields(owner)}:
            continue
        if inspect.isclass(owner) and re.search(rf"\bself\.{re.escape(last)}\s*(:[^=]*)?=", inspect.getsource(owner)):
            continue
        missing.append(f"{tp.name}: no {tp.target}")
    return missing


__all__ = ["TOUCH_POINTS", "TouchPoint", "check_vllm_version", "missing_touch_points"]
