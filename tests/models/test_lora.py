# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters on HySparse and HySparse2 through vLLM's own LoRA machinery (`--enable-lora`), against the
reference model with each adapter merged into its weights.

The adapters are written here in PEFT's format (`adapter_config.json` and `adapter_model.safetensors`), with
random factors large enough to move every logprob, on every projection a layer has: HySparse's full layers'
q/k/v/o, its sparse layers' q/o, SWA K/V and both gates; HySparse2's q/k/v/o (a cross full layer's k/v are its
bridge's, under other module names in vLLM) and its attention gates; the MLPs of both. Two adapters (in one
batch) and the base model are served, each request against its own reference. HySparse2 runs without prefill
early exit when LoRA is enabled (`models/config_hooks.py`), which the test checks too.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.lora_utils import adapter_specs, write_adapter
from tests.recovery_utils import servable_checkpoints  # noqa: F401  (fixture)
from tests.vllm_utils import check_logprobs_close, make_llm, random_prompts, reference_greedy, shutdown, vllm_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

SEED = 20261203
MAX_TOKENS = 6
LENGTHS = [5, 33, 70, 150]
MAX_LORA_RANK = 8
@pytest.fixture(scope="module", params=["hysparse", "hysparse2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def base(arch, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(f"lora-{arch}") / "tiny", arch, "tiny", seed=SEED % 1000)


@pytest.fixture(scope="module")
def adapters(arch, base, tmp_path_factory):
    """name -> (adapter directory, merged reference model)."""
    out = {}
    for name, (rank, alpha, targets, seed) in adapter_specs(arch).items():
        root = tmp_path_factory.mktemp(f"adapter-{arch}-{name}")
        path = write_adapter(base, root, rank, alpha, targets, SEED + seed)
        out[name] = path, AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    return out


@pytest.fixture(scope="module")
def llm(base):
    engine = make_llm(base, enforce_eager=True, block_size=32, max_num_batched_tokens=64, max_num_seqs=8,
                      enable_lora=True, max_loras=2, max_lora_rank=MAX_LORA_RANK)
    yield engine
    shutdown(engine)


def test_two_adapters_in_one_batch_match_their_merged_references(llm, base, adapters):
    """Both adapters interleaved in one batch, each request against its own merged reference; then the base model
    alone. (Not base and adapter requests in one batch: vLLM 0.32's CPU LoRA ops index the adapter slots with the
    batch's per-token adapter index, and a request without an adapter has index -1, which PyTorch reads as the
    last slot: vllm/lora/ops/torch_ops/lora_ops.py, `bgmv_shrink` / `bgmv_expand`. docs/serving.md says so.)"""
    from vllm.lora.request import LoRARequest

    print(f"seed {SEED}")
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=SEED)
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, (path, _)) in enumerate(adapters.items())]
    batch = [(p, r) for p in prompts for r in requests]
    got = vllm_greedy(llm, [p for p, _ in batch], MAX_TOKENS, lora_request=[r for _, r in batch])
    plain = vllm_greedy(llm, prompts, MAX_TOKENS)
    runs = {r.lora_name: [got[i] for i, (_, q) in enumerate(batch) if q is r] for r in requests}
    models = {name: model for name, (_, model) in adapters.items()}
    for name, outs in [*runs.items(), (None, plain)]:
        expected = reference_greedy(models.get(name, reference), prompts, MAX_TOKENS)
        try:
            matched = check_logprobs_close(expected, outs, min_matched=1.0)
        except AssertionError as e:
            raise AssertionError(f"seed {SEED}, adapter {name}: {e}") from None
        assert matched == len(prompts) * MAX_TOKENS, (name, matched)
    # The adapters move the model: a comparison that ignored them would fail above.
    for name, outs in runs.items():
        moved = max(abs(a.logprobs[0][t] - b.logprobs[0].get(t, -99.0)) for a, b in zip(outs, plain)
                    for t in a.logprobs[0])
        assert moved > 0.05, (name, moved)


def test_lora_engines_run_without_early_exit(arch, llm):
    """With LoRA, HySparse2's cross-decoder runs on every token row (vLLM's adapter mapping covers all of them);
    HySparse has no early exit."""
    fast_prefill = llm.llm_engine.vllm_config.cache_config.kv_sharing_fast_prefill
    assert fast_prefill is False, (arch, fast_prefill)


def test_hysparse2_refuses_lora_with_early_exit_forced(tiny_model):
    """Asked for both, the engine refuses before any worker starts, with one line naming the way out (vLLM reports
    every `VllmConfig` error inside pydantic's `ValidationError`, our line verbatim)."""
    with pytest.raises(ValueError) as info:
        make_llm(tiny_model("hysparse2")[0], enforce_eager=True, enable_lora=True, max_lora_rank=MAX_LORA_RANK,
                 kv_sharing_fast_prefill=True)
    line = ("HySparse2: LoRA adapters need prefill early exit off: drop --kv-sharing-fast-prefill (enable_lora turns "
            "early exit off by itself)")
    assert line in str(info.value).splitlines()[1], str(info.value)


def test_adapter_at_tensor_parallel_2_matches_its_merged_reference(arch, base, adapters):
    """The same adapter with the model split over two ranks: vLLM's LoRA layers shard the factors as the
    projections are sharded (column-parallel B, row-parallel A), and HySparse2's MQA K/V are replicated."""
    from vllm.lora.request import LoRARequest

    path, merged = adapters["everything"]
    prompts = random_prompts(LENGTHS, merged.config.vocab_size, seed=SEED + 7)
    expected = reference_greedy(merged, prompts, MAX_TOKENS)
    llm = make_llm(base, enforce_eager=True, block_size=32, max_model_len=512, tensor_parallel_size=2,
                   enable_lora=True, max_loras=1, max_lora_rank=MAX_LORA_RANK)
    try:
        got = vllm_greedy(llm, prompts, MAX_TOKENS, lora_request=LoRARequest("everything", 1, str(path)))
    finally:
        shutdown(llm)
    matched = check_logprobs_close(expected, got, min_matched=1.0)
    assert matched == len(prompts) * MAX_TOKENS, (arch, matched)


def test_exported_recovery_delta_serves_as_the_recovered_checkpoint(arch, servable_checkpoints, tmp_path):  # noqa: F811
    """A LoRA-only recovery delta (`recovery train --lora-only`), exported with `recovery export-peft` and served
    as an adapter on its converted base, answers as the checkpoint `recovery apply` writes (the reference)."""
    from vllm.lora.request import LoRARequest

    from vllm_hysparse.recovery import __main__ as recovery

    checkpoints = servable_checkpoints
    base, delta, adapter, recovered = checkpoints[arch], tmp_path / "delta", tmp_path / "adapter", tmp_path / "rec"
    assert recovery.main(["train", "--teacher", str(checkpoints["teacher"]), "--student", str(base), "--delta",
                          str(delta), "--lora-only", "--rank", "4", "--alpha", "16", "--stage1-minutes", "0.05",
                          "--stage2-minutes", "0", "--seq-len", "64", "--windows", "4", "--train-chars", "40000",
                          "--heldout-windows", "1", "--heldout-seq-len", "64", "--seed", str(SEED % 1000)]) == 0
    assert recovery.main(["export-peft", "--base", str(base), "--delta", str(delta), "--out", str(adapter)]) == 0
    assert recovery.main(["apply", "--base", str(base), "--delta", str(delta), "--out", str(recovered)]) == 0
    reference = AutoModelForCausalLM.from_pretrained(recovered, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = random_prompts([6, 50, 120], reference.config.vocab_size, seed=SEED + 11)
    expected = reference_greedy(reference, prompts, MAX_TOKENS)
    llm = make_llm(base, enforce_eager=True, block_size=32, max_model_len=256, enable_lora=True, max_loras=1,
                   max_lora_rank=MAX_LORA_RANK)
    try:
        got = vllm_greedy(llm, prompts, MAX_TOKENS, lora_request=LoRARequest("recovered", 1, str(adapter)))
    finally:
        shutdown(llm)
    assert check_logprobs_close(expected, got, min_matched=1.0) == len(prompts) * MAX_TOKENS
    # Training moved the model, so serving the base alone would not pass the comparison above.
    unmoved = reference_greedy(plain, prompts, MAX_TOKENS)
    moved = max(abs(a.logprobs[0][t] - b.logprobs[0].get(t, -99.0)) for a, b in zip(expected, unmoved)
                for t in a.logprobs[0])
    print(f"adapter moved the first logprobs by up to {moved:.4f}")
    assert moved > 0.02, moved
