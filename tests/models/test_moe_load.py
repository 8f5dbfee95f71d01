# SPDX-License-Identifier: Apache-2.0
"""MoE checkpoints that do not fit their config fail vLLM's load with one line naming the tensor;
expert parallelism is refused on CPU and where its size does not divide the experts."""

import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import offline_load_errors
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

# HySparse tiny_moe: 8 experts of 64 on layers 1-5, hidden 128, layer 0 dense.
CASES = {
    "missing_expert": (lambda t: t.pop("model.layers.1.mlp.experts.7.down_proj.weight"),
                       "checkpoint is missing tensor(s) model.layers.1.mlp.experts.7.down_proj.weight"),
    "extra_expert": (lambda t: t.update({"model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(64, 128)}),
                     "checkpoint has unexpected tensor model.layers.1.mlp.experts.8.up_proj.weight"),
    "dense_mlp_in_moe_layer": (lambda t: t.update({"model.layers.3.mlp.gate_proj.weight": torch.zeros(256, 128)}),
                               "checkpoint has unexpected tensor model.layers.3.mlp.gate_proj.weight"),
    "router_shape": (lambda t: t.update({"model.layers.2.mlp.gate.weight": torch.zeros(7, 128)}),
                     "checkpoint tensor model.layers.2.mlp.gate.weight has shape (7, 128), expected (8, 128)"),
}


def test_expert_parallel_size_must_divide_experts():
    from vllm_hysparse.models.layers import check_expert_parallel

    check_expert_parallel(8, SimpleNamespace(use_ep=True, ep_size=4), on_cpu=False)
    check_expert_parallel(8, SimpleNamespace(use_ep=False, ep_size=3), on_cpu=True)
    with pytest.raises(ValueError) as info:
        check_expert_parallel(8, SimpleNamespace(use_ep=True, ep_size=3), on_cpu=False)
    message = str(info.value)
    assert "num_experts=8" in message and "expert-parallel size 3" in message and "\n" not in message


def test_expert_parallel_is_refused_on_cpu():
    """vLLM's CPU MoE kernel ignores the expert map and crashes under EP (seen: a segfault in
    cpu_fused_moe at TP=2 with enable_expert_parallel); we refuse it with one line instead."""
    from vllm_hysparse.models.layers import check_expert_parallel

    with pytest.raises(ValueError) as info:
        check_expert_parallel(8, SimpleNamespace(use_ep=True, ep_size=2), on_cpu=True)
    message = str(info.value)
    assert message.startswith("enable_expert_parallel: ") and "\n" not in message


def test_offline_llm_refuses_mismatched_moe_checkpoints(tmp_path):
    good = write_checkpoint(tmp_path / "good", "hysparse", "tiny_moe", seed=5)
    bad = {}
    for how, (edit, _) in CASES.items():
        path = tmp_path / how
        shutil.copytree(good, path)
        tensors = load_file(path / "model.safetensors")
        edit(tensors)
        save_file(tensors, path / "model.safetensors")
        bad[how] = path
    errors = offline_load_errors(list(bad.values()), tmp_path, timeout_s=400)
    for how, path in bad.items():
        error = errors[str(path)]
        assert error is not None, f"{how}: LLM(...) loaded a mismatched checkpoint"
        assert CASES[how][1] in error and "\n" not in error, (how, error)
