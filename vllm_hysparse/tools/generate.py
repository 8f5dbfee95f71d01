# SPDX-License-Identifier: Apache-2.0
"""Greedy generation with the reference model of a checkpoint (no vLLM involved).

    python -m vllm_hysparse.tools.generate --model ckpt/ --prompt "def add(a, b):"
"""

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_hysparse  # noqa: F401  (registers our configs and models)
from vllm_hysparse.reference import CheckpointError


def generate(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        text = generate(args.model, args.prompt, args.max_new_tokens)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"prompt:     {args.prompt!r}\ncompletion: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
