# SPDX-License-Identifier: Apache-2.0
"""Experiment: carry the committed HySparse delta over to a plan with more full layers.

    python transplant.py --delta deltas/smollm2-hysparse --base checkpoints/smollm2-hysparse-full18 --out delta-t/

The delta's tensors of layers that are full in the new base (the teacher's attention, nothing to train) are
dropped; every other tensor is kept as trained (a sparse layer whose oracle changed, e.g. 19 reading 18 instead
of 16, keeps factors trained against the old oracle's K/V, and retraining has to move them). The base digest is
recomputed on the new base, so `recovery train --resume` accepts it. Written as `delta.safetensors` with the
delta's metadata otherwise unchanged.
"""

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from vllm_hysparse.recovery.__main__ import read_delta
from vllm_hysparse.recovery.lora import base_digest, check_delta, converted_linears


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delta", type=Path, required=True)
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    tensors, meta = read_delta(args.delta)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    full = [i for i, t in enumerate(base.config.layer_types) if t == "full_attention"]
    prefixes = tuple(f"model.layers.{i}." for i in full)
    kept = {k: v for k, v in tensors.items() if not k.startswith(prefixes)}
    print(f"kept {len(kept)} of {len(tensors)} tensors (dropped those of full layers {full})")
    meta = dict(meta, base_digest=base_digest(base, converted_linears(base)))
    check_delta(base, kept, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in kept.items()}, str(args.out / "delta.safetensors"), metadata=meta)


if __name__ == "__main__":
    main()
