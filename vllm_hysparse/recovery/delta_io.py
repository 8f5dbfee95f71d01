# SPDX-License-Identifier: Apache-2.0
"""The files of a delta directory (`recovery train` writes them, `apply`, `carry` and `--resume` read them)."""

from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open

DELTA_FILE, REPORT_FILE = "delta.safetensors", "recovery.json"
INIT_REPORT, BASE_CONFIG = "init.json", "base_config.json"


def read_delta(path: Path) -> tuple[dict, dict]:
    """(tensors, metadata) of the delta in directory `path`; a one-line ValueError where there is none."""
    file = path / DELTA_FILE
    if not file.is_file():
        raise ValueError(f"{path}: no {DELTA_FILE} (is it a delta written by `recovery train`?)")
    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
        return load_file(str(file)), meta
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: unreadable delta ({e})") from None
