# SPDX-License-Identifier: Apache-2.0
"""The PIC router's planning and settings (`vllm_hysparse/pic/router.py`), without servers; with servers, behind two
instances that share a tier, in `test_shared_serve.py`."""

import pytest

from vllm_hysparse.pic.router import Backend, Router, main, segment_jobs


def test_segment_requests_cover_the_reusable_segments_longest_first():
    prompt = list(range(100, 100 + 5 + 40 + 3 + 70 + 20 + 6))
    body = {"model": "m", "prompt": prompt, "cache_salt": "tenant",
            "vllm_xargs": {"pic_segments": [5, 40, 3, 70, 20, 6], "pic_seam_tokens": 4}}
    jobs = segment_jobs(body)
    # 3 tokens is within the seam: never stored, so no request; the others longest first.
    assert [j["vllm_xargs"]["pic_segments"] for j in jobs] == [[1, 70, 1], [1, 40, 1], [1, 20, 1]]
    starts = {70: 5 + 40 + 3, 40: 5, 20: 5 + 40 + 3 + 70}
    for job in jobs:
        n = job["vllm_xargs"]["pic_segments"][1]
        assert job["prompt"] == [prompt[0], *prompt[starts[n]:starts[n] + n], prompt[-1]]
        assert job["cache_salt"] == "tenant" and job["max_tokens"] == 0 and job["vllm_xargs"]["pic_seam_tokens"] == 4


@pytest.mark.parametrize("body", [
    {"prompt": "text", "vllm_xargs": {"pic_segments": [1, 2, 1]}},  # not token ids: the backend answers it
    {"prompt": [1, 2, 3, 4], "vllm_xargs": {"pic_segments": [1, 2]}},  # no middle segment
    {"prompt": [1, 2, 3, 4], "vllm_xargs": {"pic_segments": [1, 2, 2]}},  # does not sum to the prompt
    {"prompt": [1, 2, 3, 4]},
])
def test_what_the_router_does_not_plan(body):
    assert segment_jobs(body) == []


def test_least_loaded_backend_first_and_down_backends_avoided():
    a, b = Backend("http://a:1"), Backend("http://b:1")
    router = Router([a, b])
    a.assigned_tokens = 100
    assert router.pick() is b
    router.mark_down(b, "test")
    assert router.pick() is a and router.pick(exclude=[a]) is b  # down, but the only one left


@pytest.mark.parametrize("argv, needle", [
    ([], "--backends: give at least one"),
    (["--backends", "localhost:8000"], "is not http(s)://host:port"),
    (["--backends", "http://a:1", "http://a:1/"], "named twice"),
    (["--backends", "http://a:1", "--port", "70000"], "--port: 70000"),
])
def test_bad_settings_get_one_line_and_status_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
