# SPDX-License-Identifier: Apache-2.0
"""vLLM workers whose model runner executes PIC requests (see `vllm_hysparse.pic.runner`).

Our config hook selects these instead of vLLM's "auto" worker for HySparse and
HySparse2 checkpoints, so PIC needs no engine or server flag. The worker is
vLLM's own; only its model runner gains `PICRunnerMixin`,
`vllm_glue.runner.FastPrefillPromptLogprobsMixin` for prompt logprobs under HySparse2's early
exit, and `vllm_glue.runner.CPUSeededSamplingMixin` for seeded requests on CPU; LoRA adapters
are checked against the checkpoint's shapes as they load.
"""

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_hysparse.pic.runner import PICRunnerMixin
from vllm_hysparse.vllm_glue.runner import (
    CPUSeededSamplingMixin,
    FastPrefillPromptLogprobsMixin,
    check_lora_adapters,
    ensure_intermediate_tensors,
    mix_into_runner,
)


def enable_pic(runner) -> None:
    """Give a model runner instance the PIC mixin and per-request prompt logprobs under early exit (once each)."""
    mix_into_runner(runner, FastPrefillPromptLogprobsMixin)
    mix_into_runner(runner, PICRunnerMixin)


def refuse_unfit_adapters(runner) -> None:
    """LoRA adapters whose factors do not fit the served checkpoint get one line (vLLM would load them silently)."""
    def check(factors):
        if (why := runner.get_model().lora_mismatch(factors)) is not None:
            raise ValueError(why)

    check_lora_adapters(runner, check)


class HySparseCPUWorker(CPUWorker):
    def init_device(self):
        super().init_device()
        enable_pic(self.model_runner)
        mix_into_runner(self.model_runner, CPUSeededSamplingMixin)

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        refuse_unfit_adapters(self.model_runner)

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        ensure_intermediate_tensors(self.model_runner)
        return times

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """Under pipeline parallelism, only the layouts vLLM's CPU attention backend reads.

        vLLM's engine asserts that every worker reports the same list, as if
        every rank ran the same backends. A pipeline stage holding only layers
        on our backend (which reads any layout) would report every layout,
        one with `CPU_ATTN` layers only LBHNC, and the engine would not start.
        """
        names = super().get_supported_kv_cache_layouts()
        if self.parallel_config.pipeline_parallel_size == 1:
            return names
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        cpu = {layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()}
        return [name for name in names if name in cpu]
