# SPDX-License-Identifier: Apache-2.0
"""Engine settings our config hooks change (see `vllm_hysparse.models.config_hooks` for the policy)."""

import os

from vllm_hysparse import envs

# vLLM's switch between its model runners (vllm/envs.py); unset, vLLM picks V2 wherever Triton sees a GPU.
V2_RUNNER_ENV = envs.V2_RUNNER.name


def switch_to_v1_model_runner() -> None:
    """Make `VllmConfig.use_v2_model_runner` (vllm/config/vllm.py) false in this process and its children.

    The property reads `envs.VLLM_USE_V2_MODEL_RUNNER` on every call; worker processes
    inherit the environment. Once a service has started, vLLM caches its variables
    (`envs.enable_envs_cache`, vllm/envs.py), so the cache is dropped and refilled.
    """
    from vllm import envs

    os.environ[V2_RUNNER_ENV] = "0"
    if hasattr(envs.__getattr__, "cache_clear"):  # vLLM caches its variables once a service has started
        envs.disable_envs_cache()
        envs.enable_envs_cache()


def choose_default_worker(vllm_config, workers: dict[str, str]) -> None:
    """Set `parallel_config.worker_cls` to `workers[<device type>]` where vLLM would pick its default worker.

    Only while `worker_cls` is "auto" (a user's `--worker-cls` stands) and on the V1 runner
    (our workers extend V1's). Writes `ParallelConfig.worker_cls` (vllm/config/parallel.py),
    read when the executor starts its workers; reads `current_platform.device_type`.
    """
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    worker = workers.get(current_platform.device_type)
    if parallel.worker_cls == "auto" and worker is not None and not vllm_config.use_v2_model_runner:
        parallel.worker_cls = worker
