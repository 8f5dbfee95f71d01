# SPDX-License-Identifier: Apache-2.0
"""Publish-only PIC requests: compute a prompt's segments and write them to the shared tier, generate nothing.

A `/v1/completions` PIC request (token ids with `vllm_xargs.pic_segments`, or `pic_text_segments`) with
`"max_tokens": 0` is served by the PIC middleware as follows:
1. vLLM refuses `max_tokens` below 1, so the request runs with one greedy output token: its cold segments are
   computed in isolation, stored in the instance's first tier and queued for the shared tier
   (`VLLM_HYSPARSE_PIC_SHARED`), exactly as for any PIC request;
2. the answer is held until the instance's worker has written everything it had queued
   (`shared_published + shared_publish_failures` reach `shared_queued` in the counters the worker keeps for
   `/metrics`, which it writes as they move), at most `PUBLISH_WAIT_S`;
3. the answer carries no generated text: each choice's `text` is `""`, `usage.completion_tokens` is 0, and the
   header `x-hysparse-pic-published` says `1` (every queued segment written, or none was queued), `0` (some
   write failed) or `timeout`.

Without a shared tier the request only warms the instance's own store (nothing is queued, so the answer is not
held). Streaming, `echo`, `logprobs` and `n` above 1 have nothing to show for such a request and are refused
with a 400 naming the field. This is what `vllm_hysparse.pic.router` sends for each cold segment.
"""

import asyncio
import json
import os
import time

from vllm_hysparse.pic.client import TEXT_SEGMENTS_FIELD
from vllm_hysparse.pic.layout import SEGMENTS_FIELD

PUBLISH_WAIT_S = 60.0
PUBLISHED_HEADER = b"x-hysparse-pic-published"


class PublishOnlyError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def is_publish_only(data) -> bool:
    """True for a parsed completion body that asks for PIC segments to be published, not for tokens."""
    if not isinstance(data, dict) or data.get("max_tokens") != 0 or isinstance(data.get("max_tokens"), bool):
        return False
    xargs = data.get("vllm_xargs")
    return isinstance(xargs, dict) and (SEGMENTS_FIELD in xargs or TEXT_SEGMENTS_FIELD in xargs)


def engine_request(data: dict) -> dict:
    """The body vLLM runs for a publish-only request (one greedy token); `PublishOnlyError` for what it cannot
    show."""
    if data.get("stream"):
        raise PublishOnlyError("stream", "max_tokens 0 (publish the segments only) has nothing to stream")
    if data.get("echo"):
        raise PublishOnlyError("echo", "max_tokens 0 (publish the segments only) returns no text to echo")
    if data.get("logprobs") is not None:
        raise PublishOnlyError("logprobs", "max_tokens 0 (publish the segments only) generates no tokens")
    if data.get("n") not in (None, 1):
        raise PublishOnlyError("n", "max_tokens 0 (publish the segments only) needs n = 1")
    return {**data, "max_tokens": 1, "min_tokens": 0, "temperature": 0}


def shared_counts(directory: str | os.PathLike | None) -> tuple[int, int, int]:
    """(queued, written, failed) shared-tier entries over this server's workers, from their counter files."""
    from vllm_hysparse.metrics import read_totals

    if directory is None:
        return 0, 0, 0
    totals = read_totals(directory)
    return tuple(totals.get(f"pic_shared_{k}", 0) for k in ("queued", "published", "publish_failures"))


async def wait_published(directory, failures_before: int, timeout_s: float = PUBLISH_WAIT_S,
                         poll_s: float = 0.01) -> bytes:
    """Wait until the workers have written everything they queued; the `x-hysparse-pic-published` value
    (`0` when a write failed since `failures_before` was read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        queued, written, failed = shared_counts(directory)
        if written + failed >= queued:
            return b"1" if failed == failures_before else b"0"
        if time.monotonic() >= deadline:
            return b"timeout"
        await asyncio.sleep(poll_s)


def strip_generation(body: bytes) -> bytes:
    """A vLLM completion answer without its generated token: empty texts, no completion tokens."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict):
        return body
    for choice in data.get("choices") or []:
        if isinstance(choice, dict):
            choice.update(text="", logprobs=None, finish_reason="length", token_ids=None)
    usage = data.get("usage")
    if isinstance(usage, dict):
        usage["total_tokens"] = usage.get("prompt_tokens", 0)
        usage["completion_tokens"] = 0
    return json.dumps(data).encode()
