# SPDX-License-Identifier: Apache-2.0
"""`vllm serve` on a HySparse checkpoint, driven through the OpenAI client, as a user would."""

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import random_prompts, reference_greedy
from vllm_hysparse.tools.demo_client import hysparse_metrics, wait_until_healthy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

VLLM = str(Path(sys.executable).parent / "vllm")
SERVE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    import os

    return {**os.environ, **SERVE_ENV}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", "hysparse", "tiny", seed=21)


def _serve(ckpt, log: Path):
    """Start `vllm serve` as a user would; yields (base_url, log path) while it runs."""
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([VLLM, "serve", str(ckpt), "--dtype", "float32", "--port", str(port),
                                 "--max-model-len", "1024"], stdout=out, stderr=subprocess.STDOUT, env=_env())
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_healthy(base_url, 300)
    except TimeoutError:
        proc.kill()
        pytest.fail("vllm serve did not start:\n" + log.read_text()[-4000:])
    yield base_url, log
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    yield from _serve(ckpt, tmp_path_factory.mktemp("serve-log") / "serve.log")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused")


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def test_completion_matches_reference(client, model_name, ckpt):
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
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


def test_streaming_completion(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt="import os\n", max_tokens=8, temperature=0,
                                            stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2


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

    before = totals()
    prompt = random_prompts([600], 8192, seed=6)[0]
    client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0)
    deadline = time.monotonic() + 10
    while totals()["vllm:hysparse_sparse_queries_total"] <= before["vllm:hysparse_sparse_queries_total"]:
        assert time.monotonic() < deadline, "pages-per-query counters did not move"
        time.sleep(0.3)
    time.sleep(0.5)  # let the worker publish the rest of the step
    after = totals()
    queries = after["vllm:hysparse_sparse_queries_total"] - before["vllm:hysparse_sparse_queries_total"]
    pages = after["vllm:hysparse_pages_touched_total"] - before["vllm:hysparse_pages_touched_total"]
    dense = after["vllm:hysparse_dense_pages_total"] - before["vllm:hysparse_dense_pages_total"]
    cfg = json.loads((ckpt / "config.json").read_text())
    # 2 selected blocks of 16 tokens touch at most 2 pages each (a block never spans more
    # than 2 pages); the long prompt makes dense attention touch many more pages on average.
    assert 1 <= pages / queries <= 2 * cfg["sparse_topk_blocks"]
    assert pages < dense
    assert after["vllm:hysparse_pages_per_query"] > 0


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


@pytest.mark.parametrize("how, message", [
    ("missing", "missing tensor(s) model.layers.1.self_attn.swa_v_proj.weight"),
    ("extra", "unexpected tensor model.layers.1.self_attn.k_proj.weight"),
    ("shape", "model.layers.0.self_attn.o_proj.weight has shape (128, 64), expected (128, 256)"),
    ("config", "layer_types[0]: must be 'full_attention'"),
])
def test_bad_checkpoint_fails_at_load_with_one_line_reason(ckpt, tmp_path, how, message):
    bad = _corrupt(ckpt, tmp_path / how, how)
    result = subprocess.run([VLLM, "serve", str(bad), "--dtype", "float32", "--port", str(_free_port())],
                            capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


@pytest.fixture(scope="module")
def hysparse2_server(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("serve2") / "tiny", "hysparse2", "tiny", seed=22)
    yield from _serve(ckpt, tmp_path_factory.mktemp("serve2-log") / "serve.log")


def test_hysparse2_serves_with_early_exit(hysparse2_server):
    base_url, log = hysparse2_server
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Sort a list."}],
                                           max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8
    # Early exit is on without any flag, so prompt logprobs are refused with a clear reason.
    with pytest.raises(openai.BadRequestError, match="prompt logprobs"):
        client.completions.create(model=model, prompt="import os", max_tokens=1, extra_body={"prompt_logprobs": 1})
    text = log.read_text()
    assert "prefill early exit on" in text
    assert re.search(r"HySparse KV cache: \d+ bytes/token in 3 full-length caches", text)
    long_prompt = random_prompts([300], 8192, seed=23)[0]
    client.completions.create(model=model, prompt=long_prompt, max_tokens=2)
    time.sleep(0.6)
    lines = dict(line.split(" ") for line in hysparse_metrics(base_url))
    # Token selection: recent 16 + top 16 tokens spread over many pages.
    assert float(lines["vllm:hysparse_pages_per_query"]) >= 1
