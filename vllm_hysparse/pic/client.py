# SPDX-License-Identifier: Apache-2.0
"""Client-side helpers for PIC requests (SPEC §4) with the `openai` client.

    ids, lengths = pic_prompt(tokenizer, ["You are ...", "doc 1", "doc 2", "Question: ..."])
    client.completions.create(model=model, prompt=ids, max_tokens=32,
                              extra_body=pic_extra_body(lengths, seam=8))

The first text (the prefix) is tokenized with the tokenizer's special tokens
(BOS), the others without, exactly as the server's text-level way in
(`vllm_xargs.pic_text_segments`, see `vllm_hysparse.pic.middleware`) does.
"""

from collections.abc import Sequence

from vllm_hysparse.pic.layout import DEFAULT_SEAM, SEAM_FIELD, SEGMENTS_FIELD

TEXT_SEGMENTS_FIELD = "pic_text_segments"


def tokenize_segments(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of every segment: the first with the tokenizer's special tokens, the rest without."""
    return [list(tokenizer.encode(text, add_special_tokens=(i == 0))) for i, text in enumerate(texts)]


def pic_prompt(tokenizer, texts: Sequence[str]) -> tuple[list[int], list[int]]:
    """Texts of the segments (prefix, reusable segments, query) -> (prompt token ids, `pic_segments`)."""
    if isinstance(texts, str) or len(texts) < 2:
        raise ValueError("texts: need at least 2 segments, a prefix and the query")
    pieces = tokenize_segments(tokenizer, texts)
    for i, piece in enumerate(pieces):
        if not piece:
            raise ValueError(f"texts: segment {i} ({texts[i]!r}) has no tokens")
    return [t for piece in pieces for t in piece], [len(piece) for piece in pieces]


def pic_extra_body(lengths: Sequence[int], seam: int = DEFAULT_SEAM, **extra) -> dict:
    """`extra_body` of an `openai` completion request with token ids from `pic_prompt`.

    `extra` goes into the body next to `vllm_xargs` (e.g. `return_token_ids=True`).
    """
    return {"vllm_xargs": {SEGMENTS_FIELD: [int(n) for n in lengths], SEAM_FIELD: int(seam)}, **extra}


def pic_text_extra_body(texts: Sequence[str], seam: int = DEFAULT_SEAM, **extra) -> dict:
    """`extra_body` for the server-side text way in: send it with `prompt=""`."""
    return {"vllm_xargs": {TEXT_SEGMENTS_FIELD: list(texts), SEAM_FIELD: int(seam)}, **extra}
