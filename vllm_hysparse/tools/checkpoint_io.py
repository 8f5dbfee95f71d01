# SPDX-License-Identifier: Apache-2.0
"""Checkpoint shards, shared by the tools that write weights (`convert`, `make_checkpoint`, `import_gguf`):
`ShardWriter` takes tensors one at a time and writes a shard whenever the next tensor would pass the size
limit, then names the shards `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` (or
`model.safetensors` alone); `save_sharded` writes a whole state dict {name: tensor} through it; `parse_size`
reads `--max-shard-size` (`500MB`, `5GB`, bytes).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm


class ShardWriter:
    """Collects output tensors and writes a shard whenever the next one would pass `max_bytes`."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.parts: list[tuple[str, list[str]]] = []
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        part = f".part-{len(self.parts):05d}.safetensors"
        save_file(self.buffer, str(self.out / part), metadata={"format": "pt"})
        self.parts.append((part, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def finish(self) -> list[str]:
        """Name the shards `model-0000i-of-0000n` (or `model.safetensors` alone) and write the index."""
        if self.buffer or not self.parts:
            self.flush()
        if len(self.parts) == 1:
            (self.out / self.parts[0][0]).rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        n, weight_map, names = len(self.parts), {}, []
        for i, (part, tensors) in enumerate(self.parts):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / part).rename(self.out / fname)
            weight_map.update(dict.fromkeys(tensors, fname))
            names.append(fname)
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names


def save_sharded(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[str]:
    """Write `model.safetensors`, or numbered shards plus `model.safetensors.index.json`."""
    writer = ShardWriter(out, max_shard_bytes)
    for name, tensor in tqdm(state.items(), desc="writing weights", unit="tensor", leave=False):
        writer.add(name, tensor)
    return writer.finish()


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for unit, mult in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)
