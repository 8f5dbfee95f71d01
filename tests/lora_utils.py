# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters in PEFT's format, written by the tests with random factors, and their merged references."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = {
    "hysparse": ["q_proj", "k_proj", "v_proj", "o_proj", "swa_k_proj", "swa_v_proj", "sparse_gate_proj",
                 "swa_gate_proj", "gate_proj", "up_proj", "down_proj"],
    "hysparse2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
ATTENTION_TARGETS = {
    "hysparse": ["q_proj", "o_proj", "swa_k_proj", "swa_v_proj", "sparse_gate_proj"],
    "hysparse2": ["q_proj", "o_proj", "k_proj", "v_proj"],  # k/v: the bridged ones included
}


def adapter_specs(arch: str) -> dict:
    """name -> (rank, alpha, target modules, seed)."""
    return {"everything": (4, 8.0, ALL_TARGETS[arch], 1), "attention-only": (8, 4.0, ATTENTION_TARGETS[arch], 2)}


def write_adapter(base: Path, out: Path, rank: int, alpha: float, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA adapter for `base` with random factors on `targets`; also writes `out/merged`, the base with
    `W + alpha / rank * B A` on each target (the reference). Returns the adapter directory."""
    weights = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    factors, merged = {}, dict(weights)
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets or w.dim() != 2:
            continue
        a = torch.randn(rank, w.shape[1], generator=gen) / w.shape[1] ** 0.5
        b = torch.randn(w.shape[0], rank, generator=gen) * 0.5
        factors[f"base_model.model.{module}.lora_A.weight"] = a
        factors[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = w + (alpha / rank) * b @ a
    adapter = out / "adapter"
    adapter.mkdir(parents=True)
    save_file(factors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "target_modules": targets,
        "bias": "none", "base_model_name_or_path": str(base)}))
    shutil.copytree(base, out / "merged")
    save_file(merged, out / "merged" / "model.safetensors")
    return adapter
