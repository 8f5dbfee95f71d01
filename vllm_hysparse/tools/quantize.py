# SPDX-License-Identifier: Apache-2.0
"""Quantise a float HySparse / HySparse2 checkpoint's linear layers to FP8 (compressed-tensors format).

    python -m vllm_hysparse.tools.quantize --src ckpt/ --dst ckpt-fp8/ [--ignore MODULE ...] [--force]

The layout is compressed-tensors' "FP8 dynamic" scheme, which vLLM's CPU
build runs in float32 (see docs/serving.md, "Quantised checkpoints"):
each linear weight is stored as float8_e4m3fn with one float32 scale per
output channel (`<module>.weight_scale`, shape `[out, 1]`), and activations
are quantised per token at run time. Embeddings, norms, sinks and
`lm_head` stay as they are. Modules are named as in the checkpoint; list
every shard of a fused module in `--ignore` or none of them (vLLM requires
one scheme per fused module). The output is written through a temporary
directory (`tools.staging`): an existing `--dst` is replaced only with `--force`,
and never left half-written.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_hysparse.tools.staging import check_replaceable, latch_interrupts, staged_output

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# Checkpoint modules never quantised: embeddings, and the output head (kept by convention).
ALWAYS_KEPT = ("model.embed_tokens", "lm_head")


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` float weight -> (float8_e4m3fn codes `[out, in]`, float32 scales `[out, 1]`), per channel."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an FP8 layer computes with: codes times their channel's scale."""
    return codes.float() * scale


def quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """What vLLM's dynamic per-token FP8 activation quantisation leaves of `x` (`[..., in]`), dequantised.

    Same arithmetic as vLLM's `QuantFP8` (per-token, dynamic): scale =
    amax / 448 (at least 1 / (448 * 512)), codes = x * (1 / scale) saturated
    to e4m3. Used by the tests to give the reference model the engine's math.
    """
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    codes = (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (codes.float() * scale).to(x.dtype)


def quantization_config(ignore: list[str]) -> dict:
    """config.json's `quantization_config`: compressed-tensors FP8, per-channel weights, per-token activations."""
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
           "actorder": None, "observer": None, "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {**fp8, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**fp8, "strategy": "token", "dynamic": True}}},
        "ignore": sorted(ignore), "kv_cache_scheme": None,
    }


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no *.safetensors files")
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def quantize_checkpoint(src: str | Path, dst: str | Path, ignore: list[str] | tuple[str, ...] = (),
                        force: bool = False) -> Path:
    """Write `dst`: `src` with every linear weight outside `ignore` (and `ALWAYS_KEPT`) in FP8. Returns `dst`.

    Refuses a non-empty `dst` unless `force`, and `dst` == `src`."""
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: no config.json (is --src a checkpoint directory?)")
    if dst.resolve() == src.resolve():
        raise ValueError("--dst must differ from --src")
    check_replaceable(dst, force, ValueError)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src}/config.json already has a quantization_config")
    if config.get("num_experts"):
        raise ValueError("quantize: MoE checkpoints are not supported (vLLM's CPU build has no FP8 MoE to test "
                         "them against); quantise a dense checkpoint")
    tensors = read_tensors(src)
    linears = {n[: -len(".weight")] for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2}
    unknown = sorted(set(ignore) - linears)
    if unknown:
        raise ValueError(f"--ignore names no linear module of {src}: {', '.join(unknown)}")
    kept = set(ignore) | (set(ALWAYS_KEPT) & linears)
    out = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and module in linears and module not in kept:
            out[name], out[f"{module}.weight_scale"] = quantize_weight(t)
        else:
            out[name] = t
    with staged_output(dst) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        config["quantization_config"] = quantization_config(sorted(kept))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(out, tmp / "model.safetensors", metadata={"format": "pt"})
    return dst


def main(argv: list[str] | None = None) -> int:
    latch_interrupts()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True, help="float checkpoint directory")
    p.add_argument("--dst", required=True, help="output directory")
    p.add_argument("--ignore", nargs="*", default=[], help="checkpoint modules to keep in float")
    p.add_argument("--force", action="store_true", help="replace a non-empty --dst")
    args = p.parse_args(argv)
    try:
        out = quantize_checkpoint(args.src, args.dst, args.ignore, force=args.force)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
