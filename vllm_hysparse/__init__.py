# SPDX-License-Identifier: Apache-2.0
"""vllm_hysparse: HySparse and HySparse2 hybrid sparse attention for vLLM.

Importing the package registers both configs and both reference models with
transformers' Auto classes, so `AutoModelForCausalLM.from_pretrained(dir)`
loads our checkpoints. It touches no GPU and compiles nothing.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from vllm_hysparse.configs import HySparse2Config, HySparseConfig

__version__ = "0.1.0"

_CONFIGS = {"hysparse": HySparseConfig, "hysparse2": HySparse2Config}


def register_transformers() -> None:
    """Register configs and reference models with transformers; safe to call repeatedly."""
    from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM

    models = {HySparseConfig: HySparseForCausalLM, HySparse2Config: HySparse2ForCausalLM}
    for model_type, config_cls in _CONFIGS.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, models[config_cls], exist_ok=True)


def register() -> None:
    """vLLM `general_plugins` entry point; vLLM runs it in every process, so it is idempotent.

    Registers our configs with transformers (so vLLM reads HySparse / HySparse2
    `config.json` without `--trust-remote-code`), our model classes with vLLM's
    registry by lazy "module:Class" strings, our attention backend's name, the
    HySparse2 config hook (early exit on by default), the prompt-logprobs guard,
    the pages-per-query metrics collector and the PIC request API (validation and
    prefix-cache salt in `InputProcessor.process_inputs`; in an API-server process
    the text-level middleware). No model code is imported and no device is touched.

    First the installed vLLM's version is checked against the one the plugin's
    touches of vLLM internals were tested with (`vllm_hysparse.vllm_glue`): an
    older one is refused, a newer one warned about once.
    """
    from vllm_hysparse.vllm_glue import check_vllm_version

    check_vllm_version()
    from vllm import ModelRegistry

    from vllm_hysparse.compat import install_prompt_logprobs_guard
    from vllm_hysparse.metrics import register_collector
    from vllm_hysparse.models.config_hooks import HySparse2ConfigUpdater, HySparseConfigUpdater
    from vllm_hysparse.vllm_glue.registry import register_attention_backend, register_config_updater

    register_transformers()
    ModelRegistry.register_model("HySparseForCausalLM", "vllm_hysparse.models.hysparse:HySparseForCausalLM")
    ModelRegistry.register_model("HySparse2ForCausalLM", "vllm_hysparse.models.hysparse2:HySparse2ForCausalLM")
    register_attention_backend("HYSPARSE", "vllm_hysparse.attention.backend.HySparseAttentionBackend")
    register_config_updater("HySparseForCausalLM", HySparseConfigUpdater)
    register_config_updater("HySparse2ForCausalLM", HySparse2ConfigUpdater)
    install_prompt_logprobs_guard()
    from vllm_hysparse.pic.frontend import install_pic_frontend
    from vllm_hysparse.pic.middleware import install_pic_middleware

    install_pic_frontend()
    install_pic_middleware()
    register_collector()


register_transformers()

__all__ = ["HySparseConfig", "HySparse2Config", "register", "register_transformers", "__version__"]
