# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the recovery tests, also used by tests that train through the reference ops
(`tests/reference/test_fast_ops.py`): a small random dense Llama teacher and its HySparse / HySparse2
conversions, written once per session.

Every test draws from a fixed seed of its own (the global torch and `random` generators are seeded
before it runs, from `HYSPARSE_RECOVERY_SEED`, default 0, and the test's id); a failure report shows it.
"""

import os
import random
import zlib
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.vllm_utils import randomise
from vllm_hysparse.tools import convert
from vllm_hysparse.tools.tokenizer import build_hf_tokenizer

# Windows of 96 tokens: blocks of 8 with 3 selected, 16 tokens selected, windows of 16 -- every
# sparse mechanism is active at this length.
PLANS = {
    "hysparse": ["--full-layers", "0,3", "--block-size", "8", "--topk-blocks", "3", "--swa-window", "16"],
    "hysparse2": ["--topk-tokens", "16", "--recent-window", "8", "--swa-window", "16"],
}


SEED = int(os.environ.get("HYSPARSE_RECOVERY_SEED", "0"))


@pytest.fixture(autouse=True)
def fixed_seed(request) -> int:
    """The seed of this test's draws: `HYSPARSE_RECOVERY_SEED` plus a hash of the test id."""
    seed = SEED + zlib.crc32(request.node.nodeid.encode()) % 1_000_000
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{"teacher", "hysparse", "hysparse2"} -> checkpoint directories."""
    return write_checkpoints(tmp_path_factory.mktemp("recovery"))


@pytest.fixture(scope="session")
def servable_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """As `checkpoints`, with a head size vLLM's CPU attention serves (32; the others have 16)."""
    return write_checkpoints(tmp_path_factory.mktemp("recovery-servable"), hidden_size=128)


def write_checkpoints(root: Path, hidden_size: int = 64) -> dict[str, Path]:
    """A small random Llama teacher (4 heads) and its HySparse and HySparse2 conversions under `root`."""
    tok = build_hf_tokenizer(8192)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(config).eval()
    randomise(teacher, seed=0)  # peaked attention: selection and sharing matter
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    out = {"teacher": root / "teacher"}
    for arch, plan in PLANS.items():
        assert convert.main(["--src", str(root / "teacher"), "--dst", str(root / arch), "--arch", arch, *plan]) == 0
        out[arch] = root / arch
    return out
