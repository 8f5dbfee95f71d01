# SPDX-License-Identifier: Apache-2.0
"""PIC requests in the real vLLM engine (CPU, float32) against the independent reference (SPEC §4).

The reference (`vllm_hysparse.reference.pic`) assembles each prompt from
isolated segment caches in the HF model; the engine splices stored K/V into
vLLM's pages and runs its layers on the recomputed rows only. Engines run
with 64-token steps, so every prompt here is prefilled in chunks that start
and end inside segments and seams, and with vLLM's prefix caching on.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.pic_utils import assemble, delta, generate, state
from tests.vllm_utils import (
    Completion,
    check_logprobs_close,
    env_without,
    make_llm,
    random_prompts,
    reference_greedy,
    shutdown,
)
from vllm_hysparse.reference.pic import pic_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

MAX_TOKENS = 6
ARCHS = {"hysparse": {}, "hysparse2": {}, "hysparse2-rope": {"full_rope": True}}


def reference_pic(model, prompts, layouts, max_tokens=MAX_TOKENS):
    out = []
    for p, lay in zip(prompts, layouts):
        if lay is None:
            out.extend(reference_greedy(model, [p], max_tokens))
        else:
            r = pic_greedy(model, p, lay, max_tokens)
            out.append(Completion(r.token_ids, r.logprobs))
    return out


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch, tmp_path_factory):
    base = arch.split("-")[0]
    return write_checkpoint(tmp_path_factory.mktemp(arch) / "tiny", base, "tiny", seed=5, overrides=ARCHS[arch])


@pytest.fixture(scope="module")
def reference(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(ckpt):
    engine = make_llm(ckpt, own_process=True, enforce_eager=True, block_size=32, max_num_batched_tokens=64,
                      max_num_seqs=8)
    yield engine
    shutdown(engine)


@pytest.fixture(scope="module")
def docs(reference):
    # A prefix, four documents (one shorter than the seam) and two queries.
    lengths = [20, 70, 45, 90, 5, 12, 9]
    return random_prompts(lengths, reference.config.vocab_size, seed=21)


def test_seam_covering_every_segment_is_plain_prefill(llm, reference, docs):
    prefix, d1, d2, d3, _, q, _ = docs
    prompt, lay = assemble([prefix, d1, d2, d3, q], seam=100)
    got = generate(llm, [prompt], [lay])
    plain = reference_greedy(reference, [prompt], MAX_TOKENS)
    assert check_logprobs_close(plain, got, min_matched=1.0) == MAX_TOKENS


@pytest.mark.parametrize("seam", [0, 4, 8])
def test_matches_reference(llm, reference, docs, seam):
    prefix, d1, d2, d3, short, q, _ = docs
    prompts, layouts = zip(*[assemble([prefix, d1, d2, q], seam), assemble([prefix, d3, short, d1, q], seam)])
    got = generate(llm, list(prompts), list(layouts))
    check_logprobs_close(reference_pic(reference, prompts, layouts), got, min_matched=1.0)
    # The semantics are not plain prefill: at seam 0 the first token's distribution moves.
    if seam == 0:
        plain = generate(llm, list(prompts), [None, None])
        assert any(abs(g.logprobs[0][g.token_ids[0]] - p.logprobs[0].get(g.token_ids[0], -99.0)) > 1e-4
                   for g, p in zip(got, plain))


def test_hit_equals_cold_and_counts(llm, reference, docs):
    prefix, d1, d2, d3, _, q, q2 = docs
    # Fresh documents for this test: reversed token order makes them new content.
    fresh = [d[::-1] for d in (d1, d2)]
    prompt, lay = assemble([prefix, *fresh, q], seam=4)
    before = state(llm)
    cold = generate(llm, [prompt], [lay])
    mid = state(llm)
    # vLLM's prefix cache would serve the identical request without scheduling it; the store must.
    assert llm.reset_prefix_cache()
    hit = generate(llm, [prompt], [lay])
    after = state(llm)
    assert cold[0].token_ids == hit[0].token_ids
    for a, b in zip(cold[0].logprobs, hit[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    first, second = delta(mid, before), delta(after, mid)
    assert first["segments_cold"] == 2 and first["segments_hit"] == 0
    assert second["segments_hit"] == 2 and second["segments_cold"] == 0
    spliced = (len(fresh[0]) - 4) + (len(fresh[1]) - 4)
    assert first["tokens_reused"] == second["tokens_reused"] == spliced
    assert second["tokens_recomputed"] == len(prompt) - spliced


def test_reuse_at_new_positions_after_another_prefix(llm, reference, docs):
    prefix, d1, d2, d3, short, q, q2 = docs
    first, lay1 = assemble([prefix, d2, d3, q], seam=8)
    generate(llm, [first], [lay1])
    before = state(llm)
    # Other prefix, other order, another query: both documents are hits at new starts.
    second, lay2 = assemble([q2 + prefix[:7], d3, short, d2, q2], seam=8)
    got = generate(llm, [second], [lay2])
    d = delta(state(llm), before)
    assert d["segments_hit"] == 2 and d["segments_cold"] == 0
    check_logprobs_close(reference_pic(reference, [second], [lay2]), got, min_matched=1.0)


def test_plain_request_after_pic_requests_is_plain(llm, reference, docs):
    prefix, d1, d2, _, _, q, _ = docs
    prompt, lay = assemble([prefix, d1, d2, q], seam=0)
    generate(llm, [prompt, prompt], [lay, lay])
    # Same tokens, no layout: must not hit the PIC request's prefix-cache blocks.
    got = generate(llm, [prompt], [None])
    check_logprobs_close(reference_greedy(reference, [prompt], MAX_TOKENS), got, min_matched=1.0)


def test_concurrent_requests_share_segments(llm, reference, docs):
    prefix, d1, d2, d3, short, q, q2 = docs
    new = [t + 1 for t in d1[:50]]  # unseen content, wanted by all four requests at once
    parts = [[prefix, new, d2, q], [prefix, d2, new, q2], [q2, new, short, q], [prefix, d3, new, d2, q2]]
    prompts, layouts = zip(*[assemble(p, seam=4) for p in parts])
    before = state(llm)
    got = generate(llm, list(prompts), list(layouts))
    d = delta(state(llm), before)
    assert d["segments_cold"] <= 2, d  # `new` once (and d3/d2 at most once each if evicted: they are not)
    check_logprobs_close(reference_pic(reference, prompts, layouts), got, min_matched=1.0)
    assert state(llm)["in_use"] == 0


def test_store_reports_entries_and_bytes(llm, ckpt):
    s = state(llm)
    assert s["public_entries"] > 0 and s["public_bytes"] > 0
    assert s["private_entries"] == 0 and s["in_use"] == 0


@pytest.fixture(scope="module")
def hysparse_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("hs-extra") / "tiny", "hysparse", "tiny", seed=8)


@pytest.fixture(scope="module")
def hysparse_ref(hysparse_ckpt):
    return AutoModelForCausalLM.from_pretrained(hysparse_ckpt, dtype=torch.float32).eval()


def _rag_prompts(vocab: int, seam: int):
    parts = random_prompts([16, 60, 80, 40, 10], vocab, seed=31)
    prefix, a, b, c, q = parts
    layouts = [[prefix, a, b, q], [prefix, b, c, a, q], [q, c, a, q], [prefix, a, c, b, q]]
    return zip(*[assemble(p, seam) for p in layouts])


def test_compiled_engine_matches_reference(hysparse_ckpt, hysparse_ref):
    prompts, layouts = _rag_prompts(hysparse_ref.config.vocab_size, seam=4)
    llm = make_llm(hysparse_ckpt, max_num_batched_tokens=128)
    try:
        got = generate(llm, list(prompts), list(layouts))
    finally:
        shutdown(llm)
    check_logprobs_close(reference_pic(hysparse_ref, prompts, layouts), got, min_matched=1.0)


def test_tiny_store_budget_evicts_and_stays_correct(hysparse_ckpt, hysparse_ref, monkeypatch):
    monkeypatch.setenv("VLLM_HYSPARSE_PIC_PUBLIC_MB", "0.05")  # about one segment of the tiny preset
    prompts, layouts = _rag_prompts(hysparse_ref.config.vocab_size, seam=2)
    llm = make_llm(hysparse_ckpt, own_process=True, enforce_eager=True, block_size=32, max_num_batched_tokens=64,
                   max_num_seqs=1)
    try:
        got = generate(llm, list(prompts), list(layouts))
        s = state(llm)
    finally:
        shutdown(llm)
    assert s["public_evictions"] > 0 and s["public_bytes"] <= 0.05 * 2**20
    assert s["segments_cold"] > 3  # evicted documents come back cold
    check_logprobs_close(reference_pic(hysparse_ref, prompts, layouts), got, min_matched=1.0)


def test_preemption_during_pic_requests(hysparse_ckpt, hysparse_ref):
    prefix, a, b, c, q = random_prompts([16, 40, 54, 54, 10], hysparse_ref.config.vocab_size, seed=41)
    parts = [[prefix, a, b, q], [prefix, b, a, q], [q, c, a, prefix], [prefix, a, c, q]]
    prompts, layouts = zip(*[assemble(p, seam=4) for p in parts])
    # As in the model tests: about 27 pages of 32 tokens cannot hold four requests growing from 120 to 190.
    with env_without("VLLM_CPU_KVCACHE_SPACE"):
        llm = make_llm(hysparse_ckpt, own_process=True, enforce_eager=True, block_size=32,
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
