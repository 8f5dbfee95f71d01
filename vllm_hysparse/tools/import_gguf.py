# SPDX-License-Identifier: Apache-2.0
"""Import a GGUF file (llama.cpp's format) as a dense Hugging Face checkpoint directory.

    python -m vllm_hysparse.tools.import_gguf --src model.gguf --dst dense/ [--dtype bf16] [--verify]

The result is what `scripts/convert_checkpoint.py --src dense/` expects: a
`config.json` without any `quantization_config`, safetensors weights
(dequantised, float32 unless `--dtype`), the tokenizer with its chat template
and `generation_config.json`. Reading is transformers' own GGUF loader, which
dequantises every tensor and undoes llama.cpp's Q/K row permutation; this tool
checks the file first, refuses what the loader would get wrong silently, and
writes through a temporary directory beside `--dst`.

Supported `general.architecture` values: llama (Mistral files are llama files
too), qwen2, qwen3 -- the dense layouts our converter accepts.
"""

import argparse
import copy
import importlib.util
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from vllm_hysparse.tools.checkpoint_io import parse_size, save_sharded
from vllm_hysparse.tools.convert.source import SOURCE_ARCHITECTURES
from vllm_hysparse.tools.staging import check_replaceable, latch_interrupts, staged_output

# GGUF architecture names whose transformers model types the converter accepts.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
INSTALL_HINT = "pip install 'vllm_hysparse[gguf]' (the gguf and accelerate packages)"
VERIFY_TOKENS = 16


class GGUFImportError(ValueError):
    """Bad input: reported as one line, exit code 2."""


def _one_line(e: BaseException) -> str:
    """`Type: first line of the message`, so an error never spans lines."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _require_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise GGUFImportError(f"importing GGUF needs {', '.join(missing)}: {INSTALL_HINT}")


def _field(reader, key: str):
    """Value of a metadata key, or None when absent."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def read_header(src: Path) -> dict:
    """Architecture facts the import depends on, read with gguf's GGUFReader (tensor data memory-mapped).

    Returns {"architecture": str, "head_dim": int | None, "tensors": {gguf name: shape}}; raises
    GGUFImportError for a missing, truncated or corrupt file, an unsupported architecture, or a
    RoPE scaling that transformers' loader would drop.
    """
    from gguf import GGUFReader

    if not src.is_file():
        raise GGUFImportError(f"{src}: no such file")
    try:
        reader = GGUFReader(src)
        arch = _field(reader, "general.architecture")
        # Reader shapes are GGUF order (fastest dim first); reversed they are torch's [out, in].
        tensors = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    except Exception as e:  # the reader raises whatever numpy does on a short or garbled file
        raise GGUFImportError(f"{src}: not a readable GGUF file ({_one_line(e)})") from None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"{src}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensors:
        # transformers maps no rope.scaling.* key and no rope_freqs tensor for these architectures:
        # the imported model would silently run unscaled RoPE.
        raise GGUFImportError(f"{src}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is not imported by "
                              "transformers' GGUF loader; import the original safetensors checkpoint instead")
    return {"architecture": arch, "head_dim": _field(reader, f"{arch}.attention.key_length"), "tensors": tensors}


def expected_gguf_names(arch: str, hf_names: list[str], num_layers: int) -> set[str]:
    """GGUF tensor names of `hf_names` under gguf's own HF -> GGUF name table."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    model_arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(model_arch, num_layers)
    names = set()
    for name in hf_names:
        base, _, suffix = name.rpartition(".")
        mapped = table.get_name(base)
        if mapped is not None:
            names.add(f"{mapped}.{suffix}")
    return names


def _with_head_dim(config, head_dim: int | None):
    """`config` with the file's attention.key_length as head_dim where transformers derived another.

    transformers reads head_dim from rope.dimension_count (llama) or not at all (qwen2/qwen3 fall
    back to a default), which mis-shapes q/k/v for models whose head_dim is not the default.
    """
    current = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim and head_dim != current:
        config.head_dim = head_dim
    return config


def load_gguf(src: Path, header: dict):
    """(model in float32, tokenizer) through transformers' GGUF loader, every tensor dequantised.

    Raises GGUFImportError when the loader fails, leaves a parameter uninitialised
    (a tensor the file lacks) or skips a tensor the file has.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where = dict(gguf_file=src.name)
    try:
        config = _with_head_dim(AutoConfig.from_pretrained(src.parent, **where), header["head_dim"])
        tokenizer = AutoTokenizer.from_pretrained(src.parent, **where)
        model, info = AutoModelForCausalLM.from_pretrained(
            src.parent, **where, config=config, dtype=torch.float32, output_loading_info=True,
            # Dense weights, even where a GGUF matmul kernel is installed.
            quantization_config=GgufConfig(dequantize=True))
    except Exception as e:  # transformers' loader raises many types; the user needs one line
        raise GGUFImportError(f"{src}: transformers could not load it ({_one_line(e)})") from None
    config = model.config
    missing = [k for k in info["missing_keys"] if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or info.get("mismatched_keys"):
        bad = missing or [m[0] if isinstance(m, tuple) else m for m in info["mismatched_keys"]]
        raise GGUFImportError(f"{src}: the GGUF file does not provide {', '.join(sorted(bad)[:5])}")
    unused = set(header["tensors"]) - expected_gguf_names(header["architecture"], list(model.state_dict()),
                                                           config.num_hidden_layers)
    if unused:
        raise GGUFImportError(f"{src}: tensor(s) {', '.join(sorted(unused)[:5])} have no place in "
                              f"{type(model).__name__}")
    if config.model_type not in SOURCE_ARCHITECTURES:
        raise GGUFImportError(f"{src}: loads as {config.model_type}, which the converter does not accept")
    return model.eval(), tokenizer


def dense_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors in `dtype`, [out, in] like any HF checkpoint; tied lm_head dropped."""
    state = {name: t.detach().to(dtype).contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # Tied: the same storage as embed_tokens, which safetensors refuses to save twice.
        state.pop("lm_head.weight", None)
    return state


def dense_config(model, dtype: torch.dtype):
    """The loaded config as a plain dense one: no GGUF quantization_config, the written dtype."""
    config = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.architectures = [type(model).__name__]
    if config.model_type == "mistral":
        # llama.cpp runs a llama-architecture file with full attention; MistralConfig's default
        # 4096-token window would change what the model computes (and the converter refuses it).
        config.sliding_window = None
    config.dtype = dtype
    return config


def write_dense(model, tokenizer, out: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """config.json, safetensors, tokenizer files (chat template kept) and generation_config.json into `out`."""
    from transformers import GenerationConfig

    config = dense_config(model, dtype)
    config.save_pretrained(out)
    save_sharded(dense_state_dict(model, dtype), out, max_shard_bytes)
    # The GGUF's context length, rather than transformers' "no limit" default.
    tokenizer.model_max_length = config.max_position_embeddings
    for loading_only in ("is_local", "local_files_only"):  # how it was loaded, not what it is
        tokenizer.init_kwargs.pop(loading_only, None)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)


def verify(model, out: Path, dtype: torch.dtype, tol: float = 1e-5) -> str:
    """Logits of the written checkpoint (plain `from_pretrained`) against the GGUF-loaded model.

    The GGUF model's weights are first rounded to `dtype` in place (it is not
    used afterwards), so the comparison is exact up to float32 arithmetic.
    """
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
        written = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, VERIFY_TOKENS), generator=torch.Generator().manual_seed(0))
        want, got = model(ids).logits, written(ids).logits
    err, scale = (want - got).abs().max().item(), want.abs().max().item()
    line = f"verify: logits max |difference| {err:.2e} (max |value| {scale:.2f}) over {VERIFY_TOKENS} tokens"
    if not err <= tol * max(scale, 1.0):
        raise GGUFImportError(f"{line}: the written checkpoint does not reproduce the GGUF model")
    return line


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    check_replaceable(dst, force, GGUFImportError)
    if dst.resolve() in src.resolve().parents:
        # --force would delete the GGUF file itself when the import is moved into place.
        raise GGUFImportError("--dst must not be a directory that holds --src")


def import_gguf(src: str | Path, dst: str | Path, *, dtype: str = "float32", force: bool = False,
                check: bool = False, max_shard_bytes: int = 5 << 30, log=print) -> Path:
    """Import `src` (a .gguf file) into the dense checkpoint directory `dst`; returns `dst`.

    Everything is written into a temporary directory beside `dst` and renamed
    into place at the end: a failure leaves `dst` as it was and no temporary
    directory behind. `check` compares logits before publishing (see `verify`).
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise GGUFImportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    _require_packages()
    header = read_header(src)
    _check_destination(src, dst, force)
    model, tokenizer = load_gguf(src, header)
    log(f"loaded {src.name}: {header['architecture']} -> {type(model).__name__}, "
        f"{model.config.num_hidden_layers} layers, {sum(p.numel() for p in model.parameters()):,} parameters")
    with staged_output(dst) as tmp:  # never deletes an existing `dst` in place
        write_dense(model, tokenizer, tmp, DTYPES[dtype], max_shard_bytes)
        if check:
            log(verify(model, tmp, DTYPES[dtype]))
    return dst


@contextmanager
def dense_source(src: str | Path, workdir: Path, log=print):
    """`src` itself, or for a `.gguf` file a dense import of it in a temporary directory under `workdir`.

    What `scripts/convert_checkpoint.py --src model.gguf` converts from; the
    import is deleted when the block ends, whatever happens in it.
    """
    src = Path(src)
    if src.suffix.lower() != ".gguf":
        yield src
        return
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-import-", dir=workdir) as tmp:
        yield import_gguf(src, Path(tmp) / src.stem, log=log)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="GGUF file (llama, qwen2 or qwen3 architecture)")
    p.add_argument("--dst", required=True, help="dense checkpoint directory to create")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weight dtype written (CPU vLLM needs float32)")
    p.add_argument("--verify", action="store_true",
                   help="compare logits of the written checkpoint with the GGUF-loaded model before publishing")
    p.add_argument("--force", action="store_true", help="replace a non-empty --dst")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size, e.g. 500MB")
    return p


def main(argv: list[str] | None = None) -> int:
    latch_interrupts()
    args = build_parser().parse_args(argv)
    try:
        out = import_gguf(args.src, args.dst, dtype=args.dtype, force=args.force, check=args.verify,
                          max_shard_bytes=parse_size(args.max_shard_size))
    except (ValueError, OSError) as e:
        message = str(e) if isinstance(e, GGUFImportError) else _one_line(e)
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
