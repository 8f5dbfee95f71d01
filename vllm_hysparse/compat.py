# SPDX-License-Identifier: Apache-2.0
"""Small guards around vLLM 0.32 behaviour that our models depend on."""

from vllm_hysparse.models.config_hooks import EARLY_EXIT_ENV

_GUARD_FLAG = "_hysparse_prompt_logprobs_guard"


def install_prompt_logprobs_guard() -> None:
    """Reject prompt logprobs under KV-sharing fast prefill in the offline engine too.

    vLLM's async (server) path rejects such requests, but `LLM.generate` sends
    them on and the worker dies on an assertion. Early exit never computes
    logits for earlier prompt rows, so a clear validation error is the only
    correct answer there. Idempotent.
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, _GUARD_FLAG, False):
        return

    def _validate_params(self, params, supported_tasks):
        if (isinstance(params, SamplingParams) and params.prompt_logprobs
                and self.vllm_config.cache_config.kv_sharing_fast_prefill):
            raise VLLMValidationError(
                "prompt_logprobs are not available with prefill early exit (KV-sharing fast prefill): "
                f"the cross-decoder never runs on earlier prompt rows; set {EARLY_EXIT_ENV}=0 to get them",
                parameter="prompt_logprobs", value=params.prompt_logprobs)
        return original(self, params, supported_tasks)

    setattr(_validate_params, _GUARD_FLAG, True)
    InputProcessor._validate_params = _validate_params
