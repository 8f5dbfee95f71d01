# SPDX-License-Identifier: Apache-2.0
"""HySparse in the real vLLM engine (CPU, float32) against the reference model.

The tiny preset selects 2 blocks of 16 tokens and has a 32-token SWA window,
so the prompt lengths below cross block, selection and window boundaries;
vLLM pages are 32 (eager engine) and 128 tokens (compiled engine), so pages
and sparse blocks differ too.
"""

import pytest
import torch

import vllm_hysparse  # noqa: F401
from tests.pic_utils import MAX_TOKENS as PIC_MAX_TOKENS
from tests.pic_utils import assemble, delta, reference_pic
from tests.pic_utils import generate as pic_generate
from tests.pic_utils import state as pic_state_of
from tests.vllm_utils import (
    check_logprobs_close,
    env_without,
    kv_cache_layout,
    make_llm,
    random_prompts,
    reference_greedy,
    shutdown,
    vllm_greedy,
)

BOUNDARY_LENGTHS = [1, 15, 16, 17, 31, 32, 33, 47, 64, 65, 150, 400]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(tiny_model):
    return tiny_model("hysparse")[0]


@pytest.fixture(scope="module")
def reference(tiny_model):
    return tiny_model("hysparse")[1]


@pytest.fixture(scope="module")
def prompts(reference):
    return random_prompts(BOUNDARY_LENGTHS, reference.config.vocab_size, seed=1)


@pytest.fixture(scope="module")
def expected(reference, prompts):
    return reference_greedy(reference, prompts, MAX_TOKENS)


@pytest.fixture(scope="class")
def eager_llm(shared_engine):
    # The canonical engine (tests/conftest.py): 64-token steps, so the long prompts are prefilled in chunks,
    # batched with the decodes of the short ones.
    return shared_engine("hysparse")[0]


def _counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


class TestEagerEngine:
    """One eager engine for these tests, shut down before the engines of the tests below start (one in-process
    engine at a time)."""

    def test_greedy_matches_reference_with_chunked_prefill(self, eager_llm, prompts, expected):
        check_logprobs_close(expected, vllm_greedy(eager_llm, prompts, MAX_TOKENS))

    def test_prefix_cache_hits_match_reference(self, eager_llm, reference, prompts):
        long_prompt = prompts[-1]
        shared = [long_prompt, long_prompt, long_prompt[:250] + prompts[-2][:60]]
        before = _counter(eager_llm, "vllm:prefix_cache_hits")
        got = [vllm_greedy(eager_llm, [p], MAX_TOKENS)[0] for p in shared]
        assert _counter(eager_llm, "vllm:prefix_cache_hits") - before >= 2 * 224, "expected prefix-cache hits"
        check_logprobs_close(reference_greedy(reference, shared, MAX_TOKENS), got)

    def test_many_concurrent_requests(self, eager_llm, reference):
        many = random_prompts([int(n) for n in torch.randint(1, 200, (24,), generator=torch.Generator().manual_seed(5))],
                              reference.config.vocab_size, seed=2)
        check_logprobs_close(reference_greedy(reference, many, 4), vllm_greedy(eager_llm, many, 4))

    def test_prompt_over_max_model_len_is_rejected_and_engine_keeps_serving(self, eager_llm, prompts, expected):
        from vllm.exceptions import VLLMValidationError

        with pytest.raises(VLLMValidationError, match="maximum context length is 1024 tokens"):
            vllm_greedy(eager_llm, [[100] * 1100], 2)
        check_logprobs_close(expected[:3], vllm_greedy(eager_llm, prompts[:3], MAX_TOKENS))

    def test_kv_cache_matches_spec(self, eager_llm, reference):
        """SPEC §3.4: only full layers own full-length KV; sparse layers share it; SWA caches are windowed."""
        cfg = reference.config
        layout = eager_llm.collective_rpc(kv_cache_layout)[0]
        full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        sparse = [i for i, t in enumerate(cfg.layer_types) if t == "sparse_attention"]
        oracle = {i: max(f for f in full if f < i) for i in sparse}
        assert layout["shared"] == {f"model.layers.{i}.self_attn.attn": f"model.layers.{oracle[i]}.self_attn.attn"
                                    for i in sparse}
        full_groups = [g for g in layout["groups"] if g["type"] == "FullAttentionSpec"]
        owners = {n for g in full_groups for n in g["layers"]} - set(layout["shared"])
        assert owners == {f"model.layers.{i}.self_attn.attn" for i in full}
        windowed = [g for g in layout["groups"] if g["type"] == "SlidingWindowSpec"]
        assert {n for g in windowed for n in g["layers"]} == {f"model.layers.{i}.self_attn.swa_attn" for i in sparse}
        assert all(g["sliding_window"] == cfg.swa_window for g in windowed)
        # Bytes one token of context costs in the full-length caches (float32 K and V).
        per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
        allocated = sum(g["page_size_bytes"] // g["block_size"] * (len(set(g["layers"]) - set(layout["shared"])))
                        for g in full_groups)
        assert allocated == per_layer * len(full)
        # One shared pool: every block is a page of every layer of a group, so the pool holds
        # num_blocks * block_size tokens of full-length context in the configured 1 GiB.
        pool_tokens = layout["num_blocks"] * full_groups[0]["block_size"]
        assert pool_tokens == (1 << 30) // allocated

    def test_sparse_layer_runs_both_branches_in_one_attention_op(self, eager_llm, reference, prompts, expected,
                                                                 monkeypatch):
        """A sparse layer's `attn` op runs its SWA branch too (`fused_window`) and mixes both by their gates
        (`gate_width`, through `run_attention_op`): `swa_attn` owns the window cache and is never called, yet
        prompts longer than the window still match the reference."""
        from vllm.model_executor.layers.attention import Attention

        import vllm_hysparse.models.hysparse as model_file

        called = []
        forward, run_op = Attention.forward, model_file.run_attention_op

        def recording(layer, *args, **kwargs):
            called.append(layer.layer_name)
            return forward(layer, *args, **kwargs)

        def recording_op(layer, *args):
            called.append(layer.layer_name)
            return run_op(layer, *args)

        monkeypatch.setattr(Attention, "forward", recording)
        monkeypatch.setattr(model_file, "run_attention_op", recording_op)
        got = vllm_greedy(eager_llm, prompts[-2:], MAX_TOKENS)  # 150 and 400 tokens, the window is 32
        monkeypatch.undo()
        layers = reference.config.num_hidden_layers
        assert sorted(set(called)) == sorted(f"model.layers.{i}.self_attn.attn" for i in range(layers))
        assert len(called) % layers == 0 and len(called) >= layers * MAX_TOKENS
        check_logprobs_close(expected[-2:], got)

    def test_compiled_matches_eager_and_reference(self, ckpt, eager_llm, prompts, expected):
        # Default compilation (trace once, inductor) and vLLM's default CPU page size.
        llm = make_llm(ckpt)
        try:
            compiled = vllm_greedy(llm, prompts, MAX_TOKENS)
        finally:
            shutdown(llm)
        check_logprobs_close(expected, compiled)
        eager = vllm_greedy(eager_llm, prompts, MAX_TOKENS)
        assert [c.token_ids for c in compiled] == [e.token_ids for e in eager]


def test_preemption_matches_reference(ckpt, reference):
    prompts = random_prompts([120] * 4, reference.config.vocab_size, seed=3)
    # About 27 pages of 32 tokens (shared by the full and two SWA groups) cannot
    # hold four requests growing from 120 to 190 tokens at once.
    with env_without("VLLM_CPU_KVCACHE_SPACE"):
        llm = make_llm(ckpt, enforce_eager=True, block_size=32, kv_cache_memory_bytes=10 * 32 * 2048 * 3,
                       max_model_len=256, disable_log_stats=False)
    try:
        got = vllm_greedy(llm, prompts, 70)
        preempted = _counter(llm, "vllm:num_preemptions")
    finally:
        shutdown(llm)
    assert preempted > 0, "the small KV cache should have forced preemption"
    check_logprobs_close(reference_greedy(reference, prompts, 70), got)


def test_tensor_parallel_matches_reference(ckpt, reference, prompts, expected):
    """Plain and PIC requests at TP = 2 (each rank owns 2 of the 4 heads and 1 of the 2 KV groups, and so half of
    every stored segment's K/V): plain greedy against the reference; PIC requests against the reference's
    isolated-segment assembly (SPEC §4), the second time from the ranks' stores."""
    docs = random_prompts([20, 70, 45, 9], reference.config.vocab_size, seed=31)  # prefix, two documents, query
    prefix, d1, d2, q = docs
    pic_prompts, layouts = zip(*[assemble([prefix, d1, d2, q], 4), assemble([prefix, d2, d1, q], 4)])
    llm = make_llm(ckpt, enforce_eager=True, block_size=32, max_model_len=512, tensor_parallel_size=2)
    try:
        got = vllm_greedy(llm, prompts[:8], MAX_TOKENS)
        cold = pic_generate(llm, list(pic_prompts), list(layouts))
        before = pic_state_of(llm)
        assert llm.reset_prefix_cache()  # else vLLM's prefix cache serves the repeated prompts whole
        hot = pic_generate(llm, list(pic_prompts), list(layouts))
        hits = delta(pic_state_of(llm), before)
    finally:
        shutdown(llm)
    check_logprobs_close(expected[:8], got)
    want = reference_pic(reference, pic_prompts, layouts)
    assert check_logprobs_close(want, cold, min_matched=1.0) == len(want) * PIC_MAX_TOKENS
    assert check_logprobs_close(want, hot, min_matched=1.0) == len(want) * PIC_MAX_TOKENS
    # The second pass took both documents of both prompts from the store (each rank from its own).
    assert hits["segments_hit"] == 4 and hits["segments_cold"] == 0, hits
    assert hits["tokens_reused"] == 2 * (len(d1) - 4 + len(d2) - 4), hits
