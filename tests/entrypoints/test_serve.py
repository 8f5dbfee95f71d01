# SPDX-License-Identifier: Apache-2.0
"""`vllm serve` on a HySparse checkpoint, driven through the OpenAI client, as a user would."""

import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.entrypoints.serve_utils import USER_TOPOLOGY, VLLM, free_port, serve, server_env
from tests.vllm_utils import offline_load_errors, random_prompts, reference_greedy
from vllm_hysparse.tools.demo_client import hysparse_metrics
from vllm_hysparse.tools.make_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", "hysparse", "tiny", seed=21)


def _serve(ckpt, log: Path, *args: str, env: dict | None = None):
    """`vllm serve` as a user would start it (plus `args`); yields (base_url, log path) while it runs."""
    # 600 s: a compiled server's start has taken over 300 s on the shared 2-core machine
    # No whitespace between JSON tokens in structured outputs: a model with random weights would otherwise pad a
    # JSON answer with it until max_tokens (test_structured_outputs_are_valid).
    compact_json = '{"backend": "xgrammar", "disable_any_whitespace": true}'
    with serve(ckpt, log, "--max-model-len", "1024", "--structured-outputs-config", compact_json, *args, env=env,
               start_timeout_s=600) as server:
        yield server.base_url, log


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    # vLLM's own process layout and its compiled model: the server users start
    yield from _serve(ckpt, tmp_path_factory.mktemp("serve-log") / "serve.log", env=USER_TOPOLOGY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused")


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def test_completion_matches_reference(client, model_name, reference):
    prompts = random_prompts([9, 70], reference.config.vocab_size, seed=4)
    expected = reference_greedy(reference, prompts, 6)
    for prompt, want in zip(prompts, expected):
        got = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        assert got.choices[0].token_ids == want.token_ids


def test_chat_streaming_equals_non_streaming(client, model_name):
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=12, temperature=0)
    chunks = client.chat.completions.create(model=model_name, messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    streamed = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([s for s in streamed if s]) > 1
    assert "".join(streamed) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 12


def test_streaming_completion_equals_reference(client, model_name, reference):
    prompt = random_prompts([23], reference.config.vocab_size, seed=24)[0]
    want = reference_greedy(reference, [prompt], 8)[0].token_ids
    body = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0, extra_body=body)
    chunks = [c.choices[0] for c in client.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                                               temperature=0, stream=True, extra_body=body)
              if c.choices]
    streamed = [t for c in chunks for t in (c.token_ids or [])]
    # the same tokens as the reference and the non-streamed reply, spread over several chunks, and the same text
    assert streamed == whole.choices[0].token_ids == want
    assert sum(1 for c in chunks if c.token_ids) > 1
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    assert chunks[-1].finish_reason == whole.choices[0].finish_reason == "length"


def test_bad_requests_get_clear_errors_and_server_keeps_serving(client, model_name):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model_name, prompt=[100] * 1100, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model_name, prompt="x", max_tokens=-3)
    ok = client.completions.create(model=model_name, prompt="def f():", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_metrics_report_pages_per_query(server, client, model_name, ckpt):
    base_url, _ = server

    def totals():
        lines = hysparse_metrics(base_url)
        return {m.group(1): float(m.group(2)) for m in (re.match(r"(\S+) (\S+)", line) for line in lines)}

    def settled():
        """Totals once two reads 1 s apart agree: the worker publishes every 0.2 s, later on a loaded machine,
        so the previous test's last request can still be on its way (CI measured +6 and +10 token runs)."""
        deadline, last = time.monotonic() + 20, totals()
        while True:
            time.sleep(1.0)
            now = totals()
            if now == last:
                return now
            assert time.monotonic() < deadline, "the pages-per-query counters did not settle"
            last = now

    cfg = json.loads((ckpt / "config.json").read_text())
    # one (query, KV group) selection per token run (600 prompt tokens, 3 decode steps) at each oracle full layer
    want = (600 + 3) * cfg["num_key_value_heads"] * cfg["layer_types"].count("full_attention")
    before = settled()
    prompt = random_prompts([600], 8192, seed=6)[0]
    client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while totals()["vllm:hysparse_sparse_queries_total"] < before["vllm:hysparse_sparse_queries_total"] + want:
        assert time.monotonic() < deadline, "pages-per-query counters did not reach this request's queries"
        time.sleep(0.3)
    after = settled()  # nothing more may arrive
    queries = after["vllm:hysparse_sparse_queries_total"] - before["vllm:hysparse_sparse_queries_total"]
    pages = after["vllm:hysparse_pages_touched_total"] - before["vllm:hysparse_pages_touched_total"]
    dense = after["vllm:hysparse_dense_pages_total"] - before["vllm:hysparse_dense_pages_total"]
    assert queries == want
    # 2 selected blocks of 16 tokens touch at most 2 pages each (a block never spans more
    # than 2 pages); the long prompt makes dense attention touch many more pages on average.
    assert 1 <= pages / queries <= 2 * cfg["sparse_topk_blocks"]
    assert pages < dense
    # the gauge is the mean since start of the two counters
    assert after["vllm:hysparse_pages_per_query"] == pytest.approx(
        after["vllm:hysparse_pages_touched_total"] / after["vllm:hysparse_sparse_queries_total"], rel=1e-9)


def test_server_reports_kv_bytes_per_token(server, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    n_full = cfg["layer_types"].count("full_attention")
    per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V, float32
    text = server[1].read_text()
    m = re.search(r"HySparse KV cache: (\d+) bytes/token in (\d+) full-length caches.*holds about ([\d,]+) tokens",
                  text)
    assert m, "the server log should carry the HySparse KV report"
    assert (int(m.group(1)), int(m.group(2))) == (per_layer * n_full, n_full)
    assert int(m.group(3).replace(",", "")) == (1 << 30) // (per_layer * n_full)


def _scrape(root: str) -> dict[str, float]:
    """Every /metrics sample by name, labels dropped and summed (and by `name{labels}`)."""
    out: dict[str, float] = {}
    for line in requests.get(f"{root}/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if line.startswith("#") or not key:
            continue
        out[key] = float(value)
        if "{" in key:
            base = key.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
    return out


def _stream(base_url: str, model: str, prompt: list[int], max_tokens: int, xargs: dict,
            close_after: int | None) -> tuple[list[int], str | None]:
    """One streamed completion over its own connection: (token ids, finish reason); with `close_after`, the
    connection is closed after that many chunks with tokens (a client walking away mid-stream)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True, **xargs}
    tokens, chunks, finish = [], 0, None
    with requests.post(f"{base_url}/completions", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("token_ids"):
                tokens += choice["token_ids"]
                chunks += 1
            finish = choice.get("finish_reason") or finish
            if close_after is not None and chunks >= close_after:
                break  # leaving the `with` closes the connection
    return tokens, finish


def test_midstream_disconnects_drain_kv_and_pic(server, client, model_name):
    """8 concurrent streams, half of them PIC, half closed after 2 tokens: the server aborts those (they ask
    for 200 tokens; far fewer are generated), every stream carries the tokens of the same prompt served alone
    (a prefix of them when closed), and KV usage, PIC segments in use and running/waiting requests return to 0
    (the benchmark tier's load test at CI size)."""
    base_url, log = server
    root = base_url.removesuffix("/v1")
    prompts = random_prompts([40, 90, 150, 230, 60, 120, 200, 300], 8192, seed=25)
    xargs = [{"vllm_xargs": {"pic_segments": [16, 24, len(p) - 40], "pic_seam_tokens": 4}} if i % 2 else {}
             for i, p in enumerate(prompts)]
    # the closed streams ask for many tokens, so they are still running when they go
    close_after = [2 if i in (0, 1, 4, 5) else None for i in range(len(prompts))]
    max_tokens = [200 if c else 10 for c in close_after]
    before = _scrape(root)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(_stream, [base_url] * len(prompts), [model_name] * len(prompts), prompts, max_tokens,
                            xargs, close_after))
    drained, deadline, last, probes = False, time.monotonic() + 90, {}, 0
    keys = ("vllm:kv_cache_usage_perc", "vllm:hysparse_pic_in_use", "vllm:num_requests_running",
            "vllm:num_requests_waiting")
    while not drained:
        assert time.monotonic() < deadline, f"the server did not drain: {last}\n{log.read_text()[-3000:]}"
        time.sleep(1)
        # vLLM refreshes its scheduler gauges only on an engine step: a 1-token request makes one
        client.completions.create(model=model_name, prompt=[17, 18, 19], max_tokens=1)
        probes += 1
        time.sleep(0.5)
        after = _scrape(root)
        last = {k: after.get(k) for k in keys}
        drained = all(v == 0 for v in last.values())
    # the closed streams were aborted: far fewer tokens generated than their 4 x 200 (the streams run to the
    # end made 4 x 10, the probes 1 each)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] - probes
    assert 4 * 10 + 4 * 2 <= generated < 4 * 10 + 4 * 100, f"{generated} tokens generated: no abort?"
    assert after["vllm:hysparse_pic_segments_cold_total"] > before.get("vllm:hysparse_pic_segments_cold_total", 0)
    for i, (prompt, (tokens, finish)) in enumerate(zip(prompts, got)):
        n = len(tokens) if close_after[i] else max_tokens[i]
        alone = client.completions.create(model=model_name, prompt=prompt, max_tokens=n, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True,
                                                      "cache_salt": "alone", **xargs[i]})
        if close_after[i]:
            assert 2 <= len(tokens) < max_tokens[i] and finish is None, (i, len(tokens), finish)
        else:
            assert finish == "length", (i, finish)
        assert tokens == alone.choices[0].token_ids, f"stream {i} differs from its prompt served alone"


def _corrupt(src: Path, dst: Path, how: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    if how == "missing":
        del weights["model.layers.1.self_attn.swa_v_proj.weight"]
    elif how == "extra":
        weights["model.layers.1.self_attn.k_proj.weight"] = torch.randn(128, 128)
    elif how == "shape":
        weights["model.layers.0.self_attn.o_proj.weight"] = torch.randn(128, 64)
    elif how == "config":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["layer_types"][0] = "sparse_attention"
        (dst / "config.json").write_text(json.dumps(cfg))
    save_file(weights, dst / "model.safetensors")
    return dst


WEIGHT_ERRORS = {
    "missing": "missing tensor(s) model.layers.1.self_attn.swa_v_proj.weight",
    "extra": "unexpected tensor model.layers.1.self_attn.k_proj.weight",
    "shape": "model.layers.0.self_attn.o_proj.weight has shape (128, 64), expected (128, 256)",
}


def test_bad_weights_fail_at_load_with_one_line_reason(ckpt, tmp_path):
    """The weight checks run in the worker's loader, the same code under `vllm serve` and `LLM`: all three cases
    load in one process (`vllm serve` itself, with a weight error, is tests/tools/test_corrupt_checkpoints.py)."""
    bad = {how: _corrupt(ckpt, tmp_path / how, how) for how in WEIGHT_ERRORS}
    errors = offline_load_errors(list(bad.values()), tmp_path, timeout_s=400)
    for how, path in bad.items():
        error = errors[str(path)]
        assert error is not None, f"{how}: LLM(...) loaded a corrupt checkpoint"
        assert WEIGHT_ERRORS[how] in error and "\n" not in error, (how, error)


def test_bad_config_fails_at_serve_with_one_line_reason(ckpt, tmp_path):
    bad = _corrupt(ckpt, tmp_path / "config", "config")
    result = subprocess.run([VLLM, "serve", str(bad), "--dtype", "float32", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=300, env=server_env())
    assert result.returncode != 0
    assert "layer_types[0]: must be 'full_attention'" in result.stdout + result.stderr


@pytest.fixture(scope="module")
def hysparse2_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve2") / "tiny", "hysparse2", "tiny", seed=22)


@pytest.fixture(scope="module")
def hysparse2_server(hysparse2_ckpt, tmp_path_factory):
    # Eager: the HySparse server above is the compiled one users start, and HySparse2's compiled early exit is
    # checked offline (tests/models/test_hysparse2.py); a compile here would cost CI a minute.
    yield from _serve(hysparse2_ckpt, tmp_path_factory.mktemp("serve2-log") / "serve.log", "--enforce-eager")


def test_hysparse2_serves_with_early_exit(hysparse2_server, hysparse2_ckpt):
    base_url, log = hysparse2_server
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Sort a list."}],
                                           max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8
    # Early exit is on without any flag, and prompt logprobs are served per request: a mixed batch of requests
    # with and without them, sent together, against the reference's prompt rows.
    reference = AutoModelForCausalLM.from_pretrained(hysparse2_ckpt, dtype=torch.float32).eval()
    prompts = random_prompts([300, 120, 260, 80], reference.config.vocab_size, seed=24)
    asks = [1, None, 0, None]

    def send(prompt, k):
        extra = {} if k is None else {"prompt_logprobs": k}
        return client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)

    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(send, prompts, asks))
    checked = 0
    for prompt, k, r in zip(prompts, asks, replies, strict=True):
        served = r.choices[0].model_extra.get("prompt_logprobs")
        if k is None:
            assert served is None
            continue
        with torch.no_grad():
            want = torch.log_softmax(reference(torch.tensor([prompt]), use_cache=False).logits[0].double(), -1)
        assert served[0] is None and len(served) == len(prompt)
        for pos in range(1, len(prompt)):
            got = served[pos][str(prompt[pos])]["logprob"]
            assert abs(got - float(want[pos - 1, prompt[pos]])) < 2e-3, (pos, k)
            checked += 1
    assert checked == 299 + 259
    text = log.read_text()
    assert "prefill early exit on" in text
    assert re.search(r"HySparse KV cache: \d+ bytes/token in 3 full-length caches", text)
    long_prompt = random_prompts([300], 8192, seed=23)[0]
    client.completions.create(model=model, prompt=long_prompt, max_tokens=2)
    time.sleep(0.6)
    lines = {k: float(v) for k, v in (line.split(" ") for line in hysparse_metrics(base_url))}
    # Token selection: recent 16 + top 16 tokens, at least one page and at most 32 per query; the gauge is the
    # mean of the counters
    assert lines["vllm:hysparse_sparse_queries_total"] > 0
    assert 1 <= lines["vllm:hysparse_pages_per_query"] <= 32
    assert lines["vllm:hysparse_pages_per_query"] == pytest.approx(
        lines["vllm:hysparse_pages_touched_total"] / lines["vllm:hysparse_sparse_queries_total"], rel=1e-9)


# A schema whose every valid instance is short: with random weights, a free-form string or number could run
# past max_tokens.
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
CHOICES = ["alpha", "beta", "gamma"]
REGEX = r"[0-9]{3}-[a-z]{2}"


@pytest.mark.parametrize("which", ["server", "hysparse2_server"])
def test_structured_outputs_are_valid(request, which):
    """JSON schema, choice and regex constraints (vLLM's structured outputs) hold on sampled output."""
    import jsonschema

    base_url, _ = request.getfixturevalue(which)
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a city as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    for seed in range(4):
        choice = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=1.0,
                                                seed=seed, response_format=fmt).choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        text = client.completions.create(model=model, prompt="Pick one:", max_tokens=8, temperature=1.0, seed=seed,
                                         extra_body={"structured_outputs": {"choice": CHOICES}}).choices[0].text
        assert text in CHOICES, (seed, text)
        text = client.completions.create(model=model, prompt="Code:", max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body={"structured_outputs": {"regex": REGEX}}).choices[0].text
        assert re.fullmatch(REGEX, text), (seed, text)
    # The control: the same request unconstrained is not an instance of the schema.
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=1.0,
                                          seed=0).choices[0].message.content
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMA)
