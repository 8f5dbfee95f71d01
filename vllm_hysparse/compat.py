# SPDX-License-Identifier: Apache-2.0
"""Small guards around vLLM 0.32 behaviour that our models depend on."""

from vllm_hysparse.models.config_hooks import EARLY_EXIT_ENV, PIC_WORKERS

_GUARD_FLAG = "_hysparse_prompt_logprobs_guard"
# The integers msgspec can serialise when the client sends a request to the engine core.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _has_unserialisable_int(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not _INT_MIN <= value <= _INT_MAX
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_has_unserialisable_int(v) for v in value)
    if isinstance(value, dict):
        return any(_has_unserialisable_int(k) or _has_unserialisable_int(v) for k, v in value.items())
    return False


_SCALAR_FIELDS: dict[str, type] | None = None  # SamplingParams' public fields typed plain bool / int / float


def _mistyped(value, kind: type) -> bool:
    """What the engine core's typed msgpack decoder refuses: bool only for bool, no bool for int or float."""
    if kind is bool:
        return not isinstance(value, bool)
    if isinstance(value, bool):
        return True
    return not isinstance(value, int if kind is int else (int, float))


def unserialisable_field(params) -> str | None:
    """The first public `SamplingParams` field the engine core could not receive, or None.

    Two ways a request is lost after vLLM 0.32 has registered it (the offline `LLM` then
    waits for it forever): an integer past 64 bits, which msgspec cannot encode, and a
    scalar field of the wrong type (e.g. `ignore_eos=None`), which the engine core's typed
    decoder (v1/serial_utils.py) refuses and drops. `SamplingParams` checks neither type.

    vLLM 0.32 registers a request with its output processor before it serialises it
    for the engine core (v1/engine/llm_engine.py `add_request`, async_llm.py likewise).
    An integer msgspec cannot encode then raises `OverflowError` after registration,
    and the orphaned request never finishes: `LLM.generate` waits for it forever.
    The OpenAI schema range-checks `seed` only; `SamplingParams` checks none.
    """
    global _SCALAR_FIELDS
    if _SCALAR_FIELDS is None:
        import typing

        hints = typing.get_type_hints(type(params))
        _SCALAR_FIELDS = {n: t for n, t in hints.items() if not n.startswith("_") and t in (bool, int, float)}
    for name, kind in _SCALAR_FIELDS.items():
        if _mistyped(getattr(params, name), kind):
            return name
    for name in params.__struct_fields__:
        if not name.startswith("_") and _has_unserialisable_int(getattr(params, name)):
            return name
    return None


def install_prompt_logprobs_guard() -> None:
    """Reject requests that would stop the engine, in the OpenAI server and the offline engine alike.

    Two guards in vLLM's input processor, which runs before a request is registered:
    prompt logprobs under KV-sharing fast prefill (HySparse2's early exit) where our
    runner does not serve them, and fields the engine core could not receive (see
    `unserialisable_field`).

    vLLM's own runner asserts that no request wants prompt logprobs under fast prefill, and
    `LLM.generate` does not check first: such a request kills the worker, and the engine with it.
    Our worker's runner serves them per request (`vllm_glue.runner.FastPrefillPromptLogprobsMixin`),
    so for it the OpenAI server's own refusal (`AsyncLLM.add_request`) is lifted instead. Idempotent.
    """
    from vllm_hysparse.vllm_glue.async_llm import without_fast_prefill, wrap_async_llm_config
    from vllm_hysparse.vllm_glue.input_processor import wrap_validate_params

    wrap_validate_params(_GUARD_FLAG, check_request_params)
    wrap_async_llm_config(_GUARD_FLAG, lambda vllm_config: without_fast_prefill(vllm_config)
                          if vllm_config.cache_config.kv_sharing_fast_prefill
                          and serves_prompt_logprobs(vllm_config) else None)


def serves_prompt_logprobs(vllm_config) -> bool:
    """Whether the engine's runner serves prompt logprobs under fast prefill: our worker, chosen by our config hook
    where vLLM would pick its own (not under a `--worker-cls` of the user's, nor on vLLM's V2 runner)."""
    return vllm_config.parallel_config.worker_cls in PIC_WORKERS.values()


def check_request_params(vllm_config, params) -> None:
    """Raise `VLLMValidationError` for params the engine could not serve (see `install_prompt_logprobs_guard`)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    # `is not None`, not truth: 0 asks for the prompt tokens' own logprobs, and vLLM's
    # own check in AsyncLLM.add_request (v1/engine/async_llm.py) tests truth and lets it by.
    if (isinstance(params, SamplingParams) and params.prompt_logprobs is not None
            and vllm_config.cache_config.kv_sharing_fast_prefill and not serves_prompt_logprobs(vllm_config)):
        raise VLLMValidationError(
            "prompt_logprobs are not available with prefill early exit (KV-sharing fast prefill) outside "
            f"vllm_hysparse's worker (worker_cls={vllm_config.parallel_config.worker_cls}): leave --worker-cls "
            f"at auto, or set {EARLY_EXIT_ENV}=0", parameter="prompt_logprobs", value=params.prompt_logprobs)
    if isinstance(params, SamplingParams) and (name := unserialisable_field(params)) is not None:
        value = getattr(params, name)
        kind = (_SCALAR_FIELDS or {}).get(name)
        why = (f"must be a {kind.__name__}, got {type(value).__name__}" if kind and _mistyped(value, kind)
               else "integers must lie in [-2**63, 2**64 - 1] (vLLM serialises requests with 64-bit integers)")
        raise VLLMValidationError(f"{name}: {why}", parameter=name)
