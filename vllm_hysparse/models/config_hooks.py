# SPDX-License-Identifier: Apache-2.0
"""Per-architecture vLLM config hooks (kept free of model code: the API process imports this)."""

import os

from vllm.logger import init_logger

logger = init_logger("vllm.hysparse")

# `VLLM_HYSPARSE2_EARLY_EXIT=0` runs the cross-decoder on every prompt token, which
# also allows requests for prompt logprobs.
EARLY_EXIT_ENV = "VLLM_HYSPARSE2_EARLY_EXIT"


def early_exit_enabled() -> bool:
    return os.environ.get(EARLY_EXIT_ENV, "1") != "0"


class HySparse2ConfigUpdater:
    """Turns on vLLM's KV-sharing fast prefill, i.e. HySparse2's prefill early exit, by default."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        cache_config = vllm_config.cache_config
        if early_exit_enabled() and not cache_config.kv_sharing_fast_prefill:
            cache_config.kv_sharing_fast_prefill = True
            logger.info("HySparse2: prefill early exit on (cross-decoder runs on logits rows only; "
                        "prompt logprobs need %s=0)", EARLY_EXIT_ENV)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return
