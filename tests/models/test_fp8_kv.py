# SPDX-License-Identifier: Apache-2.0
"""`kv_cache_dtype="fp8"` (e4m3) in the real vLLM engine (CPU, float32) against an FP8 reference.

vLLM's CPU build stores FP8 caches on x86 with AVX-512 or AMX (its CPU_ATTN
backend serves the layers vLLM picks a backend for); our backend serves the rest.
Every cache is then 1 byte per element, and the K/V scales are 1.0 (no checkpoint
scales). The reference model runs with `Fp8KVCache`, which rounds every K/V row
it stores as the engine's cache write does: to nearest for our backend's layers,
toward zero for the layers vLLM's CPU backend writes (its `cpu_attn_reshape_and_cache`
truncates; checked here against the op itself). It follows the engine's own
tokens (`reference_along`), so every generated position is compared, including
prompts past the selection budget, where a rounded key can change which blocks
or tokens are selected. One engine per architecture.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import (FP8_EXACT_ATOL, FP8_SKIP_REASON, check_along, fp8_engine, fp8_supported_here,
                              kv_cache_layout, make_llm, random_prompts, reference_along, truncating_fp8_layers,
                              vllm_greedy)
from vllm_hysparse.reference.layers import Fp8KVCache, fp8_round
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

# The tiny presets' selection budget is 32 keys (HySparse: 2 blocks of 16; HySparse2: 16 tokens + a window
# of 16): the last three prompts go past it.
LENGTHS = [1, 5, 9, 17, 21, 26, 45, 70, 97]
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


def test_greedy_matches_the_fp8_reference_at_every_position(llm, reference):
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=3)
    got = vllm_greedy(llm, prompts, MAX_TOKENS)
    rtz = truncating_fp8_layers(llm)
    print(f"layers whose cache vLLM's CPU backend writes (rounded toward zero): {sorted(rtz)}")
    lps = [reference_along(reference, p, g.token_ids, Fp8KVCache(rtz)) for p, g in zip(prompts, got)]
    agree, _ = check_along(lps, got, atol=FP8_EXACT_ATOL, tie=FP8_EXACT_ATOL)
    assert agree >= len(LENGTHS) * MAX_TOKENS - 2
    # Control: the float reference (no rounding) is not within that tolerance, so the check sees FP8 at all.
    floats = [reference_along(reference, p, g.token_ids) for p, g in zip(prompts, got)]
    with pytest.raises(AssertionError):
        check_along(floats, got, atol=FP8_EXACT_ATOL, tie=FP8_EXACT_ATOL)


def test_reference_rounding_is_vllm_cpu_write():
    """`fp8_round(x, toward_zero=True)` is what vLLM's CPU cache write stores of x, over a sweep of values
    (each written as a whole row, so the page layout does not matter); to nearest differs on about half."""
    if not fp8_supported_here():  # the op itself refuses FP8 there ("Unsupported CPU attention configuration")
        pytest.skip("[hardware] " + FP8_SKIP_REASON)
    from vllm import _custom_ops as ops

    xs = torch.cat([torch.linspace(-3, 3, 601), torch.tensor([0.0, 1e-4, -1e-4, 500.0, -500.0, 447.9])])
    differ = 0
    for x in xs.tolist():
        row = torch.full((1, 1, 64), x)
        cache = torch.zeros(1, 1, 64, 64, dtype=torch.uint8)
        k_cache, v_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(row, row.clone(), k_cache, v_cache, torch.tensor([0]), "vec", 1.0, 1.0, "fp8")
        stored = k_cache.reshape(-1).view(torch.float8_e4m3fn).float()
        stored = stored[stored != 0].unique() if fp8_round(torch.tensor(x), True) != 0 else torch.zeros(1)
        assert stored.tolist() == [fp8_round(torch.tensor(x), toward_zero=True).item()], x
        differ += fp8_round(torch.tensor(x)) != fp8_round(torch.tensor(x), toward_zero=True)
    print(f"{len(xs)} values: vLLM's CPU write matched rounding toward zero at all; to nearest differs at {differ}")
    assert differ > len(xs) // 4


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
