# SPDX-License-Identifier: Apache-2.0
"""PIC requests on an FP8-KV engine (`kv_cache_dtype="fp8"`), with `v_head_dim != head_dim` (SPEC §2.6).

The segment store keeps the K/V each layer was about to write (before
quantisation, `pic.runner.KVTap`): a splice rotates K in full precision and the
layer's own cache write quantises it, so no value is quantised twice. K and V
are stored at their own widths. Compared with the reference PIC
(`vllm_hysparse.reference.pic`) assembling its cache in an `Fp8KVCache`: rows
rounded as the engine's cache write rounds them (spliced rows after their
rotation), isolated segments attending to rounded K/V while the store keeps
them unrounded; the reference follows the engine's tokens, so every position is
compared (`tests/models/test_fp8_kv.py`). The second pass of the same prompts is
served from the store and must give the same tokens as the first.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.pic_utils import assemble, delta, generate, state
from tests.vllm_utils import FP8_EXACT_ATOL, check_along, fp8_engine, random_prompts, truncating_fp8_layers
from vllm_hysparse.reference.layers import Fp8KVCache
from vllm_hysparse.reference.pic import pic_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

MAX_TOKENS = 6

HEAD_DIM, V_HEAD_DIM = 64, 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("pic-fp8") / "tiny", "hysparse", "tiny", seed=9,
                            overrides={"head_dim": HEAD_DIM, "v_head_dim": V_HEAD_DIM})


@pytest.fixture(scope="module")
def reference(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(ckpt):
    yield from fp8_engine(ckpt)


def test_pic_matches_reference_and_store_hits(llm, reference):
    assert reference.config.v_head_dim == V_HEAD_DIM != reference.config.head_dim
    # 24-token prompts + 6 tokens: within the selection budget (see tests/models/test_fp8_kv.py)
    prefix, a, b, c, q = random_prompts([5, 8, 7, 8, 4], reference.config.vocab_size, seed=41)
    orders = [[prefix, a, b, q], [prefix, c, a, q], [prefix, b, c, q], [a, b, c, q], [prefix, c, b, a, q],
              [b, a, q]]
    prompts, layouts = zip(*[assemble(parts, 4) for parts in orders])
    before = state(llm)
    cold = generate(llm, list(prompts), list(layouts))
    vocab = reference.config.vocab_size
    # The reference assembles its PIC cache in an FP8 cache (K/V rounded as the engine's cache write rounds
    # them, after the splice's rotation) and follows the engine's own tokens.
    rtz = truncating_fp8_layers(llm)
    refs = [pic_greedy(reference, p, lay, MAX_TOKENS, top_logprobs=vocab, cache=Fp8KVCache(rtz), forced=c.token_ids)
            for p, lay, c in zip(prompts, layouts, cold)]
    lps = [[torch.tensor([r.logprobs[i][t] for t in range(vocab)]) for i in range(MAX_TOKENS)] for r in refs]
    agree, _ = check_along(lps, cold, atol=FP8_EXACT_ATOL, tie=FP8_EXACT_ATOL)
    assert agree >= len(prompts) * MAX_TOKENS - 2
    mid = state(llm)
    hit = generate(llm, list(prompts), list(layouts))
    counts = delta(state(llm), mid)
    assert delta(mid, before)["segments_cold"] > 0 and counts["segments_hit"] > 0 and counts["segments_cold"] == 0
    assert [h.token_ids for h in hit] == [c.token_ids for c in cold]
