# SPDX-License-Identifier: Apache-2.0
"""Greedy generation with the reference model of a checkpoint (no vLLM involved).

    python -m vllm_hysparse.tools.generate --model ckpt/ --prompt "def add(a, b):"
    python -m vllm_hysparse.tools.generate --model ckpt/ --chat --prompt "What is the capital of France?"
"""

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_hysparse  # noqa: F401  (registers our configs and models)
from vllm_hysparse.reference import CheckpointError


def generate(model_dir: str, prompt: str, max_new_tokens: int, chat: bool = False) -> str:
    """Greedy continuation of `prompt`; with `chat`, the reply to it as a user message (chat template)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    # A chat reply ends with the end-of-turn token; the text is what the user sees.
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=chat)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chat", action="store_true", help="send --prompt as a user message through the chat template")
    args = parser.parse_args(argv)
    try:
        text = generate(args.model, args.prompt, args.max_new_tokens, chat=args.chat)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"prompt:     {args.prompt!r}\ncompletion: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
