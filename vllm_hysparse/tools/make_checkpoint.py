# SPDX-License-Identifier: Apache-2.0
"""Write a complete HF checkpoint directory (config, safetensors, tokenizer) from a preset.

    python -m vllm_hysparse.tools.make_checkpoint --arch hysparse --preset tiny --out ckpt/

Weights are random but shaped for a useful demo: q/k-type projections are
scaled so attention logits have a standard deviation of about
`--logit-std`, which makes attention peaked and block / token selection
non-trivial. The `paper` presets write the config and tokenizer only.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from vllm_hysparse.configs import HySparse2Config, HySparseConfig
from vllm_hysparse.configs.base import kv_bytes_per_token
from vllm_hysparse.tools.checkpoint_io import parse_size, save_sharded
from vllm_hysparse.tools.presets import CONFIG_ONLY, PRESETS, TOKENIZER_VOCAB
from vllm_hysparse.tools.staging import check_replaceable, latch_interrupts, staged_output
from vllm_hysparse.tools.tokenizer import build_hf_tokenizer

CONFIG_CLASSES = {"hysparse": HySparseConfig, "hysparse2": HySparse2Config}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Projections whose outputs meet in q.k: scaled to make attention peaked.
QK_PROJ_SUFFIXES = ("q_proj.weight", "k_proj.weight")
# Std of random MoE router logits: far from uniform, so top-k choices are rarely near-ties.
ROUTER_LOGIT_STD = 2.0


def build_config(arch: str, preset: str, overrides: dict | None = None):
    """Preset fields plus `overrides`, validated by the config class."""
    fields = {**PRESETS[arch][preset], **(overrides or {})}
    return CONFIG_CLASSES[arch](**fields)


def random_state_dict(config, seed: int, logit_std: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights for `config` with peaked attention, sinks and gates that differ per head."""
    from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM

    model_cls = HySparseForCausalLM if config.model_type == "hysparse" else HySparse2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    # RMS-normalised inputs have unit scale per element, so W ~ N(0, sigma) gives
    # q.k * D**-0.5 a standard deviation of about sigma**2 * hidden_size.
    qk_sigma = (logit_std / config.hidden_size) ** 0.5
    state = {}
    for name, tensor in tqdm(model.state_dict().items(), desc="random weights", unit="tensor", leave=False):
        if name.endswith(QK_PROJ_SUFFIXES):
            tensor = torch.randn(tensor.shape, generator=gen) * qk_sigma
        elif name.endswith("mlp.gate.weight"):
            tensor = torch.randn(tensor.shape, generator=gen) * ROUTER_LOGIT_STD / config.hidden_size**0.5
        elif name.endswith("sinks"):
            tensor = torch.randn(tensor.shape, generator=gen)
        elif name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(tensor.shape, generator=gen)
        keep_fp32 = name.endswith("sinks")
        state[name] = tensor.detach().to(torch.float32 if keep_fp32 else dtype).contiguous()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_checkpoint(
    out: str | Path,
    arch: str,
    preset: str = "tiny",
    *,
    overrides: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
    logit_std: float = 4.0,
    max_shard_bytes: int = 2 << 30,
    force: bool = False,
) -> Path:
    """Build a checkpoint in a temporary directory, then move it to `out`.

    Refuses to replace a non-empty `out` unless `force`; a failure, Ctrl-C or
    kill leaves `out` untouched (see `vllm_hysparse.tools.staging`).
    """
    out = Path(out)
    check_replaceable(out, force)
    config = build_config(arch, preset, overrides)
    tokenizer = build_hf_tokenizer(TOKENIZER_VOCAB)
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size: must be at least the tokenizer's {len(tokenizer)} tokens "
                         f"(got {config.vocab_size})")
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.dtype = DTYPES[dtype]
    with staged_output(out) as tmp:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
        if preset not in CONFIG_ONLY:
            save_sharded(random_state_dict(config, seed, logit_std, DTYPES[dtype]), tmp, max_shard_bytes)
    return out


def describe(out: Path) -> str:
    config = json.loads((out / "config.json").read_text())
    cfg = CONFIG_CLASSES[config["model_type"]].from_pretrained(out)
    kv = kv_bytes_per_token(cfg, dtype_bytes=2, context_len=32768)
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    return (f"wrote {out}: {config['model_type']} {cfg.num_hidden_layers} layers, "
            f"{kv['full_length_caches']} full-length KV caches + {kv['window_caches']} window caches; "
            f"bf16 KV at 32k context: {kv['bytes_per_token']:.0f} B/token "
            f"(dense: {kv['dense_bytes_per_token']:.0f}); "
            f"weights: {', '.join(weights) if weights else 'none (config only)'}")


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE (VALUE as JSON, e.g. full_rope=true)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    latch_interrupts()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(CONFIG_CLASSES), required=True)
    parser.add_argument("--preset", choices=["tiny", "tiny_moe", "small", "paper"], default="tiny")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weight dtype (CPU vLLM needs float32)")
    parser.add_argument("--logit-std", type=float, default=4.0,
                        help="target std of random attention logits (larger = more peaked)")
    parser.add_argument("--max-shard-size", default="2GB", help="e.g. 500MB; larger models are sharded")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (JSON value), e.g. --set full_rope=true")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    args = parser.parse_args(argv)
    try:
        out = write_checkpoint(
            args.out, args.arch, args.preset, overrides=parse_overrides(args.overrides), seed=args.seed,
            dtype=args.dtype, logit_std=args.logit_std, max_shard_bytes=parse_size(args.max_shard_size),
            force=args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
