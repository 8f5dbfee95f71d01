# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding (vLLM's n-gram drafts) in a batch of plain and PIC requests, against the reference.

A verification step runs 1 + k rows per decoding request and samples every one
of them. HySparse2's early exit runs its cross-decoder on those sampled rows
only, and a step that splices PIC segments runs the layers on a subset of the
batch that must keep every sampled row (`pic/runner.py`, `_recompute_pass`).

Drafts are only worth checking when they are accepted. "Forced" requests may
only emit one token (`allowed_token_ids`), so their output is a run of that
token, which the n-gram proposer then drafts, and every draft is accepted.
vLLM returns raw logprobs (before the allowed-token mask), so each position's
logprob of the forced token is compared with the reference fed the same
tokens. The batch also holds free greedy requests and one PIC request whose
chunked prefill shares its steps with the forced requests' verification steps.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.pic_utils import assemble
from tests.vllm_utils import (
    TOP_LOGPROBS,
    Completion,
    check_along,
    make_llm,
    random_prompts,
    reference_along,
    shutdown,
)
from vllm_hysparse.reference.pic import pic_prefill
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

SEED = 1203
DRAFTS = 3
FORCED_TOKENS = 13  # 1 from the prefill step, then verification steps of up to 1 + DRAFTS tokens
FREE_TOKENS = 8
ATOL = 2e-3


@pytest.fixture(scope="module", params=["hysparse", "hysparse2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(arch) / "tiny", arch, "tiny", seed=5)


@pytest.fixture(scope="module")
def reference(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(ckpt):
    # Its own engine-core process: two in-process engines with n-gram drafting in one process trip over
    # vLLM's Triton dispatcher state at the second start.
    engine = make_llm(ckpt, own_process=True, enforce_eager=True, block_size=32, max_num_batched_tokens=64,
                      max_num_seqs=8, disable_log_stats=False,
                      speculative_config={"method": "ngram", "num_speculative_tokens": DRAFTS,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    yield engine
    shutdown(engine)


def _pic_along(model, prompt, layout, tokens) -> list[torch.Tensor]:
    """`reference_along` for a PIC prompt: full float64 logprobs `[vocab]` at each position of `tokens`."""
    lps = []
    with torch.no_grad():
        cache, logits = pic_prefill(model, prompt, layout)
        for i, token in enumerate(tokens):
            lps.append(torch.log_softmax(logits.double(), dim=-1))
            if i + 1 < len(tokens):
                res = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache, logits = res.past_key_values, res.logits[0, -1]
    return lps


def _drafts(llm) -> dict[str, float]:
    names = {"vllm:spec_decode_num_draft_tokens": "drafted", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    return {short: sum(m.value for m in llm.get_metrics() if m.name == name) for name, short in names.items()}


def test_drafts_in_a_mixed_batch_match_reference(llm, reference):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = reference.config.vocab_size
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    forced_tokens = [int(t) for t in torch.randint(vocab, (3,), generator=gen)]
    short = random_prompts([17, 29, 40, 23, 31], vocab, seed=SEED)
    # PIC: a prefix, three documents and a query, ~260 tokens, so its prefill takes several 64-token steps.
    parts = random_prompts([20, 70, 90, 60, 15], vocab, seed=SEED + 1)
    pic_prompt, layout = assemble(parts, seam=4)
    forced_prompts = [short[i] + [t] * 3 for i, t in enumerate(forced_tokens)]
    free_prompts = short[3:]

    def params(max_tokens, allowed=None, lay=None):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True,
                              allowed_token_ids=allowed,
                              extra_args=None if lay is None else
                              {"pic_segments": list(lay.segments), "pic_seam_tokens": lay.seam})

    # Scheduled in this order, 64 tokens a step: the forced requests are verifying drafts while the PIC
    # request's chunks splice its documents.
    prompts = forced_prompts + [pic_prompt] + free_prompts
    sampling = ([params(FORCED_TOKENS, [t]) for t in forced_tokens] + [params(FREE_TOKENS, lay=layout)]
                + [params(FREE_TOKENS)] * len(free_prompts))
    before = _drafts(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    after = _drafts(llm)
    got = [Completion(list(o.outputs[0].token_ids),
                      [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]) for o in outs]
    drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
    print(f"drafts: {drafted:.0f} proposed, {accepted:.0f} accepted")
    # Every forced request drafts from its second decode step on and has all its drafts accepted.
    assert accepted >= len(forced_tokens) * (FORCED_TOKENS - 1 - DRAFTS), (drafted, accepted)

    # Forced requests: every position's raw logprob of the forced token, against the reference along them.
    checked = 0
    for n, (prompt, token) in enumerate(zip(forced_prompts, forced_tokens)):
        assert got[n].token_ids == [token] * FORCED_TOKENS
        ref = reference_along(reference, prompt, got[n].token_ids)
        for i, lp in enumerate(ref):
            diff = abs(float(lp[token]) - got[n].logprobs[i][token])
            assert diff <= ATOL, f"forced request {n}, position {i}: logprob differs by {diff:.4f}"
            checked += 1
    # Free greedy requests, plain and PIC: the engine's own tokens, against the reference fed them.
    free = got[len(forced_prompts):]
    refs = [_pic_along(reference, pic_prompt, layout, free[0].token_ids)]
    refs += [reference_along(reference, p, g.token_ids) for p, g in zip(free_prompts, free[1:])]
    agree, _ = check_along(refs, free, atol=ATOL, tie=ATOL)
    total = checked + sum(len(g.token_ids) for g in free)
    print(f"{total} positions checked: {checked} forced, {agree} free positions agree with the reference's best")
    assert checked == len(forced_tokens) * FORCED_TOKENS
    assert agree >= 0.8 * sum(len(g.token_ids) for g in free)
