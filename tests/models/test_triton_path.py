# SPDX-License-Identifier: Apache-2.0
"""The Triton kernel path inside the real vLLM engine: `VLLM_HYSPARSE_KERNELS=triton`.

Without a GPU the kernels run under Triton's CPU interpreter, which is slow,
so the prompts are short; they still cross the tiny preset's sparse blocks,
windows and token budget, and are prefilled in chunks next to decodes.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import check_logprobs_close, make_llm, random_prompts, reference_greedy, shutdown, vllm_greedy
from vllm_hysparse.attention.backend import KERNELS_ENV
from vllm_hysparse.tools.make_checkpoint import write_checkpoint


def kernel_paths(worker) -> dict[str, str | None]:
    """Runs in the worker: the kernel path each HySparse attention layer took."""
    from vllm_hysparse.attention.backend import HySparseAttentionImpl

    ctx = worker.model_runner.compilation_config.static_forward_context
    return {name: layer.impl.kernels for name, layer in ctx.items()
            if isinstance(getattr(layer, "impl", None), HySparseAttentionImpl) and layer.impl.role != "kv_owner"}


# `vdim`: v_head_dim != head_dim (SPEC §2.6); every layer then runs on our backend, window and plain full
# layers included. Each architecture runs once (an engine under the interpreter takes minutes): HySparse with
# equal dims, HySparse2 with a separate v_head_dim; tests/kernels covers both layouts for every kernel.
@pytest.mark.parametrize("arch, overrides", [("hysparse", None), ("hysparse2", {"v_head_dim": 32})],
                         ids=["hysparse-same-dims", "hysparse2-vdim"])
def test_triton_kernels_in_engine_match_reference(arch, overrides, tmp_path):
    ckpt = write_checkpoint(tmp_path / arch, arch, "tiny", seed=31, overrides=overrides)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompts = random_prompts([5, 40, 70], reference.config.vocab_size, seed=32)
    with pytest.MonkeyPatch.context() as mp:
        # Inherited by the engine's processes, which import the kernels fresh (so not an in-process engine).
        mp.setenv(KERNELS_ENV, "triton")
        if not torch.cuda.is_available():
            mp.setenv("TRITON_INTERPRET", "1")
        llm = make_llm(ckpt, own_process=True, enforce_eager=True, block_size=32, max_model_len=512,
                       max_num_batched_tokens=64)
    try:
        got = vllm_greedy(llm, prompts, 3)
        paths = llm.collective_rpc(kernel_paths)[0]
    finally:
        shutdown(llm)
    check_logprobs_close(reference_greedy(reference, prompts, 3), got)
    # Every HySparse attention layer ran, and on Triton.
    assert paths and set(paths.values()) == {"triton"}
