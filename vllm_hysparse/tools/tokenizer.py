# SPDX-License-Identifier: Apache-2.0
"""A small byte-level BPE tokenizer trained locally on the Python standard library's sources.

Nothing is downloaded: the corpus is the `.py` files of the running Python's
stdlib, read in sorted order, so the same Python builds the same tokenizer.
The trained tokenizer is cached under `~/.cache/vllm_hysparse/`.
"""

import hashlib
import os
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from vllm_hysparse import envs

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
# ChatML: what `vllm serve`'s chat endpoint renders messages with.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_files(max_bytes: int) -> list[Path]:
    """Stdlib `.py` files in sorted order, up to about `max_bytes` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if total >= max_bytes:
            break
        if path.parent.name in ("test", "tests", "idle_test"):
            continue
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise RuntimeError(f"no Python sources found under {root} to train the tokenizer on")
    return files


def read_corpus(files: list[Path]):
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def _cache_path(vocab_size: int, files: list[Path]) -> Path:
    key = hashlib.sha256(f"{vocab_size}|".encode())
    for f in files:
        key.update(f"{f.name}:{f.stat().st_size};".encode())
    root = Path(os.environ.get(envs.CACHE.name, Path.home() / ".cache" / "vllm_hysparse"))
    return root / f"bpe-{vocab_size}-{key.hexdigest()[:16]}.json"


def train_tokenizer(vocab_size: int = 8192, max_bytes: int = 4_000_000) -> Tokenizer:
    """Train (or load from cache) a byte-level BPE with our special tokens."""
    files = corpus_files(max_bytes)
    cache = _cache_path(vocab_size, files)
    if cache.exists():
        return Tokenizer.from_file(str(cache))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(read_corpus(files), trainer=trainer, length=len(files))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(cache)
    return tok


def build_hf_tokenizer(vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """The trained tokenizer wrapped for transformers / vLLM, with a ChatML chat template."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size),
        bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 30,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
