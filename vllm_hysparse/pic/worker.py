# SPDX-License-Identifier: Apache-2.0
"""vLLM workers whose model runner executes PIC requests (see `vllm_hysparse.pic.runner`).

Our config hook selects these instead of vLLM's "auto" worker for HySparse and
HySparse2 checkpoints, so PIC needs no engine or server flag. The worker is
vLLM's own; only its model runner gains `PICRunnerMixin`.
"""

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_hysparse.pic.runner import PICRunnerMixin


def enable_pic(runner) -> None:
    """Give a model runner instance the PIC mixin (once)."""
    cls = type(runner)
    if not issubclass(cls, PICRunnerMixin):
        runner.__class__ = type(f"PIC{cls.__name__}", (PICRunnerMixin, cls), {})


class HySparseCPUWorker(CPUWorker):
    def init_device(self):
        super().init_device()
        enable_pic(self.model_runner)
