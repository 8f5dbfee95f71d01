# SPDX-License-Identifier: Apache-2.0
"""Publish-only PIC requests (`vllm_hysparse/pic/publish.py`) without a server: which bodies are ones, what vLLM
runs for them, what they refuse, how their answer is stripped, and the wait on the workers' counter files (written
here in the format `vllm_hysparse.metrics` publishes). With servers: `test_shared_serve.py`."""

import asyncio
import json
import time

import pytest

from vllm_hysparse.metrics import PagesPerQueryStats
from vllm_hysparse.pic.publish import (
    PublishOnlyError,
    engine_request,
    is_publish_only,
    strip_generation,
    wait_published,
)

PIC = {"vllm_xargs": {"pic_segments": [2, 3, 1]}}


def test_which_bodies_are_publish_only():
    assert is_publish_only({**PIC, "max_tokens": 0})
    assert is_publish_only({"max_tokens": 0, "vllm_xargs": {"pic_text_segments": ["a", "b"]}})
    for body in ({**PIC, "max_tokens": 1}, {**PIC}, {**PIC, "max_tokens": False}, {"max_tokens": 0},
                 {"max_tokens": 0, "vllm_xargs": ["pic_segments"]}, None, [0]):
        assert not is_publish_only(body), body


def test_engine_request_and_refusals():
    got = engine_request({**PIC, "max_tokens": 0, "temperature": 0.8, "min_tokens": 3})
    assert (got["max_tokens"], got["temperature"], got["min_tokens"]) == (1, 0, 0)
    assert got["vllm_xargs"] == PIC["vllm_xargs"]
    for field, value in (("stream", True), ("echo", True), ("logprobs", 0), ("n", 3)):
        with pytest.raises(PublishOnlyError) as info:
            engine_request({**PIC, "max_tokens": 0, field: value})
        assert info.value.field == field and str(info.value).startswith(f"{field}: ")
    engine_request({**PIC, "max_tokens": 0, "stream": False, "echo": False, "n": 1})  # harmless values pass


def test_strip_generation():
    answer = {"id": "x", "choices": [{"index": 0, "text": " hello", "finish_reason": "length", "logprobs": {"a": 1},
                                      "token_ids": [7]}],
              "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}}
    out = json.loads(strip_generation(json.dumps(answer).encode()))
    assert out["choices"][0]["text"] == "" and out["choices"][0]["logprobs"] is None
    assert out["choices"][0]["token_ids"] is None
    assert out["usage"] == {"prompt_tokens": 40, "completion_tokens": 0, "total_tokens": 40}
    assert strip_generation(b"not json") == b"not json"


def _write_worker(directory, pid: int, queued: int, published: int, failures: int) -> None:
    (directory / f"worker-{pid}.json").write_text(json.dumps(
        {"pic_shared_queued": queued, "pic_shared_published": published, "pic_shared_publish_failures": failures}))


def test_wait_published_follows_the_workers_files(tmp_path):
    _write_worker(tmp_path, 11, 3, 1, 0)
    _write_worker(tmp_path, 12, 2, 2, 0)

    async def later(delay, *counts):
        await asyncio.sleep(delay)
        _write_worker(tmp_path, 11, *counts)

    async def scenario(counts, failures_before):
        t0 = time.monotonic()
        result, _ = await asyncio.gather(wait_published(tmp_path, failures_before, timeout_s=5),
                                         later(0.3, *counts))
        return result, time.monotonic() - t0

    result, waited = asyncio.run(scenario((3, 3, 0), 0))
    assert result == b"1" and waited >= 0.3  # held until worker 11 had written its last two
    _write_worker(tmp_path, 11, 3, 1, 0)
    result, _ = asyncio.run(scenario((3, 2, 1), 0))
    assert result == b"0"  # one write failed meanwhile
    _write_worker(tmp_path, 11, 4, 2, 1)
    assert asyncio.run(wait_published(tmp_path, 1, timeout_s=0.2)) == b"timeout"
    assert asyncio.run(wait_published(None, 0)) == b"1"  # no metrics directory: nothing to wait on


def test_flush_writes_the_counters_at_once(tmp_path, monkeypatch):
    """`set_pic(flush=True)` is on file when it returns (the wait above relies on it); without, within 0.2 s."""
    from vllm_hysparse import metrics

    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(metrics, "_PUBLISH_INTERVAL_S", 3600.0)  # the background writer never runs here
    stats = PagesPerQueryStats()
    assert stats.enabled
    stats.set_pic({"shared_queued": 5})
    assert metrics.read_totals(tmp_path).get("pic_shared_queued", 0) == 0
    stats.set_pic({"shared_queued": 6}, flush=True)
    assert metrics.read_totals(tmp_path)["pic_shared_queued"] == 6
