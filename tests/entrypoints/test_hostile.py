# SPDX-License-Identifier: Apache-2.0
"""Hostile input against a real `vllm serve` on the tiny HySparse checkpoint.

More than 1,000 malformed requests, generated from a seeded table of cases x
variations (broken JSON and wrong types, bad `max_tokens`, prompts past the
context, out-of-vocabulary and negative token ids, empty prompts, bad PIC
fields in `vllm_xargs`, bad logprob counts, unknown models, bad chat messages,
bad sampling values, wrong methods and paths), are sent concurrently in
bounded batches. Every one must get a 4xx whose message names the problem,
`/health` must stay 200 between batches, and a known-good greedy request
(plain, PIC token-level and PIC text-level) must return exactly the tokens it
returned before the barrage.
"""

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from tests.entrypoints.serve_utils import API_KEY, MAX_LEN, VOCAB, error_of, pool_limits
from tests.vllm_utils import random_prompts

SEED = 20261201
BATCH = 32
MIN_REQUESTS = 1000
BARRAGE_TIMEOUT_S = 240  # whole barrage; each request also has its own timeout
REQUEST_TIMEOUT_S = 60
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# A known-good prompt and PIC layout for the before/after comparison.
GOOD_PROMPT = random_prompts([48], VOCAB, seed=77)[0]
GOOD_LAYOUT = [10, 20, 18]
GOOD_TEXTS = ["You answer from the documents.\n", "Document: the Rhine flows north through Basel.\n",
              "Document: the Danube flows east through Vienna.\n", "Question: which river flows through Vienna?"]


@dataclass
class Case:
    kind: str
    body: object  # dict -> JSON-encoded, bytes -> sent as is, None -> no body
    path: str = COMPLETIONS
    method: str = "POST"
    statuses: tuple[int, ...] = (400,)
    # The error's message or param must contain at least one of these (case-insensitive).
    names: tuple[str, ...] = ()
    headers: dict = field(default_factory=dict)

    def content(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


# ---- the case table ---------------------------------------------------------------------------------------------
# Each generator takes (rng, model) and returns one Case; the table says how many variations of each to draw.


def _ids(rng, n):
    return [rng.randrange(16, VOCAB) for _ in range(n)]


def _split(rng, total, parts):
    """`parts` positive ints summing to `total` (total >= parts)."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _cmpl(model_name, **kw):
    return {"model": model_name, "prompt": "def f(x):", "max_tokens": 4, **kw}


def _chat(model_name, **kw):
    return {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


JSON_NAMES = ("json", "body", "dictionary", "object", "parsing", "decode", "expect")


def broken_json(rng, model):
    path = rng.choice([COMPLETIONS, CHAT])
    valid = json.dumps(_cmpl(model) if path == COMPLETIONS else _chat(model)).encode()
    how = rng.randrange(9)
    if how == 0:  # truncated
        body = valid[:rng.randrange(1, len(valid) - 1)]
    elif how == 1:  # random garbage
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif how == 2:
        body = rng.choice([b"", b" ", b"{", b"}", b"{]", b"[", b"nul", b"{'a': 1}", b"{\"model\": }"])
    elif how == 3:  # valid JSON, not an object
        body = rng.choice([b"[1, 2]", b"\"prompt\"", b"null", b"42", b"true", b"[]", b"[{}]"])
    elif how == 4:  # non-UTF-8 inside a string
        body = valid.replace(b'"model": "', b'"model": "\xff\xfe\xc3', 1)
    elif how == 5:  # trailing garbage
        body = valid + rng.choice([b"}", b",", b" x", b"{}", b"\x00"])
    elif how == 6:  # deeply nested, mentioning the PIC text field (the PIC middleware parses such bodies)
        depth = rng.randrange(1100, 20000)
        body = (b'{"model": "%s", "prompt": "", "vllm_xargs": {"pic_text_segments": ' % model.encode()
                + b"[" * depth + b"]" * depth + b"}}")
    elif how == 7:  # deeply nested without it
        depth = rng.randrange(1100, 20000)
        body = b'{"model": "%s", "prompt": ' % model.encode() + b"[" * depth + b"]" * depth + b"}"
    else:  # unterminated string / bad escapes
        body = rng.choice([b'{"model": "abc', b'{"model": "\\x41"}', b'{"prompt": "\\ud800\\"}',
                           b'{"model": "m", "prompt": 1e999999999999}'])
    return Case("broken_json", body, path, names=JSON_NAMES, headers={"Content-Type": "application/json"})


WRONG_TYPES_CMPL = {
    "model": [5, [], {}, 1.5], "prompt": [{}, 5.5, True, [{"a": 1}], [[1, "x"]], [1.5, 2]],
    "max_tokens": ["ten", 1.5, [], {}], "temperature": ["hot", [], {}], "top_p": ["x", []],
    "n": ["two", 1.5, []], "stop": [5, {"a": 1}, [1, 2]], "stream": ["maybe", [], {}],
    "logprobs": ["five", [], 1.5], "seed": ["abc", 1.5, []], "echo": ["perhaps", [1]],
    "logit_bias": [[1, 2], "x", {"5": "b"}], "vllm_xargs": ["str", [1], {"k": {"nested": 1}}, {"k": [[1]]}],
    "presence_penalty": ["x", []], "min_tokens": ["x", 2.5], "ignore_eos": ["x", [1]],
    "return_token_ids": ["x", {}], "user": [5, []], "suffix": [5, []],
}  # (unknown fields such as best_of are ignored by vLLM: see test_recorded_vllm_behaviour)
WRONG_TYPES_CHAT = {
    "model": [5, []], "messages": ["hi", {}, [[]]], "max_completion_tokens": ["x", 2.5],
    "max_tokens": ["x", []], "tools": ["x", 5, [5]], "tool_choice": [5, ["x"]], "response_format": ["x", 5],
    "logprobs": ["x", []], "top_logprobs": ["x", 1.5], "stream": ["maybe"], "temperature": ["cold"],
    "vllm_xargs": ["str", {"k": {"a": 1}}], "chat_template_kwargs": ["x", 5], "stop": [5, {"a": 1}],
}


def wrong_types(rng, model):
    chat = rng.random() < 0.35
    table = WRONG_TYPES_CHAT if chat else WRONG_TYPES_CMPL
    name = rng.choice(sorted(table))
    value = rng.choice(table[name])
    body = (_chat if chat else _cmpl)(model, **{name: value})
    return Case("wrong_type", body, CHAT if chat else COMPLETIONS, names=(name,))


def bad_max_tokens(rng, model):
    chat = rng.random() < 0.3
    how = rng.randrange(3)
    if how == 0:
        value = -rng.choice([1, 2, rng.randrange(3, 10**6), 10**9, 2**31, 2**63])
    elif how == 1:
        # (max_tokens == max_model_len is accepted by vLLM and capped to the context left: not malformed)
        value = rng.choice([MAX_LEN + 1, rng.randrange(MAX_LEN + 1, 10**6), 10**9, 2**31, 2**63 - 1])
    else:
        value = rng.choice([2**64, 10**30])
    key = rng.choice(["max_tokens", "max_completion_tokens"]) if chat else "max_tokens"
    body = _chat(model, **{key: value}) if chat else _cmpl(model, prompt=_ids(rng, 8), max_tokens=value)
    return Case("max_tokens", body, CHAT if chat else COMPLETIONS,
                names=("max_tokens", "max_completion_tokens", "maximum context length", "context length"))


def long_prompt(rng, model):
    how = rng.randrange(4)
    n = rng.randrange(MAX_LEN + 1, 6 * MAX_LEN)
    if how == 0:
        body = _cmpl(model, prompt=_ids(rng, n), max_tokens=1)
    elif how == 1:
        body = _cmpl(model, prompt=" ".join(rng.choice(["alpha", "beta", "gamma", "x = 1"]) for _ in range(n)))
    elif how == 2:
        body = _cmpl(model, prompt=[_ids(rng, 5), _ids(rng, n)], max_tokens=1)
    else:
        return Case("long_prompt", _chat(model, messages=[{"role": "user", "content": "word " * n}]), CHAT,
                    names=("context length", "maximum", "prompt", "too long", "max_model_len"))
    return Case("long_prompt", body, names=("context length", "maximum", "prompt", "too long", "max_model_len"))


def bad_token_ids(rng, model):
    prompt = _ids(rng, rng.randrange(1, 40))
    bad = rng.choice([VOCAB, VOCAB + 1, rng.randrange(VOCAB, 10**6), 2**31, 2**63 - 1, 10**20,
                      -1, -rng.randrange(2, 10**6), -2**31, -2**63])
    # (vLLM's schema refuses some of these itself, naming body.prompt.<index>)
    prompt.insert(rng.randrange(len(prompt) + 1), bad)
    how = rng.randrange(3)
    if how == 0:
        body = _cmpl(model, prompt=prompt)
    elif how == 1:
        body = _cmpl(model, prompt=[_ids(rng, 4), prompt])
    else:  # with a PIC layout that is otherwise right
        body = _cmpl(model, prompt=prompt, vllm_xargs={"pic_segments": [1, len(prompt) - 1]})
    return Case("token_ids", body, names=("out of vocabulary", "vocab", "token id", "prompt"))


def empty_prompt(rng, model):
    how = rng.randrange(4)
    if how == 0:
        body = _cmpl(model, prompt=[])
    elif how == 1:
        body = _cmpl(model, prompt=[[]])
    elif how == 2:
        body = _cmpl(model, prompt=[_ids(rng, 3), []])
    else:
        body = {k: v for k, v in _cmpl(model).items() if k != "prompt"}
    return Case("empty_prompt", body, names=("empty", "prompt"))


def bad_pic_segments(rng, model):
    n = rng.randrange(8, 120)
    prompt = _ids(rng, n)
    parts = rng.randrange(2, 6)
    good = _split(rng, n, parts)
    how = rng.randrange(11)
    names = ("pic_segments",)
    if how == 0:  # wrong sum
        segs = list(good)
        segs[rng.randrange(parts)] += rng.choice([-1, 1]) * rng.randrange(1, 50)
        if sum(segs) == n or min(segs) < 1:
            segs[0] = n + 1
    elif how == 1:  # a zero length
        segs = list(good)
        segs.insert(rng.randrange(parts + 1), 0)
    elif how == 2:  # a negative length that keeps the sum
        segs = [n + 5, -5]
    elif how == 3:  # strings
        segs = rng.choice([[str(x) for x in good], ",".join(map(str, good)), [good[0], "rest"]])
    elif how == 4:  # floats
        segs = [float(x) for x in good]
    elif how == 5:  # nested lists (vLLM's request schema refuses these itself)
        segs = [[x] for x in good]
        names = ("pic_segments", "vllm_xargs")
    elif how == 6:  # fewer than 2
        segs = rng.choice([[n], []])
    elif how == 7:  # not a list
        segs = rng.choice([n, 0, -n, 1.5])
    elif how == 8:  # huge values (past 64 bits vLLM refuses them itself, naming extra_args)
        segs = rng.choice([[10**30, n - 10**30], [2**64, 2**64], [2**40, n - 2**40], [2**62, 2**62]])
        names = ("pic_segments", "extra_args")
    elif how == 9:  # a dict (refused by vLLM's schema)
        segs = {"a": 1}
        names = ("pic_segments", "vllm_xargs")
    else:  # right for the ids, wrong for a text prompt / chat
        segs = [1, 1]
        xargs = {"pic_segments": segs}
        if rng.random() < 0.5:
            return Case("pic_segments", _cmpl(model, prompt="def f(x):\n    return x * 2\n", vllm_xargs=xargs),
                        names=names)
        return Case("pic_segments", _chat(model, vllm_xargs=xargs), CHAT, names=names)
    xargs = {"pic_segments": segs}
    if rng.random() < 0.3:
        xargs["pic_seam_tokens"] = rng.randrange(0, 16)
    return Case("pic_segments", _cmpl(model, prompt=prompt, vllm_xargs=xargs), names=names)


def bad_pic_seam(rng, model):
    n = rng.randrange(8, 120)
    prompt = _ids(rng, n)
    segs = _split(rng, n, rng.randrange(2, 5))
    names = ("pic_seam_tokens",)
    how = rng.randrange(6)
    if how == 0:
        seam = -rng.choice([1, 2, rng.randrange(3, 10**9), 2**63])
    elif how == 1:
        seam = rng.choice([2.5, 0.5, -0.0 + 1.25, 8.0])
    elif how == 2:
        seam = rng.choice(["8", "", "eight"])
    elif how == 3:
        seam = [8]
    elif how == 4:  # past any useful value (past 64 bits vLLM refuses it itself, naming extra_args)
        seam = rng.choice([2**64, 10**30, 2**63 + 1, 2**31, 2**40, 2**63 - 1])
        names = ("pic_seam_tokens", "extra_args")
    else:  # without pic_segments
        return Case("pic_seam", _cmpl(model, prompt=prompt, vllm_xargs={"pic_seam_tokens": rng.randrange(0, 9)}),
                    names=names)
    return Case("pic_seam", _cmpl(model, prompt=prompt, vllm_xargs={"pic_segments": segs, "pic_seam_tokens": seam}),
                names=names)


def bad_pic_text(rng, model):
    names = ("pic_text_segments",)
    how = rng.randrange(11)
    prompt = ""
    xargs: dict = {}
    path = COMPLETIONS
    if how == 0:
        texts = rng.choice(["just one string", 5, 2.5, ""])
    elif how == 1:
        texts = ["prefix", rng.choice([3, 1.5]), "query"]
    elif how == 2:
        texts = [rng.choice(["only the query", "x"])]
    elif how == 3:
        texts = ["prefix", "", "query"]
    elif how == 4:  # a lone surrogate: no tokenizer accepts it
        texts = ["prefix", "doc \ud800 text", "query"]
    elif how == 5:  # a non-empty prompt too
        texts, prompt = ["prefix", "query"], rng.choice(["text too", [5, 6]])
        names = ("prompt",)
    elif how == 6:  # pic_segments too
        texts, xargs = ["prefix", "query"], {"pic_segments": [1, 1]}
        names = ("pic_segments",)
    elif how == 7:  # a bad seam: passes the middleware, refused by the frontend
        texts, xargs = ["prefix", "doc", "query"], {"pic_seam_tokens": rng.choice([-1, -100, 2.5, "8"])}
        names = ("pic_seam_tokens",)
    elif how == 8:  # nested lists, or more segments than the context has tokens
        texts = [["prefix"], ["query"]] if rng.random() < 0.5 else ["seg"] * rng.randrange(MAX_LEN + 1, 4 * MAX_LEN)
    elif how == 9:  # on the chat endpoint, where it is not understood
        return Case("pic_text", _chat(model, vllm_xargs={"pic_text_segments": ["a", "b"]}), CHAT, names=names)
    else:  # tokenized past the context
        texts = ["prefix", "alpha beta gamma " * rng.randrange(MAX_LEN, 3 * MAX_LEN), "query"]
        names = ("context length", "maximum", "prompt")
    body = _cmpl(model, prompt=prompt, vllm_xargs={"pic_text_segments": texts, **xargs})
    return Case("pic_text", body, path, names=names)


def bad_logprobs(rng, model):
    how = rng.randrange(6)
    if how == 0:
        value = rng.choice([-2, -5, -rng.randrange(6, 10**6)])
        return Case("logprobs", _cmpl(model, logprobs=value), names=("logprobs",))
    if how == 1:
        value = rng.choice([21, 50, rng.randrange(21, 10**6), 10**9, VOCAB])
        return Case("logprobs", _cmpl(model, logprobs=value), names=("logprobs",))
    if how == 2:
        value = rng.choice([-2, -7, 21, 100, 10**6])
        return Case("logprobs", _chat(model, logprobs=True, top_logprobs=value), CHAT, names=("logprobs",))
    if how == 3:
        value = rng.choice([-2, -9, 21, 10**6])
        return Case("logprobs", _cmpl(model, prompt_logprobs=value), names=("logprobs",))
    if how == 4:  # prompt logprobs of a PIC request: interior rows have no logits
        n = rng.randrange(8, 100)
        body = _cmpl(model, prompt=_ids(rng, n), prompt_logprobs=rng.randrange(0, 6),
                     vllm_xargs={"pic_segments": _split(rng, n, rng.randrange(2, 5))})
        return Case("logprobs", body, names=("prompt_logprobs",))
    return Case("logprobs", _chat(model, top_logprobs=rng.randrange(1, 6)), CHAT, names=("logprobs",))


def unknown_model(rng, model):
    name = rng.choice([
        "gpt-4", "no-such-model", model + "-x", model.upper() if model.upper() != model else model + "X",
        "../../etc/passwd", "x" * rng.randrange(100, 5000), "模型", "a/b/c", " " + model, model + "\n", "%00"])
    path = rng.choice([COMPLETIONS, CHAT])
    body = _cmpl(model) if path == COMPLETIONS else _chat(model)
    body["model"] = name
    return Case("unknown_model", body, path, statuses=(404,), names=("model", "does not exist", "not found"))


BAD_MESSAGES = [
    "hi", {"role": "user", "content": "hi"}, [[{"role": "user", "content": "hi"}]],  # (5: see KNOWN_VLLM)
    [{"content": "hi"}], [{"role": 5, "content": "hi"}],  # (a custom role is accepted by vLLM)
    [{"role": "user", "content": 5}], [{"role": "user", "content": {"x": 1}}],
    [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [5]}], [{"role": "user", "content": ["plain string part"]}],
    [{"role": "assistant", "content": "x", "tool_calls": [{"id": 1}]}],
    [{"role": "assistant", "content": "x", "tool_calls": "call"}],
    [{"role": "tool", "content": "x", "tool_call_id": 5}],
    [{"role": "user", "content": "hi", "name": 5}], [None], [{}],
]


def bad_chat(rng, model):
    messages = rng.choice(BAD_MESSAGES)
    return Case("chat_messages", _chat(model, messages=messages), CHAT,
                names=("messages", "role", "content", "tool_calls", "toolcall", "tool_call_id", "name"))


BAD_SAMPLING = [
    ("temperature", [-1, -0.5, -100]), ("top_p", [0, 1.5, -1, 10]), ("top_k", [-2, -5, -100]),
    ("n", [0, -1, -100]), ("min_p", [2, -0.5]), ("repetition_penalty", [0, -1, -0.5]),
    ("presence_penalty", [3, -3, 100]), ("frequency_penalty", [5, -5]), ("min_tokens", [-1, -100]),
    ("logit_bias", [{"999999": 1}, {str(VOCAB): 1}]), ("stream_options", [{"include_usage": True}]),
    ("stop_token_ids", [[10**9], [VOCAB]]), ("allowed_token_ids", [[10**9], [VOCAB]]),
    ("truncate_prompt_tokens", [-5, 10**6]), ("cache_salt", [""]),
]


def bad_sampling(rng, model):
    name, values = rng.choice(BAD_SAMPLING)
    chat = rng.random() < 0.3
    body = (_chat if chat else _cmpl)(model, **{name: rng.choice(values)})
    return Case("sampling", body, CHAT if chat else COMPLETIONS, names=(name, name.replace("_", " ")))


KNOWN_VLLM = [
    # (what, path, body, status): vLLM 0.32's answers to odd-but-accepted or oddly-answered input, asserted so
    # that a change shows up here. None of them involves the plugin.
    ("a prompt of one empty string is BOS alone", COMPLETIONS, {"prompt": [""]}, 200),
    ("no model, or an empty one, means the served one", COMPLETIONS, {"model": None}, 200),
    ("", COMPLETIONS, {"model": ""}, 200),
    ("unknown fields are ignored", COMPLETIONS, {"best_of": "x", "no_such_field": 1}, 200),
    ("logit_bias values are not range-checked", COMPLETIONS, {"logit_bias": {"5": -1000}}, 200),
    ("a custom chat role is accepted", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 200),
    ("JSON true in pic_segments is coerced to 1 by vLLM's schema", COMPLETIONS,
     {"prompt": [20, 21], "vllm_xargs": {"pic_segments": [True, True]}}, 200),
    # 400, but the message does not name the field:
    ("messages that are not a list", CHAT, {"messages": 5}, 400),
    ("a lone surrogate in a plain prompt", COMPLETIONS, {"prompt": "abc\ud800"}, 400),
    # vLLM's own guard on every extra_args integer, before ours:
    ("extra_args past 64 bits", COMPLETIONS, {"vllm_xargs": {"anything": 10**30}}, 400),
]


def bad_method_or_path(rng, model):
    how = rng.randrange(4)
    if how == 0:
        return Case("http", None, rng.choice([COMPLETIONS, CHAT]), method="GET", statuses=(405,),
                    names=("method", "not allowed"))
    if how == 1:
        return Case("http", _cmpl(model), rng.choice([COMPLETIONS, CHAT]), method=rng.choice(["PUT", "DELETE"]),
                    statuses=(405,), names=("method", "not allowed"))
    if how == 2:
        return Case("http", _cmpl(model), rng.choice(["/v1/completion", "/v1/nonexistent", "/v1/completions/x"]),
                    statuses=(404,), names=("not found",))
    return Case("http", json.dumps(_cmpl(model)).encode(), COMPLETIONS, headers={"Content-Type": "text/plain"},
                names=JSON_NAMES)


TABLE = [
    (broken_json, 130), (wrong_types, 160), (bad_max_tokens, 90), (long_prompt, 60), (bad_token_ids, 100),
    (empty_prompt, 30), (bad_pic_segments, 180), (bad_pic_seam, 80), (bad_pic_text, 110), (bad_logprobs, 80),
    (unknown_model, 50), (bad_chat, 90), (bad_sampling, 70), (bad_method_or_path, 30),
]


def build_cases(model: str, seed: int = SEED) -> list[Case]:
    rng = random.Random(seed)
    cases = [gen(rng, model) for gen, count in TABLE for _ in range(count)]
    rng.shuffle(cases)
    return cases


# ---- sending ----------------------------------------------------------------------------------------------------


async def _send(client: httpx.AsyncClient, case: Case):
    headers = {"Authorization": f"Bearer {API_KEY}", **case.headers}
    content = case.content()
    if content is not None and "Content-Type" not in headers:
        headers["Content-Type"] = "application/json"
    try:
        return await client.request(case.method, case.path, content=content, headers=headers)
    except httpx.HTTPError as e:  # a timeout or a dropped connection: recorded, the test fails on it
        return e


def check_response(case: Case, response) -> str | None:
    """None when the response is what a malformed request must get, else why not."""
    if isinstance(response, Exception):
        return f"no response: {type(response).__name__}: {response}"
    if response.status_code not in case.statuses:
        return f"status {response.status_code} (wanted {case.statuses}): {response.text[:300]}"
    message, param = error_of(response)
    if not message.strip():
        return f"empty error message: {response.text[:300]}"
    haystack = f"{message} {param or ''}".lower()
    if case.names and not any(n.lower() in haystack for n in case.names):
        return f"message names none of {case.names}: param={param!r} message={message[:300]!r}"
    return None


async def barrage(root: str, cases: list[Case], on_batch=None):
    """Send `cases` BATCH at a time; `on_batch(client)` runs after every batch. Returns the responses, in order."""
    limits = pool_limits(BATCH)
    out = []
    deadline = time.monotonic() + BARRAGE_TIMEOUT_S
    async with httpx.AsyncClient(base_url=root, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        for start in range(0, len(cases), BATCH):
            assert time.monotonic() < deadline, f"barrage took over {BARRAGE_TIMEOUT_S} s ({start} sent)"
            out += await asyncio.gather(*(_send(client, c) for c in cases[start:start + BATCH]))
            if on_batch is not None:
                await on_batch(client)
    return out


# ---- fixtures and tests -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server("hysparse")


@pytest.fixture(scope="module")
def model(server):
    r = httpx.get(f"{server.base_url}/models", headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


def known_good(server, model) -> dict[str, list[int]]:
    """Greedy token ids of a plain, a PIC token-level and a PIC text-level request."""
    out = {}
    common = {"model": model, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    bodies = {
        "plain": {**common, "prompt": GOOD_PROMPT},
        "pic": {**common, "prompt": GOOD_PROMPT, "vllm_xargs": {"pic_segments": GOOD_LAYOUT, "pic_seam_tokens": 4}},
        "pic_text": {**common, "prompt": "", "vllm_xargs": {"pic_text_segments": GOOD_TEXTS, "pic_seam_tokens": 4}},
        "chat": {**common, "messages": [{"role": "user", "content": "Sort a list."}]},
    }
    for name, body in bodies.items():
        path = "/chat/completions" if "messages" in body else "/completions"
        r = httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, (name, r.text)
        choice = r.json()["choices"][0]
        out[name] = choice["token_ids"]
        assert len(out[name]) == 8, (name, choice)
    return out


def test_case_table_is_large_and_covers_every_kind():
    cases = build_cases("m")
    assert len(cases) >= MIN_REQUESTS
    kinds = Counter(c.kind for c in cases)
    assert set(kinds) == {"broken_json", "wrong_type", "max_tokens", "long_prompt", "token_ids", "empty_prompt",
                          "pic_segments", "pic_seam", "pic_text", "logprobs", "unknown_model", "chat_messages",
                          "sampling", "http"}
    assert build_cases("m")[0].content() == cases[0].content()  # seeded: the same requests every run


def test_hostile_barrage_gets_4xx_naming_the_problem_and_the_server_keeps_serving(server, model):
    log_start = len(server.log.read_text(errors="replace"))  # the server is shared: judge this test's part
    before = known_good(server, model)
    cases = build_cases(model)
    health = []

    async def check_health(client):
        assert (death := server.death()) is None, f"during the barrage, {death}"
        r = await client.get("/health", timeout=30)
        health.append(r.status_code)

    t0 = time.monotonic()
    responses = asyncio.run(barrage(server.root, cases, check_health))
    elapsed = time.monotonic() - t0
    statuses = Counter(getattr(r, "status_code", type(r).__name__) for r in responses)
    by_kind = {}
    for c, r in zip(cases, responses):
        by_kind.setdefault(c.kind, Counter())[getattr(r, "status_code", "none")] += 1
    print(f"\n[hostile] {len(cases)} requests in {elapsed:.1f} s, {len(health)} health checks; "
          f"status codes {dict(sorted(statuses.items(), key=str))}")
    for kind, counts in sorted(by_kind.items()):
        print(f"[hostile]   {kind:14s} {sum(counts.values()):4d}  {dict(sorted(counts.items(), key=str))}")

    failures = [(c.kind, c.path, (c.content() or b"")[:200], why)
                for c, r in zip(cases, responses) if (why := check_response(c, r)) is not None]
    assert not failures, f"{len(failures)} bad answers, first ones:\n" + "\n".join(map(repr, failures[:15]))
    assert all(400 <= s < 500 for s in statuses), statuses
    assert set(health) == {200}, Counter(health)
    assert len(health) == -(-len(cases) // BATCH)
    assert known_good(server, model) == before, "the server's answers changed after the barrage"
    assert "Traceback" not in server.log.read_text(errors="replace")[log_start:], server.log_tail(8000)


@pytest.mark.parametrize("what,path,body,status", KNOWN_VLLM, ids=[f"known-{i}" for i in range(len(KNOWN_VLLM))])
def test_recorded_vllm_behaviour(server, model, what, path, body, status):
    base = _cmpl(model, max_tokens=1) if path == COMPLETIONS else _chat(model, max_tokens=1)
    body = {k: v for k, v in {**base, **body}.items() if v is not None}
    r = httpx.post(f"{server.root}{path}", content=json.dumps(body), headers={**server.headers,
                   "Content-Type": "application/json"}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == status, (what, r.text[:300])
    if status == 400:
        message, param = error_of(r)
        assert message.strip()
        if "messages" in body and body["messages"] == 5:
            assert "not iterable" in message and param is None  # vLLM does not say which field
        if "vllm_xargs" in body:
            assert param == "extra_args"
