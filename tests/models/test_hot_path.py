# SPDX-License-Identifier: Apache-2.0
"""The attention forward of every HySparse role reads no host value (no `.item()`, `.tolist()`, `.cpu()`, ...).

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the
test can patch the tensor methods that copy a value to the host and count the
calls made while any `HySparseAttentionImpl.forward` is on the stack, over
chunked prefills mixed with decodes. The metadata builder may read host
values (once per step); the forward may not.
"""

import threading

import pytest
import torch

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import random_prompts, vllm_greedy
from vllm_hysparse.attention.backend import HySparseAttentionImpl

HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__")


class HostReadCounter:
    """Counts host reads of tensors made inside the attention forward (of this thread)."""

    def __init__(self):
        self.inside = threading.local()
        self.calls: list[str] = []
        self.forwards = 0

    def depth(self) -> int:
        return getattr(self.inside, "depth", 0)

    def patch(self, monkeypatch):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                if self.depth():
                    self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        forward = HySparseAttentionImpl.forward

        def guarded(impl, *args, **kwargs):
            self.inside.depth = self.depth() + 1
            self.forwards += args[4] is not None  # attn_metadata: a real step, not a profiling run
            try:
                return forward(impl, *args, **kwargs)
            finally:
                self.inside.depth -= 1

        monkeypatch.setattr(HySparseAttentionImpl, "forward", guarded)


# `-vdim`: v_head_dim != head_dim (SPEC §2.6), where window and plain full layers run on the `window`
# and `dense` roles too
@pytest.fixture(params=["hysparse", "hysparse2", "hysparse-vdim", "hysparse2-vdim"])
def llm(request, shared_engine):
    arch, _, variant = request.param.partition("-")
    return shared_engine(arch, overrides={"v_head_dim": 32} if variant == "vdim" else None)[0]


def test_counter_sees_a_host_read(monkeypatch):
    counter = HostReadCounter()
    counter.patch(monkeypatch)
    counter.inside.depth = 1
    torch.ones(2).sum().item()
    counter.inside.depth = 0
    torch.ones(2).sum().item()
    assert counter.calls == ["item"]


def test_attention_forward_reads_no_host_value(llm, monkeypatch):
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    # 150- and 90-token prompts are prefilled in 64-token chunks next to the others' decodes
    prompts = random_prompts([150, 3, 90, 1, 20], vocab, seed=3)
    counter = HostReadCounter()
    counter.patch(monkeypatch)
    outs = vllm_greedy(llm, prompts, max_tokens=6)
    monkeypatch.undo()
    assert all(len(o.token_ids) == 6 for o in outs)
    assert counter.forwards >= 20, f"only {counter.forwards} HySparse attention calls: the patch saw no engine steps"
    assert counter.calls == [], f"host reads in the attention forward: {sorted(set(counter.calls))}"
