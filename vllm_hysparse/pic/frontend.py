# SPDX-License-Identifier: Apache-2.0
"""PIC request validation and prefix-cache separation in vLLM's frontend (SPEC §4).

`install_pic_frontend()` hooks vLLM 0.32's input processor (through
`vllm_hysparse.vllm_glue.input_processor`), the one place that sees both a
request's sampling params and its prompt token ids (offline
`LLM`/`LLMEngine` and the OpenAI server's `AsyncLLM` alike).
For HySparse / HySparse2 models it

* parses `SamplingParams.extra_args` with `parse_layout`, turning a
  `PICError` into vLLM's `VLLMValidationError(parameter=<field>)`, which the
  OpenAI server answers with HTTP 400 naming the field and `LLM.generate`
  raises as is;
* refuses `prompt_logprobs` for PIC requests (interior rows have no logits);
* sets the engine request's `cache_salt` to a combination of the user's salt
  and the layout's salt, so blocks holding spliced K/V are never served to a
  plain request (or to a PIC request with another layout) with the same tokens;
* hands a user `cache_salt` to the worker as `extra_args["pic_pool_salt"]`, so
  that request's segments live in the store's private pool under that salt.

Plain requests and other models pass through untouched.
"""

from vllm_hysparse.pic.client import TEXT_SEGMENTS_FIELD
from vllm_hysparse.pic.layout import POOL_SALT_FIELD, SEAM_FIELD, SEGMENTS_FIELD, PICError, PICLayout, parse_layout

PIC_MODEL_TYPES = ("hysparse", "hysparse2")
_HOOK_FLAG = "_hysparse_pic_frontend"


def _shown(value, limit: int = 200):
    """A rejected value as the error message shows it: vLLM prints it whole, so long ones are cut."""
    if value is None or isinstance(value, (bool, int, float)) and len(str(value)) <= limit:
        return value
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


def is_pic_model(model_config) -> bool:
    """True for HySparse / HySparse2 checkpoints, the only models PIC applies to."""
    hf_config = getattr(model_config, "hf_config", None)
    return getattr(hf_config, "model_type", None) in PIC_MODEL_TYPES


def pic_cache_salt(layout: PICLayout, user_salt: str | None) -> str:
    """The engine request's prefix-cache salt for a PIC request: the layout's salt, then any user salt."""
    return layout.salt() if not user_salt else f"{layout.salt()}|salt={user_salt}"


def pic_executes(vllm_config) -> bool:
    """True when the engine's workers run PIC (our worker, selected by the config hook unless overridden)."""
    from vllm_hysparse.models.config_hooks import PIC_WORKERS

    return vllm_config.parallel_config.worker_cls in PIC_WORKERS.values()


def check_pic_request(request, executes: bool = True) -> PICLayout | None:
    """Validate a processed `EngineCoreRequest`; salt it if it is a PIC request. Returns its layout or None.

    `executes` says whether the engine's workers run PIC; if not, PIC requests are refused instead
    of being served as plain ones. Raises `VLLMValidationError` naming the offending field.
    """
    from vllm.exceptions import VLLMValidationError

    params = request.sampling_params
    if params is None:
        return None
    extra_args = params.extra_args
    if not extra_args or not (SEGMENTS_FIELD in extra_args or SEAM_FIELD in extra_args
                              or TEXT_SEGMENTS_FIELD in extra_args):
        return None
    if TEXT_SEGMENTS_FIELD in extra_args:
        # Only the OpenAI server's /v1/completions understands it (the middleware replaces it);
        # anywhere else it would silently turn into a plain request.
        raise VLLMValidationError(
            f"{TEXT_SEGMENTS_FIELD}: only understood by the OpenAI server's /v1/completions "
            f"(with an empty prompt); elsewhere send token ids with {SEGMENTS_FIELD}",
            parameter=TEXT_SEGMENTS_FIELD)
    if request.prompt_token_ids is None:
        raise VLLMValidationError(f"{SEGMENTS_FIELD}: PIC needs a prompt of token ids or text, not prompt_embeds",
                                  parameter=SEGMENTS_FIELD, value=_shown(extra_args.get(SEGMENTS_FIELD)))
    try:
        layout = parse_layout(extra_args, len(request.prompt_token_ids))
    except PICError as e:
        raise VLLMValidationError(str(e), parameter=e.field, value=_shown(extra_args.get(e.field))) from None
    if layout is None:
        return None
    if not executes:
        raise VLLMValidationError(
            f"{SEGMENTS_FIELD}: this engine's workers do not run PIC (a custom --worker-cls, or vLLM's V2 "
            "model runner); PIC needs the plugin's worker, which is chosen by default", parameter=SEGMENTS_FIELD,
            value=_shown(extra_args.get(SEGMENTS_FIELD)))
    if params.prompt_logprobs is not None:
        raise VLLMValidationError(
            "prompt_logprobs are not available for PIC requests (pic_segments): spliced and interior "
            "prompt rows are never run through the model, so they have no logits",
            parameter="prompt_logprobs", value=params.prompt_logprobs)
    # Segments of a request with its own salt go to the store's private pool, keyed with the salt; the
    # worker sees only extra_args, so the salt rides there (a client-sent value is never trusted).
    extra_args = {k: v for k, v in extra_args.items() if k != POOL_SALT_FIELD}
    if request.cache_salt:
        extra_args[POOL_SALT_FIELD] = request.cache_salt
    params.extra_args = extra_args
    request.cache_salt = pic_cache_salt(layout, request.cache_salt)
    return layout


def pic_request_check(vllm_config):
    """This engine's check of each processed request: `check_pic_request` for HySparse models, else None."""
    if not is_pic_model(vllm_config.model_config):
        return None
    executes = pic_executes(vllm_config)
    return lambda request: check_pic_request(request, executes)


def install_pic_frontend() -> None:
    """Run `check_pic_request` on every request vLLM's input processor makes for HySparse models. Idempotent."""
    from vllm_hysparse.vllm_glue.input_processor import wrap_process_inputs

    wrap_process_inputs(_HOOK_FLAG, pic_request_check)
