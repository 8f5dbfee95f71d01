# SPDX-License-Identifier: Apache-2.0
"""Text-level PIC requests for plain OpenAI clients (SPEC §4).

A `/v1/completions` request may give its segments as text instead of token ids:

    {"model": ..., "prompt": "", "max_tokens": 32,
     "vllm_xargs": {"pic_text_segments": ["system ...", "doc 1", "doc 2", "question"],
                    "pic_seam_tokens": 8}}

`PICTextMiddleware` (pure ASGI) tokenizes every text on its own with the
server's tokenizer (the first with the tokenizer's special tokens, the rest
without, like `vllm_hysparse.pic.client.pic_prompt`), and rewrites the JSON
body: `prompt` becomes the concatenated token ids, `vllm_xargs.pic_segments`
their lengths, and `pic_text_segments` is dropped. From there the request is
an ordinary token-level PIC request, validated by `vllm_hysparse.pic.frontend`.
Malformed text requests get a 400 JSON error (vLLM's `ErrorResponse`) naming
the field.

Installation needs no flag: `install_pic_middleware()` (run from the plugin's
`register()`) has `vllm_hysparse.vllm_glue.launcher` add the middleware to
every API server app before vLLM's own, so it is the innermost one: it runs after vLLM's
`AuthenticationMiddleware` (`--api-key`), CORS, and the rest. It can also be
given as `--middleware vllm_hysparse.pic.middleware.PICTextMiddleware`
(vLLM puts such middleware outside the authentication one); then, and in any
case, it leaves requests that fail the API-key check untouched, so vLLM's
authentication still answers them with 401 and nothing is tokenized for them.
It passes every request through untouched unless the served model is
HySparse / HySparse2 and the request is a POST to `/v1/completions` whose body
mentions `pic_text_segments`, or is a PIC request with `max_tokens` 0: a
publish-only request (`vllm_hysparse.pic.publish`), whose answer it holds until
the segments are written to the shared tier and returns without generated text.
"""

import json
import os
import re

from vllm_hysparse.metrics import METRICS_DIR_ENV
from vllm_hysparse.pic.client import TEXT_SEGMENTS_FIELD, pic_prompt
from vllm_hysparse.pic.frontend import is_pic_model
from vllm_hysparse.pic.layout import SEGMENTS_FIELD
from vllm_hysparse.pic.publish import (
    PUBLISHED_HEADER,
    PublishOnlyError,
    engine_request,
    is_publish_only,
    shared_counts,
    strip_generation,
    wait_published,
)
from vllm_hysparse.vllm_glue.launcher import (
    add_api_server_middleware,
    request_authorized,
    served_state,
    served_tokenizer,
    served_vllm_config,
    validation_error_response,
)

COMPLETIONS_PATH = "/v1/completions"
_HOOK_FLAG = "_hysparse_pic_middleware"
_MARKER = TEXT_SEGMENTS_FIELD.encode()
# A body that may ask for max_tokens 0: the only other PIC bodies this middleware must parse (a token-id PIC
# request can be long, and vLLM parses it again).
_MAX_TOKENS_ZERO = re.compile(rb'"max_tokens"\s*:\s*0(?![\d.eE])')


class PICTextError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def rewrite_text_request(data, tokenizer, max_model_len: int | None = None) -> dict | None:
    """A parsed completion request body -> the rewritten body, or None when it is not a text-level PIC request.

    Raises `PICTextError` naming the field for malformed input. With `max_model_len`, more segments than that
    (each needs a token) are refused before anything is tokenized.
    """
    if not isinstance(data, dict):
        return None
    xargs = data.get("vllm_xargs")
    if not isinstance(xargs, dict) or TEXT_SEGMENTS_FIELD not in xargs:
        return None
    texts = xargs[TEXT_SEGMENTS_FIELD]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise PICTextError(TEXT_SEGMENTS_FIELD, f"must be a list of strings (got {texts!r:.200})")
    if len(texts) < 2:
        raise PICTextError(TEXT_SEGMENTS_FIELD,
                           f"needs at least 2 segments, a prefix and the query (got {len(texts)})")
    if max_model_len is not None and len(texts) > max_model_len:
        raise PICTextError(TEXT_SEGMENTS_FIELD, f"{len(texts)} segments cannot fit the model's context of "
                                                f"{max_model_len} tokens (every segment needs a token)")
    if SEGMENTS_FIELD in xargs:
        raise PICTextError(SEGMENTS_FIELD, f"give either {SEGMENTS_FIELD} (with a token-id prompt) or "
                                           f"{TEXT_SEGMENTS_FIELD}, not both")
    if data.get("prompt") not in (None, "", [], [""]):
        raise PICTextError("prompt", f"must be empty or absent when vllm_xargs.{TEXT_SEGMENTS_FIELD} "
                                     "gives the prompt's text")
    if data.get("prompt_embeds") is not None:
        raise PICTextError("prompt_embeds", f"cannot be combined with vllm_xargs.{TEXT_SEGMENTS_FIELD}")
    try:
        ids, lengths = pic_prompt(tokenizer, texts)
    except ValueError as e:
        raise PICTextError(TEXT_SEGMENTS_FIELD, str(e).removeprefix("texts: ")) from None
    except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate: HF tokenizers raise TypeError
        raise PICTextError(TEXT_SEGMENTS_FIELD, f"a segment cannot be tokenized ({type(e).__name__}: "
                                                f"{str(e)[:200]})") from None
    rest = {k: v for k, v in xargs.items() if k != TEXT_SEGMENTS_FIELD}
    return {**data, "prompt": ids, "vllm_xargs": {**rest, SEGMENTS_FIELD: lengths}}


class PICTextMiddleware:
    """Pure ASGI middleware: `vllm_xargs.pic_text_segments` -> token-id prompt and `pic_segments`."""

    def __init__(self, app):
        self.app = app

    def _engaged(self, scope):
        """The app state when this request may be a text-level PIC request, else None."""
        if scope["type"] != "http" or scope.get("method") != "POST":
            return None
        if scope["path"].removeprefix(scope.get("root_path", "")) != COMPLETIONS_PATH:
            return None
        state = served_state(scope)
        vllm_config = served_vllm_config(state)
        if vllm_config is None or not is_pic_model(vllm_config.model_config):
            return None
        if not request_authorized(scope, state):
            return None  # vLLM's authentication answers it
        return state

    async def __call__(self, scope, receive, send):
        state = self._engaged(scope)
        if state is None:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return await self.app(scope, _replay(b"".join(chunks), receive, message), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if _MARKER not in body and not _MAX_TOKENS_ZERO.search(body):
            return await self.app(scope, _replay(body, receive), send)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None  # vLLM answers malformed (or too deeply nested) JSON itself
        new = None
        try:
            if _MARKER in body:
                import anyio

                tokenizer = served_tokenizer(state)
                max_len = getattr(served_vllm_config(state).model_config, "max_model_len", None)
                new = await anyio.to_thread.run_sync(rewrite_text_request, data, tokenizer, max_len)
            publish_only = is_publish_only(new or data)
            if publish_only:
                new = engine_request(new or data)
        except (PICTextError, PublishOnlyError) as e:
            return await validation_error_response(str(e), e.field)(scope, receive, send)
        if new is not None:
            try:
                body = json.dumps(new).encode()
            except (ValueError, RecursionError):  # nested about as deep as json allows: leave it to vLLM
                new, publish_only = None, False
        if new is not None:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        if not publish_only:
            return await self.app(scope, _replay(body, receive), send)
        return await self._publish_only(scope, _replay(body, receive), send)

    async def _publish_only(self, scope, receive, send):
        """Run the one-token request, hold its answer until the segments it queued are written, strip the token."""
        directory = os.environ.get(METRICS_DIR_ENV)
        failures_before = shared_counts(directory)[2]
        start, parts = None, []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        if start is None:
            return
        body, headers = b"".join(parts), list(start.get("headers", []))
        if start["status"] == 200:
            published = await wait_published(directory, failures_before)
            body = strip_generation(body)
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers += [(b"content-length", str(len(body)).encode()), (PUBLISHED_HEADER, published)]
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytes, receive, pending=None):
    """A `receive` that gives `body` once (then `pending`, if any), then defers to the real one."""
    queue = [{"type": "http.request", "body": body, "more_body": False}]
    if pending is not None:
        queue.append(pending)

    async def replay():
        if queue:
            return queue.pop(0)
        return await receive()

    return replay


def install_pic_middleware() -> None:
    """Add `PICTextMiddleware` to every API server app vLLM builds in this process, innermost. Idempotent.

    Only acts in a process that has imported vLLM's API-server app module
    (`vllm serve` has by the time plugins load); elsewhere (engine core,
    workers, offline `LLM`) it does nothing and imports nothing.
    """
    add_api_server_middleware(_HOOK_FLAG, PICTextMiddleware, task="generate")
