# SPDX-License-Identifier: Apache-2.0
"""PIC in engines of their own against the independent reference (SPEC §4): compiled, with a store that holds
about one segment, and with a KV cache small enough to preempt PIC requests mid-prefill."""

import pytest

import vllm_hysparse  # noqa: F401
from tests.pic_utils import assemble, generate, reference_pic, state
from tests.vllm_utils import check_logprobs_close, env_without, make_llm, random_prompts, shutdown


@pytest.fixture(scope="module")
def hysparse(tiny_model):
    """(checkpoint, HF reference) of the tiny HySparse model that all three engines serve."""
    return tiny_model("hysparse", 8)


def _rag_prompts(vocab: int, seam: int):
    parts = random_prompts([16, 60, 80, 40, 10], vocab, seed=31)
    prefix, a, b, c, q = parts
    layouts = [[prefix, a, b, q], [prefix, b, c, a, q], [q, c, a, q], [prefix, a, c, b, q]]
    return zip(*[assemble(p, seam) for p in layouts])


def test_compiled_engine_matches_reference(hysparse):
    hysparse_ckpt, hysparse_ref = hysparse
    prompts, layouts = _rag_prompts(hysparse_ref.config.vocab_size, seam=4)
    # Compiled as dynamo traces it with guards dropped (the CPU build's hazard: data-dependent Python frozen into the
    # graph); inductor's own code generation is covered by tests/models/test_hysparse.py.
    llm = make_llm(hysparse_ckpt, inductor=False, max_num_batched_tokens=128)
    try:
        got = generate(llm, list(prompts), list(layouts))
    finally:
        shutdown(llm)
    check_logprobs_close(reference_pic(hysparse_ref, prompts, layouts), got, min_matched=1.0)


def test_tiny_store_budget_evicts_and_stays_correct(hysparse, monkeypatch):
    hysparse_ckpt, hysparse_ref = hysparse
    monkeypatch.setenv("VLLM_HYSPARSE_PIC_PUBLIC_MB", "0.05")  # about one segment of the tiny preset
    prompts, layouts = _rag_prompts(hysparse_ref.config.vocab_size, seam=2)
    llm = make_llm(hysparse_ckpt, enforce_eager=True, block_size=32, max_num_batched_tokens=64, max_num_seqs=1)
    try:
        got = generate(llm, list(prompts), list(layouts))
        s = state(llm)
    finally:
        shutdown(llm)
    assert s["public_evictions"] > 0 and s["public_bytes"] <= 0.05 * 2**20
    assert s["segments_cold"] > 3  # evicted documents come back cold
    check_logprobs_close(reference_pic(hysparse_ref, prompts, layouts), got, min_matched=1.0)


def test_preemption_during_pic_requests(hysparse):
    hysparse_ckpt, hysparse_ref = hysparse
    prefix, a, b, c, q = random_prompts([16, 40, 54, 54, 10], hysparse_ref.config.vocab_size, seed=41)
    parts = [[prefix, a, b, q], [prefix, b, a, q], [q, c, a, prefix], [prefix, a, c, q]]
    prompts, layouts = zip(*[assemble(p, seam=4) for p in parts])
    # As in the model tests: about 27 pages of 32 tokens cannot hold four requests growing from 120 to 190.
    with env_without("VLLM_CPU_KVCACHE_SPACE"):
        llm = make_llm(hysparse_ckpt, enforce_eager=True, block_size=32,
                       kv_cache_memory_bytes=10 * 32 * 2048 * 3, max_model_len=256, max_num_batched_tokens=64,
                       disable_log_stats=False)
    try:
        got = generate(llm, list(prompts), list(layouts), max_tokens=70)
        preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        s = state(llm)
    finally:
        shutdown(llm)
    assert preempted > 0, "the small KV cache should have forced preemption"
    assert s["in_use"] == 0
    check_logprobs_close(reference_pic(hysparse_ref, prompts, layouts, max_tokens=70), got)
