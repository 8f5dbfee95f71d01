# SPDX-License-Identifier: Apache-2.0
"""Every environment variable the plugin reads or sets, with its default and meaning (docs/serving.md,
"Environment variables", shows the same table to users; `tests/test_envs.py` keeps the two and the code in step).

A leaf module: it imports nothing, so every part of the package (and the kernel package's own copy of its one
name, `csrc_triton.cpu_ext.CPU_EXT_ENV`) can use it without import cycles. Modules read the variables themselves,
when they need them: a value set after import (a test, a worker's inherited environment) still counts.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # as the docs say it; "" where unset means "not set"
    meaning: str
    where: str  # the module that reads or sets it


KERNELS = EnvVar("VLLM_HYSPARSE_KERNELS", "`triton` on CUDA, `torch` elsewhere",
                 "which attention kernels run: `triton` (csrc_triton) or `torch` (batched PyTorch); anything else "
                 "is an error", "vllm_hysparse.attention.backend")
CPU_EXT = EnvVar("VLLM_HYSPARSE_CPU_EXT", "1",
                 "`0` keeps the CPU path on PyTorch instead of the small C++ kernels", "csrc_triton.cpu_ext")
EARLY_EXIT = EnvVar("VLLM_HYSPARSE2_EARLY_EXIT", "1",
                    "HySparse2 prefill early exit; `0` runs the cross-decoder on every prompt token",
                    "vllm_hysparse.models.config_hooks")
METRICS = EnvVar("VLLM_HYSPARSE_METRICS", "1", "`0` switches the pages-per-query counters off",
                 "vllm_hysparse.metrics")
# Not VLLM_-prefixed: vLLM warns about every VLLM_* variable it does not know, and this one is set by the plugin.
METRICS_DIR = EnvVar("HYSPARSE_METRICS_DIR", "a private temporary directory",
                     "where worker processes publish their metric counters for the API server's /metrics",
                     "vllm_hysparse.metrics")
PIC_PUBLIC_MB = EnvVar("VLLM_HYSPARSE_PIC_PUBLIC_MB", "1024",
                       "MiB of stored PIC segments shared by all requests (least recently used evicted first)",
                       "vllm_hysparse.pic.store")
PIC_PRIVATE_MB = EnvVar("VLLM_HYSPARSE_PIC_PRIVATE_MB", "256",
                        "MiB of stored PIC segments of requests with a `cache_salt`", "vllm_hysparse.pic.store")
PIC_SHARED = EnvVar("VLLM_HYSPARSE_PIC_SHARED", "unset: no shared tier",
                    "the PIC store's second tier, shared by every instance that names it: a directory path (or "
                    "`file:///path`) or a redis://, rediss:// or unix:// URL; a bad value stops the engine at start "
                    "with one line", "vllm_hysparse.pic.shared")
PIC_SHARED_MB = EnvVar("VLLM_HYSPARSE_PIC_SHARED_MB", "4096",
                       "MiB the shared directory tier may hold (least recently used entries evicted by the writer)",
                       "vllm_hysparse.pic.shared")
CACHE = EnvVar("VLLM_HYSPARSE_CACHE", "`~/.cache/vllm_hysparse`",
               "where built tokenizers (and the SmolLM2 GGUF download) are kept", "vllm_hysparse.tools.tokenizer")
# vLLM's own variables that the plugin reads or sets.
PP_LAYER_PARTITION = EnvVar("VLLM_PP_LAYER_PARTITION", "vLLM's even split",
                            "layers per pipeline stage, e.g. `3,5`; a split that separates layers sharing a KV cache "
                            "is refused with the partition to use", "vllm_hysparse.models.pipeline")
V2_RUNNER = EnvVar("VLLM_USE_V2_MODEL_RUNNER", "unset: the plugin sets `0` for HySparse checkpoints",
                   "vLLM's model runner; unset, the plugin chooses V1 (where PIC runs and our tests run) with one log "
                   "line; `1` keeps vLLM's V2, which refuses PIC requests", "vllm_hysparse.vllm_glue.engine_config")

ENV_VARS = (KERNELS, CPU_EXT, EARLY_EXIT, METRICS, METRICS_DIR, PIC_PUBLIC_MB, PIC_PRIVATE_MB, PIC_SHARED,
            PIC_SHARED_MB, CACHE, PP_LAYER_PARTITION, V2_RUNNER)
