# SPDX-License-Identifier: Apache-2.0
"""The CUDA twin of `vllm_hysparse.pic.worker` (a separate module: importing it needs vLLM's CUDA build)."""

from vllm.v1.worker.gpu_worker import Worker

from vllm_hysparse.pic.worker import enable_pic, refuse_unfit_adapters


class HySparseGPUWorker(Worker):
    def init_device(self):
        super().init_device()
        enable_pic(self.model_runner)

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        refuse_unfit_adapters(self.model_runner)
