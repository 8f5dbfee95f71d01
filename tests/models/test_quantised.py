# SPDX-License-Identifier: Apache-2.0
"""Quantised weights: vLLM's quant config reaches every linear, ignore lists reach fused modules, and an
FP8 checkpoint written by our own tool serves on CPU with the reference model's math.

The FP8 layout is compressed-tensors' "FP8 dynamic" (per-channel weight
scales, per-token dynamic activations): the one FP8 linear vLLM 0.32's CPU
build runs in float32 (its `fp8` method needs bf16/fp16 activations, and
the CPU's own FP8 kernels need AMX). The engine computes
`(fp8(x / s_x) @ fp8(W / s_w)^T) * s_x * s_w` in float32, so the reference
runs on the dequantised weights with the same per-token activation
quantisation applied to each linear's input (`quantize_activation`): the
same math, up to float32 summation order.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import (
    check_logprobs_close,
    make_llm,
    offline_load_errors,
    random_prompts,
    reference_greedy,
    shutdown,
    vllm_greedy,
)
from vllm_hysparse.configs.tensors import layer_kind
from vllm_hysparse.models import hysparse, hysparse2, loader
from vllm_hysparse.tools.make_checkpoint import build_config, write_checkpoint
from vllm_hysparse.tools.quantize import dequantize_weight, quantize_activation, quantize_checkpoint

LENGTHS = [1, 17, 33, 64, 150]
MAX_TOKENS = 8
MODELS = {"hysparse": (hysparse, hysparse.HySparseForCausalLM), "hysparse2": (hysparse2, hysparse2.HySparse2ForCausalLM)}
# Kept in float, to show ignore lists reach fused modules: HySparse's sparse layer 2 (its fused
# q / SWA k / SWA v and its fused gates) and HySparse2's bridge of cross full layer 6.
IGNORED = {
    "hysparse": [f"model.layers.2.self_attn.{m}" for m in
                 ("q_proj", "swa_k_proj", "swa_v_proj", "sparse_gate_proj", "swa_gate_proj")],
    "hysparse2": ["model.layers.6.self_attn.k_proj", "model.layers.6.self_attn.v_proj"],
}
IGNORED_VLLM = {
    "hysparse": {"model.layers.2.self_attn.q_swa_kv_proj", "model.layers.2.self_attn.gate_proj", "lm_head"},
    "hysparse2": {"model.bridges.6.kv_proj", "lm_head"},
}


def fused_tables(module) -> dict[str, list[str]]:
    """vLLM fused module name -> its checkpoint modules in shard order, from the loader's stack tables."""
    shards: dict[str, dict] = {}
    tables = [*module.STACKS.values(), loader.MLP_STACK, loader.SHARED_EXPERT_STACK]
    for table in tables:
        for hf_module, (owner, shard) in table.items():
            if shard is not None:
                shards.setdefault(owner.rsplit(".", 1)[1], {})[hf_module] = shard
    order = {"q": 0, "k": 1, "v": 2}
    return {fused: sorted(parts, key=lambda p: order.get(parts[p], parts[p])) for fused, parts in shards.items()}


@pytest.mark.parametrize("arch", MODELS)
def test_packed_modules_mapping_names_every_fused_shard(arch):
    """Every fused parameter the loader stacks is in `packed_modules_mapping` with its shards in order, and
    vLLM's lookups (last name component; compressed-tensors' first key the name ends with) find its own entry."""
    module, model_class = MODELS[arch]
    mapping = model_class.packed_modules_mapping
    assert fused_tables(module) == mapping
    for fused in mapping:
        name = f"model.layers.3.self_attn.{fused}"
        assert next(key for key in mapping if name.endswith(key)) == fused, fused


def _prefixes(arch: str, config) -> dict[str, list[str]]:
    """vLLM prefix of each fused linear in the model -> its checkpoint modules (from the stack tables)."""
    module = MODELS[arch][0]
    out = {}
    for i in range(config.num_hidden_layers):
        kind = layer_kind(config, i)
        for table in (module.STACKS.get(kind, {}), loader.MLP_STACK):
            group = "self_attn" if table is not loader.MLP_STACK else "mlp"
            for hf_module, (owner, shard) in table.items():
                if shard is not None:
                    out.setdefault(owner.format(i=i), []).append(f"model.layers.{i}.{group}.{hf_module}")
    return out


@pytest.mark.parametrize("arch", MODELS)
def test_ignore_lists_reach_fused_modules(arch):
    """vLLM's own skip checks (fp8's `is_layer_skipped`, compressed-tensors' `should_ignore_layer`) with our
    mapping: a fused module is skipped exactly when all its checkpoint shards are ignored; some is an error."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    config = build_config(arch, "tiny")
    mapping = MODELS[arch][1].packed_modules_mapping
    fused = _prefixes(arch, config)
    assert len(fused) > config.num_hidden_layers  # every MLP, and at least one attention or bridge
    for prefix, shards in fused.items():
        quant = Fp8Config(ignored_layers=list(shards))
        if arch == "hysparse2":
            quant.apply_vllm_mapper(hysparse2.bridge_names(config))
        assert is_layer_skipped(prefix, quant.ignored_layers, mapping), prefix
        assert should_ignore_layer(prefix, quant.ignored_layers, mapping), prefix
        others = [p for p in fused if p != prefix]
        assert not any(is_layer_skipped(p, quant.ignored_layers, mapping) for p in others), prefix
        if len(shards) > 1:
            partial = Fp8Config(ignored_layers=shards[:1])
            if arch == "hysparse2":
                partial.apply_vllm_mapper(hysparse2.bridge_names(config))
            with pytest.raises(ValueError, match="shards"):
                is_layer_skipped(prefix, partial.ignored_layers, mapping)


def _linear_methods(worker) -> dict[str, str]:
    """Runs inside the worker: each linear's vLLM prefix -> its quant method, and the lm_head's."""
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.model
    out = {name: type(m.quant_method).__name__ for name, m in model.named_modules() if isinstance(m, LinearBase)}
    out["lm_head"] = type(model.lm_head.quant_method).__name__
    return out


def _fp8_reference(src, dst):
    """The reference model on the FP8 checkpoint's dequantised weights, quantising each FP8 linear's input."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tensors = load_file(dst / "model.safetensors")
    linears = dict(model.named_modules())
    quantised = [n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")]
    for name in quantised:
        layer = linears[name]
        layer.weight.data = dequantize_weight(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"])
        layer.register_forward_pre_hook(lambda _m, args: (quantize_activation(args[0]), *args[1:]))
    return model, quantised


@pytest.fixture(scope="module", params=list(MODELS))
def fp8(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"fp8-{arch}")
    src = write_checkpoint(root / "float", arch, "tiny", seed=21)
    dst = quantize_checkpoint(src, root / "fp8", IGNORED[arch])
    reference, quantised = _fp8_reference(src, dst)
    # Eager: nothing here depends on compilation (tests/models/test_hysparse*.py and test_moe.py cover the
    # compiled model), and an eager engine starts in seconds instead of minutes.
    llm = make_llm(dst, enforce_eager=True)
    yield arch, src, dst, llm, reference, quantised
    shutdown(llm)


def test_quant_config_reaches_every_linear(fp8):
    arch, _, dst, llm, _, quantised = fp8
    methods = llm.collective_rpc(_linear_methods)[0]
    fused = {p for p in methods if p.split(".")[-1] in MODELS[arch][1].packed_modules_mapping}
    assert len(fused) >= 8, methods
    for prefix, method in methods.items():
        want = "UnquantizedLinearMethod" if prefix in IGNORED_VLLM[arch] else "CompressedTensorsLinearMethod"
        if prefix == "lm_head":  # an embedding to vLLM; kept in float like every FP8 checkpoint's head
            want = "UnquantizedEmbeddingMethod"
        assert method == want, (prefix, method)


def _first_errors(ref, got) -> list[float]:
    """|logprob difference| of the reference's first greedy token per prompt (it depends on the prompt only)."""
    return [abs(a.logprobs[0][a.token_ids[0]] - b.logprobs[0].get(a.token_ids[0], -99.0))
            for a, b in zip(ref, got, strict=True)]


def test_fp8_greedy_matches_dequantised_reference(fp8):
    """The engine computes the FP8 math, not the float model's.

    Tolerance 5e-2: both sides compute the same products in float32, but an
    activation whose float32 value differs by summation order (~1e-6
    relative) can round to the neighbouring e4m3 code, a step of 1/16 to 1/8
    of that element; a few such flips per step move a logprob of this random
    tiny model by a few 1e-2, depending on vLLM's CPU GEMM kernel and the
    machine (measured: up to 1e-2 on one CPU; 2.4e-2 and 2.7e-2 on two AMD EPYC
    machines, one with and one without AVX-512). The float reference is the
    control: FP8 quantisation itself moves the first token's logprob ten times
    more than what separates the engine from the dequantised reference.
    """
    arch, src, _, llm, reference, _ = fp8
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=22)
    got = vllm_greedy(llm, prompts, MAX_TOKENS)
    ref = reference_greedy(reference, prompts, MAX_TOKENS)
    check_logprobs_close(ref, got, atol=5e-2)
    plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    fp8_err, float_err = _first_errors(ref, got), _first_errors(reference_greedy(plain, prompts, 1), got)
    print(f"FP8-ERR {arch} vs dequantised reference {fp8_err} vs float reference {float_err}")
    assert sorted(fp8_err)[len(fp8_err) // 2] * 10 < sorted(float_err)[len(float_err) // 2], (fp8_err, float_err)


def _edit(dst, path, edit):
    shutil.copytree(dst, path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors, path)
    save_file(tensors, path / "model.safetensors")
    return path


def _drop_config(tensors, path):
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))


def _fp8_method(tensors, path):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))


# HySparse tiny, ignoring sparse layer 2. case -> (edit, the line the user must see)
LOAD_CASES = {
    "missing_scale": (lambda t, _: t.pop("model.layers.1.self_attn.swa_k_proj.weight_scale"),
                      "checkpoint is missing tensor(s) model.layers.1.self_attn.swa_k_proj.weight_scale"),
    "scale_of_ignored": (lambda t, _: t.update({"model.layers.2.self_attn.q_proj.weight_scale": torch.ones(256, 1)}),
                         "checkpoint has unexpected tensor model.layers.2.self_attn.q_proj.weight_scale: module "
                         "model.layers.2.self_attn.q_proj is not quantised"),
    "no_quantization_config": (_drop_config, "checkpoint tensor model.layers.0.mlp.down_proj.weight is "
                                             "torch.float8_e4m3fn but vLLM parameter "
                                             "model.layers.0.mlp.down_proj.weight is torch.float32"),
    "scale_shape": (lambda t, _: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(64, 1)}),
                    "checkpoint tensor model.layers.0.mlp.down_proj.weight_scale (shape (64, 1), torch.float32) "
                    "does not fit vLLM parameter model.layers.0.mlp.down_proj.weight_scale (shape (128, 1))"),
    # vLLM's own refusal (a three-line pydantic ValidationError with this line in it, no traceback): its fp8
    # method needs bf16 / fp16 activations, which this CPU cannot run. Not reworded by us.
    "fp8_method_on_float32": (_fp8_method, "torch.float32 is not supported for quantization method fp8"),
}


def test_offline_llm_refuses_mismatched_quantised_checkpoints(tmp_path):
    src = write_checkpoint(tmp_path / "float", "hysparse", "tiny", seed=23)
    dst = quantize_checkpoint(src, tmp_path / "fp8", IGNORED["hysparse"])
    bad = {how: _edit(dst, tmp_path / how, edit) for how, (edit, _) in LOAD_CASES.items()}
    errors = offline_load_errors(list(bad.values()), tmp_path, timeout_s=500)
    for how, path in bad.items():
        error = errors[str(path)]
        assert error is not None, f"{how}: LLM(...) loaded a mismatched checkpoint"
        assert LOAD_CASES[how][1] in error, (how, error)
        assert "\n" not in error or how == "fp8_method_on_float32", (how, error)
