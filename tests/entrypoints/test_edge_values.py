# SPDX-License-Identifier: Apache-2.0
"""Well-formed requests with edge values must never stop the engine (issue: `prompt_logprobs: 0`).

Every field of the OpenAI completion and chat requests and of `SamplingParams`
is sent at its edge values (0, 1, -1, None, empty, the largest accepted value,
values past the context or the vocabulary), as a plain and as a PIC request,
through `vllm serve` and through the offline `LLM`, on HySparse and on HySparse2
(early exit on, vLLM's default for it). Each request must either succeed or be
refused with a 4xx (offline: a validation error). After every batch the server
or engine must still give a known-good request the tokens it gave before.

Through the server, CI sends each value once per architecture, by one route drawn
from a fresh seed that the test prints (`HYSPARSE_EDGE_SEED` replays it): a
plain, streamed or PIC completion, or (for the fields chat shares) a chat
request; the combinations go by every completion route. The benchmark tier
(`-m bench`) sends every value by every route, about 900 requests per
architecture.

The hostile-input suite sends malformed requests; these are valid ones, so they
reach the scheduler and the worker, where an unguarded value kills the engine.
"""

import asyncio
import json
import os
import random
from collections import Counter

import httpx
import pytest

from tests.entrypoints.serve_utils import MAX_LEN, VOCAB, error_of, pool_limits
from tests.vllm_utils import make_llm, random_prompts, shutdown

SEED = 20261202  # the prompt and the chat message (fixed: the known-good answers are compared within a run only)
# The route of each value in the CI sweep: fresh per run, printed, replayed with HYSPARSE_EDGE_SEED.
ROUTE_SEED = int(os.environ.get("HYSPARSE_EDGE_SEED") or random.SystemRandom().randrange(2**32))
ARCHS = ("hysparse", "hysparse2")
BATCH = 16
REQUEST_TIMEOUT_S = 120
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# The prompt nearly fills the context, so that "generate as much as fits" stays cheap.
ROOM = 16  # the most tokens a request may still generate
PROMPT = random_prompts([MAX_LEN - ROOM], VOCAB, seed=SEED)[0]
PIC_XARGS = {"pic_segments": [96, 200, 200], "pic_seam_tokens": 4}  # prefix, one document, query

B64 = 2**64  # past what vLLM can serialise for its engine core (a hang offline, before the plugin's guard)

# field -> edge values. Each value is sent alone on top of a small valid request. The largest
# accepted `n` (VLLM_MAX_N_SEQUENCES, 16384) is left out: it is accepted, and takes minutes here.
COMMON_FIELDS = {
    "n": [0, 1, -1, None, 2, 16, 16385, B64],
    "max_tokens": [0, 1, -1, None, ROOM, ROOM + 1, MAX_LEN, 2**31 - 1, B64],
    "min_tokens": [0, 1, -1, None, 4, 5, ROOM, MAX_LEN + 1, B64],
    "temperature": [0, 1, -1, None, 1e-9, 1e6],
    "top_p": [0, 1, -1, None, 1e-9],
    "top_k": [0, 1, -1, None, VOCAB, VOCAB + 1, 2**31 - 1, B64],
    "min_p": [0, 1, -1, None, 1e-9],
    "presence_penalty": [0, 2, -2, None],
    "frequency_penalty": [0, 2, -2, None],
    "repetition_penalty": [0, 1, -1, None, 1e-9, 1e6],
    "seed": [0, 1, -1, None, 2**63 - 1, -(2**63), 2**64],
    "stop": [None, "", [], [""], ["a"], ["x" * 4096], [str(i) for i in range(64)]],
    "stop_token_ids": [None, [], [0], [-1], [PROMPT[-1]], [VOCAB - 1], [VOCAB], [B64]],
    "ignore_eos": [True, False, None],
    "logit_bias": [None, {}, {"0": 100}, {"-1": 1}, {str(VOCAB - 1): -100}, {str(VOCAB): 1}, {"5": 1e30}, {str(B64): 1}],
    "allowed_token_ids": [None, [], [0], [-1], [VOCAB - 1], [VOCAB], list(range(VOCAB)), [B64]],
    "bad_words": [None, [], [""], ["a"], ["x" * 4096]],
    "logprob_token_ids": [None, [], [0], [-1], [VOCAB - 1], [VOCAB], [B64]],
    "truncate_prompt_tokens": [0, 1, -1, None, len(PROMPT), MAX_LEN, MAX_LEN + 1, B64],
    "prompt_logprobs": [0, 1, -1, None, 20, 21, B64],
    "include_stop_str_in_output": [True, None],
    "skip_special_tokens": [False, None],
    "spaces_between_special_tokens": [False, None],
    "priority": [0, 1, -1, None, B64],
    "stream_interval": [0, 1, -1, None, 1000, B64],
    "structured_outputs": [None, {}, {"choice": ["yes", "no"]}, {"choice": []}, {"regex": "[a-z]{3}"},
                           {"json": {"type": "object"}}, {"grammar": "root ::= \"a\""}],
    "response_format": [None, {"type": "text"}, {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}],
    "thinking_token_budget": [0, 1, -1, None, B64],
    "repetition_detection": [None, {}, {"max_pattern_size": 2, "min_count": 2}, {"max_pattern_size": -1}],
    "routed_experts_prompt_start": [0, 1, -1, None, B64],
    "watermarking": [True, None],
    "cache_salt": [None, "", "tenant-a"],
    "kv_transfer_params": [None, {}],
    "use_beam_search": [True, None],
    "length_penalty": [0, 1, -1, None],
    "vllm_xargs": [None, {}, {"unknown_key": 1}, {"pic_segments": None}, {"pic_segments": [len(PROMPT)]},
                   {"pic_segments": [1] * len(PROMPT)}, {"pic_segments": [1, len(PROMPT) - 1]},
                   {"pic_segments": [0, len(PROMPT)]}, {"pic_segments": [MAX_LEN, MAX_LEN]},
                   {**PIC_XARGS, "pic_seam_tokens": 0}, {**PIC_XARGS, "pic_seam_tokens": -1},
                   {**PIC_XARGS, "pic_seam_tokens": None}, {**PIC_XARGS, "pic_seam_tokens": MAX_LEN + 1},
                   {**PIC_XARGS, "pic_seam_tokens": 2**31 - 1}],
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "logprobs": [0, 1, -1, None, 20, 21, B64],
    "echo": [True, None],
    "suffix": [None, "", "x"],
    "add_special_tokens": [False, None],
    "return_tokens_as_token_ids": [True, None],
    "return_token_ids": [True, None],
    "prompt_embeds": [None, ""],
}
CHAT_FIELDS = {
    **{k: v for k, v in COMMON_FIELDS.items() if k not in ("vllm_xargs", "truncate_prompt_tokens")},
    "max_completion_tokens": [0, 1, -1, None, ROOM, MAX_LEN + 1, B64],
    "logprobs": [True, False, None],
    "top_logprobs": [0, 1, -1, None, 20, 21, B64],
    "echo": [True, None],
    "add_generation_prompt": [False, None],
    "continue_final_message": [True, None],
    "tools": [None, []],
    "tool_choice": [None, "none", "auto", "required"],
    "parallel_tool_calls": [False, None],
    "documents": [None, []],
    "chat_template_kwargs": [None, {}],
    "return_prompt_text": [True, None],
    "include_reasoning": [False, None],
    "reasoning_effort": [None, "low"],
}
# Combinations that single values miss: echo of the prompt with its logprobs (what lm-eval's
# log-likelihood sends), `n` with sampling, min_tokens above max_tokens.
COMBOS = [
    {"echo": True, "logprobs": 0, "max_tokens": 0}, {"echo": True, "logprobs": 1, "max_tokens": 1},
    {"echo": True, "logprobs": 0, "max_tokens": 0, "prompt_logprobs": 0},
    {"n": 4, "temperature": 1.0, "seed": 7}, {"min_tokens": 8, "max_tokens": 4},
    {"logprobs": 20, "prompt_logprobs": 20, "n": 2}, {"top_k": 1, "top_p": 1e-9, "min_p": 1},
]


def chat_messages(server, model: str) -> list[dict]:
    """One user message whose chat prompt leaves about `ROOM` tokens of the context (sized with /tokenize)."""
    words = random.Random(SEED).choices(["alpha", "beta", "gamma", "delta", "list", "sort", "river"], k=2000)

    def length(k):
        r = httpx.post(f"{server.root}/tokenize", headers=server.headers, timeout=60,
                       json={"model": model, "messages": [{"role": "user", "content": " ".join(words[:k])}]})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    lo, hi = 1, len(words)  # the longest message that leaves ROOM tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(mid) <= MAX_LEN - ROOM else (lo, mid - 1)
    assert MAX_LEN - 2 * ROOM < length(lo) <= MAX_LEN - ROOM
    return [{"role": "user", "content": " ".join(words[:lo])}]


def build_cases(model: str, messages: list[dict], rng: random.Random | None = None) -> list[tuple[str, dict]]:
    """(path, body) of the edge cases. `rng` None: every value by every route (completions plain, streamed and
    PIC; chat plain; streamed chat takes the streamed completions' path). Otherwise each value goes by one route
    drawn from `rng` (a field both endpoints take: any of the four), and each combination by every completion
    route."""
    bases = {COMPLETIONS: {"model": model, "prompt": list(PROMPT), "max_tokens": 4},
             CHAT: {"model": model, "messages": messages, "max_tokens": 4}}

    def completion(extra: dict, route: str) -> tuple[str, dict]:
        body = {**bases[COMPLETIONS], **extra}
        if route == "stream":
            body["stream"] = True
        elif route == "pic":
            body["vllm_xargs"] = {**PIC_XARGS, **(extra.get("vllm_xargs") or {})}
        return COMPLETIONS, body

    routes = ("plain", "stream", "pic")
    cases = []
    for name, values in COMPLETION_FIELDS.items():
        for value in values:
            if rng is None:
                cases += [completion({name: value}, r) for r in routes]
            else:
                route = rng.choice(routes + (("chat",) if name in CHAT_FIELDS else ()))
                cases.append((CHAT, {**bases[CHAT], name: value}) if route == "chat"
                             else completion({name: value}, route))
    cases += [completion(extra, r) for extra in COMBOS for r in routes]
    for name, values in CHAT_FIELDS.items():
        if rng is None or name not in COMPLETION_FIELDS:
            cases += [(CHAT, {**bases[CHAT], name: value}) for value in values]
    return cases


def _outcome(response) -> tuple[int | str, str]:
    """(status or failure kind, detail). A stream that errors after its 200 reports the error's code."""
    if isinstance(response, Exception):
        return type(response).__name__, str(response)[:300]
    if response.status_code != 200:
        message, _ = error_of(response)
        return response.status_code, message[:300]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    err = event["error"]
                    return int(err.get("code") or 500), str(err.get("message"))[:300]
        if "data: [DONE]" not in response.text:
            return "truncated stream", response.text[-300:]
        return 200, ""
    body = response.json()
    if not body.get("choices"):
        return "no choices", response.text[:300]
    return 200, ""


def _expected_refusal(body: dict) -> str | None:
    """Why this request must get a 400 on this server (the guards under test), or None."""
    pic = bool((body.get("vllm_xargs") or {}).get("pic_segments"))
    if pic and body.get("prompt_logprobs") is not None and not body.get("stream"):
        return "prompt logprobs of a PIC request"
    return None


async def _send_all(server, cases, known_good):
    headers = server.headers
    limits = pool_limits(BATCH)
    results, after = [], []
    async with httpx.AsyncClient(base_url=server.root, headers=headers, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        async def one(path, body):
            try:
                return await client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            except httpx.HTTPError as e:
                return e

        for start in range(0, len(cases), BATCH):
            batch = cases[start:start + BATCH]
            results += await asyncio.gather(*(one(p, b) for p, b in batch))
            after.append((start, await known_good(client)))
    return results, after


def _known_good_http(model):
    bodies = {
        "plain": {"model": model, "prompt": list(PROMPT), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True},
        "pic": {"model": model, "prompt": list(PROMPT), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "vllm_xargs": PIC_XARGS},
    }

    async def known_good(client):
        out = {}
        for name, body in bodies.items():
            try:
                r = await client.post(COMPLETIONS, json=body)
            except httpx.HTTPError as e:
                out[name] = f"{type(e).__name__}: {e}"
                continue
            out[name] = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else f"{r.status_code}"
        return out

    return known_good


@pytest.mark.parametrize("arch", ARCHS)
def test_reproduction_prompt_logprobs_zero(tiny_server, arch):
    """The issue's request, served on both (HySparse2 with early exit on: per request); the server keeps serving."""
    server = tiny_server(arch)
    model = httpx.get(f"{server.base_url}/models", headers=server.headers, timeout=30).json()["data"][0]["id"]
    good = {"model": model, "prompt": "hello there friend", "max_tokens": 2, "temperature": 0}
    before = httpx.post(f"{server.base_url}/completions", json=good, headers=server.headers, timeout=60)
    assert before.status_code == 200, before.text
    for extra in ({"prompt_logprobs": 0}, {"echo": True, "logprobs": 0, "max_tokens": 0}):
        r = httpx.post(f"{server.base_url}/completions", json={**good, **extra}, headers=server.headers,
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_logprobs"][1], r.text  # the prompt tokens' own logprobs
    assert httpx.get(f"{server.root}/health", timeout=30).status_code == 200
    assert server.proc.poll() is None
    after = httpx.post(f"{server.base_url}/completions", json=good, headers=server.headers, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def _sweep(server, arch, model, cases, what: str):
    print(f"\n[edge] {what}: {len(cases)} requests to {arch}")
    known_good = _known_good_http(model)

    async def run():
        async with httpx.AsyncClient(base_url=server.root, headers=server.headers, timeout=60) as client:
            before = await known_good(client)
        return before, await _send_all(server, cases, known_good)

    before, (responses, after) = asyncio.run(run())
    assert all(isinstance(v, list) and len(v) == 6 for v in before.values()), before

    outcomes = [_outcome(r) for r in responses]
    counts = Counter(status for status, _ in outcomes)
    print(f"[edge] {arch}: outcomes {dict(sorted(counts.items(), key=str))}")
    bad = [(path, body, status, detail) for (path, body), (status, detail) in zip(cases, outcomes)
           if not (status == 200 or isinstance(status, int) and 400 <= status < 500)]
    changed = [(start, got) for start, got in after if got != before]
    assert not changed, (f"{what}: the known-good requests changed after the batch starting at case {changed[0][0]}: "
                         f"{changed[0][1]} (before {before}); that batch: "
                         + "\n".join(map(repr, cases[changed[0][0]:changed[0][0] + BATCH])))
    assert not bad, f"{what}: {len(bad)} requests neither succeeded nor got a 4xx:\n" + "\n".join(map(repr, bad[:12]))
    wrong = [(body, status, why) for (path, body), (status, _) in zip(cases, outcomes)
             if (why := _expected_refusal(body)) and status != 400]
    assert not wrong, f"{what}: {len(wrong)} requests should have got a 400:\n" + "\n".join(map(repr, wrong[:12]))
    # Most edge values are valid: a sweep that refuses everything proves nothing.
    assert counts[200] >= 0.5 * len(cases), counts
    # (vLLM logs a traceback for a validation error raised inside a stream, so the log is searched for
    # errors of the engine and its workers only.)
    engine_errors = [line for line in server.log.read_text(errors="replace").splitlines()
                     if ("(EngineCore" in line or "(Worker" in line) and " ERROR " in line]
    assert (death := server.death()) is None, death
    assert not engine_errors, "\n".join(engine_errors[:40])


def _server_cases(server, rng):
    model = httpx.get(f"{server.base_url}/models", headers=server.headers, timeout=30).json()["data"][0]["id"]
    cases = build_cases(model, chat_messages(server, model), rng)
    random.Random(SEED).shuffle(cases)  # mixes fields within a batch
    return model, cases


@pytest.mark.parametrize("arch", ARCHS)
def test_edge_values_through_the_server(tiny_server, arch):
    """Each value once, by a route drawn from ROUTE_SEED (printed)."""
    server = tiny_server(arch)
    model, cases = _server_cases(server, random.Random(f"{ROUTE_SEED}-{arch}"))
    # Every route is taken, and every field: the draw only spreads the values over the routes.
    assert {p for p, _ in cases} == {COMPLETIONS, CHAT}
    assert sum(b.get("stream", False) for _, b in cases) and sum("vllm_xargs" in b for _, b in cases)
    _sweep(server, arch, model, cases, f"seed {ROUTE_SEED} (HYSPARSE_EDGE_SEED={ROUTE_SEED} replays it)")


@pytest.mark.bench
@pytest.mark.parametrize("arch", ARCHS)
def test_edge_values_by_every_route_through_the_server(tiny_server, arch):
    """Benchmark tier: every value by every route (about 900 requests per architecture)."""
    server = tiny_server(arch)
    _sweep(server, arch, *_server_cases(server, None), "every value by every route")


# ---- the offline engine -----------------------------------------------------------------------------------------

SAMPLING_FIELDS = {
    **{k: v for k, v in COMMON_FIELDS.items()
       if k not in ("response_format", "cache_salt", "kv_transfer_params", "use_beam_search", "length_penalty",
                    "priority", "structured_outputs", "repetition_detection", "vllm_xargs")},
    "logprobs": [0, 1, -1, None, 20, 21, B64],
    "prompt_logprob_token_ids": [None, [[0]] * (len(PROMPT) - 1), [[VOCAB]] * (len(PROMPT) - 1), [[0]]],
    "prompt_logprob_start": [0, 1, -1, None, len(PROMPT), MAX_LEN, B64],
    "flat_logprobs": [True, False],
    "detokenize": [False, True],
    "output_kind": ["CUMULATIVE", "DELTA", "FINAL_ONLY"],
    "skip_reading_prefix_cache": [True, False, None],
    "trace_decode_token_ids": [None, [], [0], [VOCAB], [B64]],
    "extra_args": COMMON_FIELDS["vllm_xargs"],
    "structured_outputs": [None, dict(choice=["yes", "no"]), dict(regex="[a-z]{3}"), dict(json={"type": "object"}),
                           dict(grammar="root ::= \"a\""), dict(json_object=True)],
    "repetition_detection": [None, dict(max_pattern_size=2, min_count=2)],
}


def _sampling_params(name, value):
    from vllm.sampling_params import RepetitionDetectionParams, RequestOutputKind, SamplingParams, \
        StructuredOutputsParams

    if name == "output_kind":
        value = RequestOutputKind[value]
    elif name == "structured_outputs" and value is not None:
        value = StructuredOutputsParams(**value)
    elif name == "repetition_detection" and value is not None:
        value = RepetitionDetectionParams(**value)
    kwargs = {"max_tokens": 4, "temperature": 0.0, name: value}
    return SamplingParams(**kwargs)


@pytest.fixture(scope="module", params=ARCHS)
def offline(request, tmp_path_factory):
    from vllm_hysparse.tools.make_checkpoint import write_checkpoint

    ckpt = write_checkpoint(tmp_path_factory.mktemp(f"offline-{request.param}") / "tiny", request.param, "tiny",
                            seed=41)
    # A token budget of half the prompt: every request's prefill spans two steps, so every value also meets the
    # step whose sampled token vLLM discards (where a seeded request once killed the engine).
    llm = make_llm(ckpt, enforce_eager=True, max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN // 2)
    yield request.param, llm
    shutdown(llm)


def test_seeded_sampling_is_the_same_however_the_prompt_is_chunked(offline):
    """A seeded request whose prefill spans two steps samples what it samples in one (its prefix cached).

    vLLM rewinds a seeded generator after a discarded draw by a CUDA Philox offset, which torch's CPU generator
    lacks: the engine core died on the first such request (`vllm_glue.runner.CPUSeededSamplingMixin`).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    arch, llm = offline
    seed = random.SystemRandom().randrange(2**31)
    print(f"\n[edge] seed {seed}")
    prompt = TokensPrompt(prompt_token_ids=random_prompts([MAX_LEN - ROOM], VOCAB, seed=seed)[0])

    def sample(s):
        params = SamplingParams(seed=s, temperature=1.0, max_tokens=ROOM, ignore_eos=True)
        return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    chunked = sample(seed)  # cold: two steps, the first one's draw discarded
    cached = sample(seed)  # the prompt's blocks cached: one step
    other = sample(seed + 1)
    assert len(chunked) == ROOM and chunked == cached, (chunked, cached)
    assert other != cached, "another seed gave the same tokens: this test cannot see a shifted random stream"


@pytest.mark.timeout(600)  # a lost request hangs `LLM.generate`: fail rather than wait for the suite's limit
def test_edge_values_through_the_offline_engine(offline):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError  # (not a ValueError in vLLM 0.32)
    from vllm.inputs import TokensPrompt

    arch, llm = offline
    prompt = TokensPrompt(prompt_token_ids=list(PROMPT))

    def known_good():
        out = {}
        for name, extra in (("plain", None), ("pic", dict(PIC_XARGS))):
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, extra_args=extra)
            out[name] = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        return out

    before = known_good()
    cases = [(name, value, pic) for name, values in SAMPLING_FIELDS.items() for value in values
             for pic in (False, True)]
    print(f"\n[edge] seed {SEED}: {len(cases)} offline requests to {arch}")
    outcomes = Counter()
    wrong = []
    for i, (name, value, pic) in enumerate(cases):
        try:
            params = _sampling_params(name, value)
        except (VLLMValidationError, ValueError, TypeError) as e:
            outcomes["refused by SamplingParams"] += 1
            assert str(e).strip(), (name, value)
            continue
        if pic:
            params.extra_args = {**PIC_XARGS, **(params.extra_args or {})}
        try:
            out = llm.generate([prompt], params, use_tqdm=False)
            assert out and out[0].outputs, (name, value, pic)
            outcomes["served"] += 1
            refused = False
        except (VLLMValidationError, ValueError, TypeError) as e:
            assert str(e).strip() and "EngineCore" not in str(e), (name, value, pic, e)
            outcomes["refused by the engine"] += 1
            refused = True

        expect = _expected_refusal({"prompt_logprobs": params.prompt_logprobs, "vllm_xargs": params.extra_args})
        if expect and not refused:
            wrong.append((name, value, pic, expect))
        if i % BATCH == BATCH - 1 or i == len(cases) - 1:
            assert known_good() == before, f"the engine's answers changed after case {i}: {(name, value, pic)}"
    print(f"[edge] {arch}: offline outcomes {dict(outcomes)}")
    assert not wrong, wrong
    assert outcomes["served"] >= 0.5 * len(cases), outcomes
