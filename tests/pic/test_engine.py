# SPDX-License-Identifier: Apache-2.0
"""PIC requests in the real vLLM engine (CPU, float32) against the independent reference (SPEC §4).

The reference (`vllm_hysparse.reference.pic`) assembles each prompt from
isolated segment caches in the HF model; the engine splices stored K/V into
vLLM's pages and runs its layers on the recomputed rows only. Engines run
with 64-token steps, so every prompt here is prefilled in chunks that start
and end inside segments and seams, and with vLLM's prefix caching on. One
engine per architecture serves every test here; the engines of their own
(compiled, a tiny store, a small KV cache) are in `test_engine_limits.py`.
"""

import pytest

import vllm_hysparse  # noqa: F401
from tests.pic_utils import assemble, delta, generate, reference_pic, state
from tests.vllm_utils import (
    Completion,
    check_logprobs_close,
    random_prompts,
    reference_greedy,
)

MAX_TOKENS = 6
# Ends with the canonical HySparse engine, which tests/models/test_hot_path.py asks for first (`shared_engine`).
ARCHS = {"hysparse2-rope": {"full_rope": True}, "hysparse2": {}, "hysparse": {}}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def engine(arch, shared_engine):
    """(LLM, checkpoint, reference): the canonical engine (tests/conftest.py) of the architecture."""
    return shared_engine(arch.split("-")[0], overrides=ARCHS[arch] or None)


@pytest.fixture(scope="module")
def ckpt(engine):
    return engine[1]


@pytest.fixture(scope="module")
def reference(engine):
    return engine[2]


@pytest.fixture(scope="module")
def llm(engine):
    return engine[0]


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


def test_prompt_logprobs_beside_pic_requests(llm, reference, docs):
    """A plain request asking for prompt logprobs in the same steps as PIC requests (HySparse2: early exit on, so the
    PIC recompute pass must run the cross-decoder on all of its rows); every output against the references."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prefix, d1, d2, d3, short, q, q2 = docs
    pics = [assemble([prefix, d3, d1, q], seam=4), assemble([q2, d2, short, d3, q], seam=8)]
    plain = prefix + d2 + d1 + q2
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True,
                             extra_args={"pic_segments": list(lay.segments), "pic_seam_tokens": lay.seam})
              for _, lay in pics]
    params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True,
                                 prompt_logprobs=1))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in [*(p for p, _ in pics), plain]], params,
                        use_tqdm=False)
    got = [Completion(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                                     for step in o.outputs[0].logprobs]) for o in outs]
    expected = [*reference_pic(reference, [p for p, _ in pics], [lay for _, lay in pics]),
                *reference_greedy(reference, [plain], MAX_TOKENS)]
    assert check_logprobs_close(expected, got, min_matched=1.0) == 3 * MAX_TOKENS
    with torch.no_grad():
        want = torch.log_softmax(reference(torch.tensor([plain]), use_cache=False).logits[0].double(), -1)
    served = outs[2].prompt_logprobs
    assert len(served) == len(plain)
    errors = [abs(served[i][plain[i]].logprob - float(want[i - 1, plain[i]])) for i in range(1, len(plain))]
    assert max(errors) < 2e-3, max(errors)


def test_store_reports_entries_and_bytes(llm, ckpt):
    s = state(llm)
    assert s["public_entries"] > 0 and s["public_bytes"] > 0
    assert s["private_entries"] == 0 and s["in_use"] == 0
