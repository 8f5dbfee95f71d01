# SPDX-License-Identifier: Apache-2.0
"""vLLM's tables of attention backends and per-architecture config hooks.

Model classes go through the public `ModelRegistry.register_model`; these two
tables have no public registration beyond what is used here.
"""


def register_attention_backend(name: str, class_path: str) -> None:
    """Add `name` -> `class_path` ("module.Class") to `AttentionBackendEnum`, once per process.

    Lets model layers ask for the backend by name. Depends on `register_backend` and
    `AttentionBackendEnum` (vllm/v1/attention/backends/registry.py); registering a name
    twice would replace the member, so an existing one is left alone.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if name not in AttentionBackendEnum.__members__:
        register_backend(name, class_path)


def register_config_updater(architecture: str, updater: type) -> None:
    """Add `updater` as the `VllmConfig` hook of `architecture` unless one is set.

    vLLM calls `updater.verify_and_update_config(vllm_config)` at the start of
    `VllmConfig.__post_init__` (`try_verify_and_update_config`, vllm/config/vllm.py), the
    one place a model may adjust engine settings (our worker, KV-sharing fast prefill)
    before any worker starts. Writes `MODELS_CONFIG_MAP` (vllm/model_executor/models/config.py).
    """
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    MODELS_CONFIG_MAP.setdefault(architecture, updater)
