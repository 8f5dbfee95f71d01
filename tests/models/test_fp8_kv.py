# SPDX-License-Identifier: Apache-2.0
"""`kv_cache_dtype="fp8"` (e4m3) in the real vLLM engine (CPU, float32) against the float reference model.

vLLM's CPU build stores FP8 caches on x86 with AVX-512 or AMX (its CPU_ATTN
backend serves the layers vLLM picks a backend for); our backend serves the rest.
Every cache is then 1 byte per element, and the K/V scales are 1.0 (no checkpoint
scales), so the engine differs from the reference by e4m3's rounding (3 mantissa
bits) of every stored K and V. The tiny random models' next-token distributions
are nearly flat (top logprobs within 1e-2 of each other), so that error may reorder
tokens far down vLLM's top-5: the check is vLLM's convention at FP8's tolerance,
with the reference's full distribution. Until a prompt diverges, tokens are equal
and logprobs within `FP8_ATOL`; where it diverges, vLLM's token must be within
`2 * FP8_ATOL` of the reference's best (a near-tie at that tolerance), and enough
positions must have matched. One engine per architecture.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import check_fp8_close, fp8_engine, kv_cache_layout, make_llm, random_prompts, vllm_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

# Every sequence stays within the tiny presets' selection budget (HySparse: 2 blocks of 16; HySparse2: 16
# tokens + a window of 16), where the oracles keep every key. Past it, e4m3 rounding may flip a near-tied
# selection of these random models, a discontinuous change no tolerance bounds; that the selections are
# exact on the dequantised cache is checked by tests/kernels/test_fp8_kv.py.
LENGTHS = [1, 5, 9, 17, 21, 26]
MAX_TOKENS = 6
@pytest.fixture(scope="module", params=["hysparse", "hysparse2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(arch) / "tiny", arch, "tiny", seed=21)


@pytest.fixture(scope="module")
def reference(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(ckpt):
    yield from fp8_engine(ckpt)


def reference_distributions(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of the reference and its full next-token logprobs `[vocab]` at each step."""
    ids, cache, tokens, lps = torch.tensor([prompt]), None, [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            res = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = res.past_key_values
            lp = torch.log_softmax(res.logits[0, -1].double(), dim=-1)
            tokens.append(int(lp.argmax()))
            lps.append(lp)
            ids = torch.tensor([[tokens[-1]]])
    return tokens, lps


def test_greedy_matches_reference(llm, reference):
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=3)
    got = vllm_greedy(llm, prompts, MAX_TOKENS)
    refs = [reference_distributions(reference, p, MAX_TOKENS) for p in prompts]
    check_fp8_close([t for t, _ in refs], [lp for _, lp in refs], got)


def test_caches_are_one_byte_per_element(llm, reference):
    """Every cache group costs G * (head_dim + v_head_dim) bytes per token and layer."""
    cfg = reference.config
    layout = llm.collective_rpc(kv_cache_layout)[0]
    per_token = cfg.num_key_value_heads * (cfg.head_dim + (getattr(cfg, "v_head_dim", None) or cfg.head_dim))
    assert {g["page_size_bytes"] // g["block_size"] for g in layout["groups"]} == {per_token}


def test_other_quantised_kv_dtypes_are_refused(ckpt):
    """e5m2 (and the other quantised kinds) would be read as e4m3: refused at engine start, in one line."""
    with pytest.raises(ValueError, match=r"kv_cache_dtype: HySparse models support .*not 'fp8_e5m2'"):
        make_llm(ckpt, enforce_eager=True, kv_cache_dtype="fp8_e5m2")
