# SPDX-License-Identifier: Apache-2.0
"""PIC request API (SPEC §4) in the real engine: offline `LLM` and `vllm serve` through the `openai` client.

Validation naming the field (offline `VLLMValidationError`, HTTP 400), the
prompt-logprobs refusal, the prefix-cache salt of PIC requests (observed as
the cached-token counts of later requests), and the server's text-level way
in (`vllm_xargs.pic_text_segments`) against the client-side `pic_prompt`.
One offline HySparse engine and one HySparse2 server (started first, so both
boot at once) serve the whole module.
"""

import subprocess

import tests.vllm_utils  # noqa: F401  (CPU engine environment, before vLLM starts)

import openai
import pytest
import requests
from transformers import AutoTokenizer

import vllm_hysparse  # noqa: F401
from tests.entrypoints.serve_utils import VLLM, server_env
from tests.vllm_utils import make_llm, random_prompts, shutdown
from vllm_hysparse.pic.client import pic_extra_body, pic_prompt, pic_text_extra_body
from vllm_hysparse.pic.frontend import is_pic_model, pic_cache_salt
from vllm_hysparse.pic.layout import PICLayout
from vllm_hysparse.tools.harness import free_port, wait_until_healthy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

API_KEY = "pic-test-key"
BLOCK = 32
PROMPT_LEN = 4 * BLOCK + 5  # 4 full pages

# (extra_args, the field the error must name); prompts are PROMPT_LEN tokens long
BAD = [
    ({"pic_segments": [10, 20]}, "pic_segments"),  # does not sum to the prompt
    ({"pic_segments": [PROMPT_LEN]}, "pic_segments"),  # fewer than 2
    ({"pic_segments": [0, PROMPT_LEN]}, "pic_segments"),  # a 0-length segment
    ({"pic_segments": [PROMPT_LEN + 1, -1]}, "pic_segments"),  # a negative segment
    ({"pic_segments": [100, PROMPT_LEN - 100], "pic_seam_tokens": -1}, "pic_seam_tokens"),
    ({"pic_segments": [100.0, PROMPT_LEN - 100]}, "pic_segments"),  # not an integer
    ({"pic_segments": ["100", PROMPT_LEN - 100]}, "pic_segments"),
    ({"pic_segments": PROMPT_LEN}, "pic_segments"),  # not a list
    ({"pic_segments": [100, PROMPT_LEN - 100], "pic_seam_tokens": 2.5}, "pic_seam_tokens"),
    ({"pic_segments": [100, PROMPT_LEN - 100], "pic_seam_tokens": "8"}, "pic_seam_tokens"),
    ({"pic_seam_tokens": 8}, "pic_seam_tokens"),  # without pic_segments
    ({"pic_text_segments": ["a", "b"]}, "pic_text_segments"),  # text segments outside /v1/completions
]
LAYOUT = [40, 3, 50, PROMPT_LEN - 93]
TEXTS = ["You are a careful assistant. Answer from the documents only. " * 3,
         "Document 1: the river Rhine flows north through Basel, Strasbourg and Cologne. " * 3,
         "Document 2: the Danube flows east through Vienna, Budapest and Belgrade. " * 3,
         "Question: which river flows through Vienna?"]


@pytest.fixture(scope="module")
def server_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("pic-serve") / "tiny2", "hysparse2", "tiny", seed=31)


@pytest.fixture(scope="module")
def server_proc(server_ckpt, tmp_path_factory):
    """`vllm serve` on HySparse2 with no PIC flag, an API key and per-request cached-token counts."""
    port = free_port()
    log = tmp_path_factory.mktemp("pic-serve-log") / "serve.log"
    env = server_env()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [VLLM, "serve", str(server_ckpt), "--dtype", "float32", "--port", str(port), "--max-model-len", "1024",
             "--enforce-eager", "--block-size", str(BLOCK), "--api-key", API_KEY,
             "--enable-prompt-tokens-details"], stdout=out, stderr=subprocess.STDOUT, env=env)
    yield proc, f"http://127.0.0.1:{port}/v1", log
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def llm(server_proc, tmp_path_factory):
    # Depends on server_proc only so that the server boots while this engine does.
    ckpt = write_checkpoint(tmp_path_factory.mktemp("pic-offline") / "tiny", "hysparse", "tiny", seed=32)
    llm = make_llm(ckpt, enforce_eager=True, block_size=BLOCK, max_num_seqs=4)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def base_url(server_proc):
    proc, url, log = server_proc
    try:
        wait_until_healthy(url, 300)
    except TimeoutError:
        proc.kill()
        pytest.fail("vllm serve did not start:\n" + log.read_text()[-4000:])
    return url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(server_ckpt):
    return AutoTokenizer.from_pretrained(server_ckpt)


def _prompt(seed: int) -> list[int]:
    return random_prompts([PROMPT_LEN], 4096, seed=seed)[0]


# ---- offline engine ---------------------------------------------------------------------------------------------


def _generate(llm, prompt, **params):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=params.pop("max_tokens", 4), temperature=0.0, ignore_eos=True, **params)
    return llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]


@pytest.mark.parametrize("extra_args,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_offline_bad_values_name_their_field(llm, extra_args, field):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=field) as err:
        _generate(llm, _prompt(1), extra_args=extra_args)
    assert err.value.parameter == field


def test_offline_prompt_logprobs_refused_for_pic(llm):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="prompt_logprobs") as err:
        _generate(llm, _prompt(1), extra_args={"pic_segments": LAYOUT}, prompt_logprobs=1)
    assert err.value.parameter == "prompt_logprobs"
    # A plain request still gets them.
    out = _generate(llm, _prompt(1), prompt_logprobs=1)
    assert len(out.prompt_logprobs) == PROMPT_LEN


def test_offline_valid_pic_request_returns_tokens(llm):
    out = _generate(llm, _prompt(2), max_tokens=5, extra_args={"pic_segments": LAYOUT, "pic_seam_tokens": 4})
    assert len(out.outputs[0].token_ids) == 5
    out = _generate(llm, _prompt(2), max_tokens=3, extra_args={"pic_segments": [1, PROMPT_LEN - 1]})
    assert len(out.outputs[0].token_ids) == 3


def test_offline_processed_request_carries_the_layout_salt(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    processor = llm.llm_engine.input_processor
    prompt = _prompt(3)

    def processed(extra_args=None, salt=None):
        tp = TokensPrompt(prompt_token_ids=prompt, **({"cache_salt": salt} if salt else {}))
        return processor.process_inputs("probe", tp, SamplingParams(max_tokens=1, extra_args=extra_args),
                                        supported_tasks=("generate",))

    layout = PICLayout(tuple(LAYOUT), 8)
    assert processed().cache_salt is None
    assert processed(salt="tenant-a").cache_salt == "tenant-a"
    assert processed({"unrelated": 1}).cache_salt is None
    assert processed({"pic_segments": LAYOUT}).cache_salt == layout.salt() == pic_cache_salt(layout, None)
    with_user = processed({"pic_segments": LAYOUT}, salt="tenant-a").cache_salt
    assert with_user == pic_cache_salt(layout, "tenant-a") and "tenant-a" in with_user and layout.salt() in with_user
    other_seam = processed({"pic_segments": LAYOUT, "pic_seam_tokens": 0}).cache_salt
    assert other_seam not in (None, layout.salt())


def test_offline_plain_request_never_hits_pic_blocks(llm):
    prompt = _prompt(4)
    pic = {"pic_segments": LAYOUT}
    assert _generate(llm, prompt, extra_args=pic).num_cached_tokens == 0
    # Same tokens, no layout: the PIC request's blocks (spliced K/V) must not be served.
    assert _generate(llm, prompt).num_cached_tokens == 0
    # Controls: prefix caching works for both kinds, each within its own salt.
    assert _generate(llm, prompt).num_cached_tokens == 4 * BLOCK
    assert _generate(llm, prompt, extra_args=pic).num_cached_tokens == 4 * BLOCK
    assert _generate(llm, prompt, extra_args={"pic_segments": LAYOUT, "pic_seam_tokens": 2}).num_cached_tokens == 0


def test_is_pic_model_only_for_hysparse():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    assert not is_pic_model(SimpleNamespace(hf_config=LlamaConfig()))
    assert is_pic_model(SimpleNamespace(hf_config=SimpleNamespace(model_type="hysparse2")))


# ---- OpenAI server ----------------------------------------------------------------------------------------------


def _complete(client, model, prompt, xargs=None, **body):
    extra = {"return_token_ids": True, "ignore_eos": True, **body}
    if xargs is not None:
        extra["vllm_xargs"] = xargs
    return client.completions.create(model=model, prompt=prompt, max_tokens=body.pop("max_tokens", 3),
                                     temperature=0, extra_body=extra)


def _cached(res) -> int:
    details = res.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


def test_http_bad_values_get_400_naming_their_field(client, model_name):
    for extra_args, field in BAD:
        with pytest.raises(openai.BadRequestError, match=field) as err:
            if field == "pic_text_segments":  # outside /v1/completions: the frontend refuses it
                client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, extra_body={"vllm_xargs": extra_args})
            else:
                _complete(client, model_name, _prompt(1), extra_args)
        assert err.value.status_code == 400
        assert err.value.body["param"] == field, (extra_args, err.value.body)


def test_http_prompt_logprobs_refused_for_pic(client, model_name):
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs") as err:
        _complete(client, model_name, _prompt(1), {"pic_segments": LAYOUT}, prompt_logprobs=1)
    assert err.value.body["param"] == "prompt_logprobs"


def test_http_pic_request_is_served_and_salted(client, model_name):
    prompt = _prompt(5)
    first = _complete(client, model_name, prompt, {"pic_segments": LAYOUT, "pic_seam_tokens": 4}, max_tokens=4)
    assert len(first.choices[0].token_ids) == 4 and _cached(first) == 0
    # A plain request with the same tokens must not be served the PIC request's blocks ...
    assert _cached(_complete(client, model_name, prompt)) == 0
    # ... while the same layout again, and plain again, hit their own.
    assert _cached(_complete(client, model_name, prompt, {"pic_segments": LAYOUT, "pic_seam_tokens": 4})) == 4 * BLOCK
    assert _cached(_complete(client, model_name, prompt)) == 4 * BLOCK


def test_http_text_segments_match_the_client_helper(client, model_name, tokenizer):
    ids, lengths = pic_prompt(tokenizer, TEXTS)
    assert len(lengths) == len(TEXTS) and sum(lengths) == len(ids) and ids[0] == tokenizer.bos_token_id
    assert len(ids) >= 2 * BLOCK
    full = (len(ids) - 1) // BLOCK * BLOCK  # vLLM always computes the last prompt token
    token_level = client.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0,
                                            extra_body=pic_extra_body(lengths, 5, return_token_ids=True))
    assert _cached(token_level) == 0
    text_level = client.completions.create(model=model_name, prompt="", max_tokens=4, temperature=0,
                                           extra_body=pic_text_extra_body(TEXTS, 5, return_token_ids=True))
    # Same prompt tokens, and the same layout: only an identical pic_segments and seam give the same
    # prefix-cache salt, so the text-level request hits the token-level request's blocks.
    assert text_level.choices[0].prompt_token_ids == ids
    assert _cached(text_level) == full
    assert text_level.choices[0].token_ids == token_level.choices[0].token_ids
    # The plain-text way to the same tokens is a plain request: no hits on PIC blocks.
    plain = client.completions.create(model=model_name, prompt=ids, max_tokens=1, temperature=0)
    assert _cached(plain) == 0
    # Another seam is another layout.
    other = client.completions.create(model=model_name, prompt="", max_tokens=1, temperature=0,
                                      extra_body=pic_text_extra_body(TEXTS, 6))
    assert _cached(other) == 0


@pytest.mark.parametrize("body,field", [
    ({"prompt": "", "vllm_xargs": {"pic_text_segments": "just one string"}}, "pic_text_segments"),
    ({"prompt": "", "vllm_xargs": {"pic_text_segments": ["a", 3]}}, "pic_text_segments"),
    ({"prompt": "", "vllm_xargs": {"pic_text_segments": ["only the query"]}}, "pic_text_segments"),
    ({"prompt": "", "vllm_xargs": {"pic_text_segments": ["prefix", "", "query"]}}, "pic_text_segments"),
    ({"prompt": "text too", "vllm_xargs": {"pic_text_segments": ["prefix", "query"]}}, "prompt"),
    ({"prompt": [5, 6], "vllm_xargs": {"pic_text_segments": ["prefix", "query"]}}, "prompt"),
    ({"prompt": "", "vllm_xargs": {"pic_text_segments": ["prefix", "query"], "pic_segments": [1, 1]}},
     "pic_segments"),
    ({"prompt": "", "vllm_xargs": {"pic_text_segments": ["prefix", "query"], "pic_seam_tokens": -2}},
     "pic_seam_tokens"),  # passes the middleware, refused by the frontend
])
def test_http_malformed_text_requests_get_400_naming_the_field(base_url, model_name, body, field):
    r = requests.post(f"{base_url}/completions", json={"model": model_name, "max_tokens": 2, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_http_text_requests_keep_api_key_protection(base_url, model_name):
    body = {"model": model_name, "max_tokens": 2, "prompt": "x", "vllm_xargs": {"pic_text_segments": "bad"}}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(f"{base_url}/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, r.text  # vLLM's authentication answers, not the PIC middleware
    good = {"model": model_name, "max_tokens": 2, "prompt": "", "vllm_xargs": {"pic_text_segments": ["a b", "c"]}}
    assert requests.post(f"{base_url}/completions", json=good, timeout=60).status_code == 401
    r = requests.post(f"{base_url}/completions", json=good, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)
    assert r.status_code == 200, r.text


def test_http_plain_requests_are_untouched(client, model_name):
    res = client.completions.create(model=model_name, prompt="def f(x):", max_tokens=3, temperature=0,
                                    extra_body={"vllm_xargs": {"unrelated": 1}})
    assert res.usage.completion_tokens == 3


def _scrape(base_url: str) -> dict[str, float]:
    text = requests.get(base_url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                        timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:hysparse_pic_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _settled_scrape(base_url: str, timeout_s: float = 20) -> dict[str, float]:
    """The PIC counters once the earlier tests' requests are in them: no pins held, and two scrapes 0.5 s apart
    equal (the worker publishes every 0.2 s, so a scrape right after another test's request can miss its counts,
    which the next scrape then adds to this test's; CI once read 173 reused tokens for 92)."""
    import time

    deadline = time.time() + timeout_s
    last = _scrape(base_url)
    while time.time() < deadline:
        time.sleep(0.5)
        now = _scrape(base_url)
        if now == last and now.get("vllm:hysparse_pic_in_use", 0) == 0:
            return now
        last = now
    return last


def test_http_pic_metrics_count_reuse(client, model_name, base_url):
    import time

    prompt = _prompt(9)
    seam = 4
    layout = {"pic_segments": LAYOUT, "pic_seam_tokens": seam}
    before = _settled_scrape(base_url)
    _complete(client, model_name, prompt, layout, max_tokens=1)
    # A different query length after the same documents: no prefix-cache hit, every document a store hit.
    _complete(client, model_name, prompt[:-1], {"pic_segments": [*LAYOUT[:-1], LAYOUT[-1] - 1],
                                                 "pic_seam_tokens": seam}, max_tokens=1)
    spliced = 2 * sum(max(0, n - seam) for n in LAYOUT[1:-1])
    reused = sum(n > seam for n in LAYOUT[1:-1])  # a segment within its seam is recomputed, never stored
    # The worker publishes every 0.2 s, and releases a finished request's pins at its engine's next step: on a
    # loaded machine both can lag the reply (CI once read 1 segment still in use), so wait for both.
    deadline = time.time() + 20
    while time.time() < deadline:
        after = _scrape(base_url)
        if after.get("vllm:hysparse_pic_tokens_reused_total", 0) - before.get(
                "vllm:hysparse_pic_tokens_reused_total", 0) >= spliced and after["vllm:hysparse_pic_in_use"] == 0:
            break
        time.sleep(0.2)
    gained = {k: after[k] - before.get(k, 0) for k in after}
    assert gained["vllm:hysparse_pic_tokens_reused_total"] == spliced
    assert gained["vllm:hysparse_pic_segments_hit_total"] == reused
    assert gained["vllm:hysparse_pic_segments_cold_total"] == reused
    assert after['vllm:hysparse_pic_store_bytes{pool="public"}'] > 0
    assert after["vllm:hysparse_pic_in_use"] == 0
