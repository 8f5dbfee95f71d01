# SPDX-License-Identifier: Apache-2.0
"""Per-architecture vLLM config hooks (kept free of model code: the API process imports this)."""

import os

from vllm.logger import init_logger

from vllm_hysparse import envs
from vllm_hysparse.vllm_glue.engine_config import V2_RUNNER_ENV, choose_default_worker, switch_to_v1_model_runner

logger = init_logger("vllm.hysparse")

EARLY_EXIT_ENV = envs.EARLY_EXIT.name


def early_exit_enabled() -> bool:
    return os.environ.get(EARLY_EXIT_ENV, "1") != "0"


# Workers whose model runner executes PIC requests (SPEC §4), by platform.
PIC_WORKERS = {"cpu": "vllm_hysparse.pic.worker.HySparseCPUWorker",
               "cuda": "vllm_hysparse.pic.worker_gpu.HySparseGPUWorker"}


def select_v1_runner(vllm_config) -> None:
    """Model Runner V2 policy: HySparse checkpoints run on the V1 runner unless the user chose a runner.

    vLLM 0.32 picks V2 by itself wherever Triton sees a GPU driver
    (`VllmConfig.use_v2_model_runner`, vllm/config/vllm.py). Our PIC worker and
    runner extend V1's (vllm/v1/worker/gpu_model_runner.py), and V1 is the path
    our tests cover; under V2 every PIC request would be refused. The property
    reads the environment variable on every call, and this hook runs at the
    start of `VllmConfig.__post_init__` (`try_verify_and_update_config`), before
    anything reads it; worker processes inherit the environment. A user who
    sets the variable keeps their choice (V2: PIC requests are refused).
    """
    if os.environ.get(V2_RUNNER_ENV) is not None or not vllm_config.use_v2_model_runner:
        return
    switch_to_v1_model_runner()
    logger.info("HySparse: using vLLM's V1 model runner, which serves PIC requests and is the path this plugin "
                "is tested on (%s=1 chooses V2; PIC requests are then refused)", V2_RUNNER_ENV)


def select_pic_worker(vllm_config) -> None:
    """PIC needs no flag: take our worker where vLLM would pick its default one (on the V1 runner)."""
    select_v1_runner(vllm_config)
    choose_default_worker(vllm_config, PIC_WORKERS)


def check_engine_config(vllm_config) -> None:
    """Refuse, before any worker starts, each with one line: a TP size that neither splits nor replicates
    the KV heads evenly, a pipeline split that separates layers sharing a KV cache, a quantised
    `kv_cache_dtype` our backend cannot store, and a PIC shared tier the engine cannot use."""
    from vllm_hysparse.attention.backend import check_kv_cache_dtype
    from vllm_hysparse.configs.base import tensor_parallel_heads
    from vllm_hysparse.models.pipeline import check_pipeline_split
    from vllm_hysparse.pic.shared import open_shared_tier

    config, parallel = vllm_config.model_config.hf_config, vllm_config.parallel_config
    tensor_parallel_heads(config, parallel.tensor_parallel_size)
    check_pipeline_split(config, parallel.pipeline_parallel_size)
    check_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
    open_shared_tier()


class HySparseConfigUpdater:
    """HySparse: the PIC worker; parallel layout and KV cache dtype checked."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_engine_config(vllm_config)
        select_pic_worker(vllm_config)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return


class HySparse2ConfigUpdater:
    """The PIC worker, the parallel layout and KV cache dtype checked, and vLLM's KV-sharing fast prefill
    (HySparse2's prefill early exit) on by default, off with LoRA."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_engine_config(vllm_config)
        select_pic_worker(vllm_config)
        cache_config = vllm_config.cache_config
        if vllm_config.lora_config is not None:
            # vLLM maps LoRA adapters onto every token row of a step (vllm/lora/punica_wrapper); a cross-decoder
            # that runs on the logits rows only would index that mapping with fewer rows.
            if cache_config.kv_sharing_fast_prefill:
                raise ValueError("HySparse2: LoRA adapters need prefill early exit off: drop "
                                 "--kv-sharing-fast-prefill (enable_lora turns early exit off by itself)")
            if early_exit_enabled():
                logger.info("HySparse2: prefill early exit off, because LoRA is enabled (adapters apply to every "
                            "token row of a step)")
        elif early_exit_enabled() and not cache_config.kv_sharing_fast_prefill:
            cache_config.kv_sharing_fast_prefill = True
            logger.info("HySparse2: prefill early exit on (the cross-decoder runs on the logits rows, and on every "
                        "prompt row of a request that asks for prompt logprobs; %s=0 turns it off)", EARLY_EXIT_ENV)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return
