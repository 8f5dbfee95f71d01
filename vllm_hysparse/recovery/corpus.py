# SPDX-License-Identifier: Apache-2.0
"""Offline text for recovery and validation, from files every Python installation has.

Training text: the standard library's own sources (code, comments,
docstrings) and the long descriptions of installed packages (English prose
in their `METADATA`). Held-out text: the Python reference documentation
shipped as `pydoc_data/topics.py` (prose with code examples), which is never
part of the training text.
"""

import random
import sysconfig
from pathlib import Path

import torch

from vllm_hysparse.reference.evaluation import cut_windows


def heldout_text() -> str:
    """The Python reference documentation topics, as plain text (prose and code)."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("pydoc_data", "test", "tests", "idlelib", "site-packages", "lib2to3", "encodings")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def _package_descriptions() -> list[Path]:
    purelib = Path(sysconfig.get_paths()["purelib"])
    return sorted(purelib.glob("*.dist-info/METADATA"))


def training_text(max_chars: int, seed: int = 0) -> str:
    """About `max_chars` characters: stdlib sources and package descriptions, shuffled by file, deterministic."""
    files = _stdlib_sources() + _package_descriptions()
    random.Random(seed).shuffle(files)
    parts, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.name == "METADATA":
            # Headers are key: value lines; the description follows the first blank line.
            text = text.split("\n\n", 1)[-1]
        if len(text) < 2000:
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n\n".join(parts)


def windows_of(tokenizer, text: str, seq_len: int, count: int) -> list[torch.Tensor]:
    """Up to `count` non-overlapping `[1, seq_len]` windows, spread evenly over the text."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = cut_windows(ids, seq_len)
    n = len(windows)
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    picks = sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(min(count, n))})
    return [windows[i][None].clone() for i in picks]
