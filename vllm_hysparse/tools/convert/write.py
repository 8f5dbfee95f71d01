# SPDX-License-Identifier: Apache-2.0
"""Writing the converted checkpoint: `convert` stages the config, the copied tokenizer files and the weights
in a temporary directory beside `--dst` and publishes it (`vllm_hysparse.tools.staging`); `write_weights`
streams the source one tensor at a time into output shards through the shared `ShardWriter`
(`vllm_hysparse.tools.checkpoint_io`), so memory is bounded by one output shard; `check_written` checks
the result holds exactly the target config's tensors.
"""

import shutil
from pathlib import Path

from safetensors import safe_open
from tqdm import tqdm

from vllm_hysparse.configs.base import HySparseBaseConfig
from vllm_hysparse.configs.tensors import check_complete, check_tensor, expected_tensors
from vllm_hysparse.tools.checkpoint_io import ShardWriter
from vllm_hysparse.tools.convert.conversion import Conversion
from vllm_hysparse.tools.convert.identity import verify
from vllm_hysparse.tools.convert.rename import init_tensor
from vllm_hysparse.tools.staging import check_replaceable, staged_output

COPIED_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                "*.tiktoken", "chat_template*", "generation_config.json")


def write_weights(conv: Conversion, out: Path, max_shard_bytes: int) -> list[str]:
    """Stream source shards one tensor at a time into output shards."""
    expected, writer = expected_tensors(conv.config), ShardWriter(out, max_shard_bytes)
    for fname, names in conv.shards.items():
        with safe_open(conv.src / fname, framework="pt") as f:
            for name in tqdm(names, desc=fname, unit="tensor"):
                tensor = f.get_tensor(name)
                for i, (target, scale) in enumerate(conv.routes[name]):
                    writer.add(target, tensor if i == 0 and scale == 1.0 else tensor * scale)
                for target in conv.inits.get(name, ()):
                    writer.add(target, init_tensor(target, expected[target], tensor.dtype))
    return writer.finish()


def copy_side_files(src: Path, out: Path) -> list[str]:
    """Tokenizer files and generation config, byte for byte."""
    copied = sorted({p.name for pattern in COPIED_FILES for p in src.glob(pattern) if p.is_file()})
    for name in copied:
        shutil.copy2(src / name, out / name)
    return copied


def convert(conv: Conversion, dst: str | Path, *, force: bool = False, max_shard_bytes: int = 5 << 30,
            check: bool = False, calibrate=None) -> Path:
    """Write the converted checkpoint into a temporary directory beside `dst`, then move it there.

    Refuses a non-empty `dst` unless `force`; a failure (including `check`,
    the logits match against the teacher), Ctrl-C or kill leaves `dst`
    untouched (see `vllm_hysparse.tools.staging`). `calibrate(tmp)`, when
    given, then rewrites the staged weights (`--calibrate`: recovery stage 0).
    """
    dst = Path(dst)
    _check_destination(conv.src, dst, force)
    with staged_output(dst) as tmp:
        conv.config.save_pretrained(tmp)
        copy_side_files(conv.src, tmp)
        write_weights(conv, tmp, max_shard_bytes)
        check_written(conv.config, tmp)
        if check:
            print(verify(conv, tmp))
        if calibrate is not None:
            calibrate(tmp)
            check_written(conv.config, tmp)
    return dst


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    if dst.resolve() == src.resolve():
        raise ValueError("--dst must differ from --src")
    check_replaceable(dst, force, ValueError)


def check_written(config: HySparseBaseConfig, out: Path) -> None:
    """The written tensors are exactly `expected_tensors(config)` (what vLLM's loader checks)."""
    expected, seen = expected_tensors(config), set()
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                check_tensor(expected, name, tuple(f.get_slice(name).get_shape()))
                seen.add(name)
    check_complete(expected, seen)
