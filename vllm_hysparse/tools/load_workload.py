# SPDX-License-Identifier: Apache-2.0
"""The load test's workload on the tiny checkpoints: what `benchmarks/load_test.py` and `benchmarks/soak_test.py` send.

- prompts: `Spec` (token ids, PIC segments), `DocPool` (documents PIC requests share), `make_specs`;
- requests: `Job`, `make_jobs`, `Outcome`, `make_client`, `stream_one` (one streaming request, maybe cut
  short), `run_burst` (all jobs at once);
- the reference: `alone_answers` (every prompt served alone) and `check_outcomes` (outcomes against them);
- the server: `ensure_tiny` (the tiny checkpoint of an architecture) and `serve_cmd`.

The server plumbing (start, health, /metrics, RSS) is `vllm_hysparse.tools.harness`. openai and httpx2 are
imported inside the functions that use them.
"""

import asyncio
import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hysparse.tools.harness import VLLM

ARCHS = ("hysparse", "hysparse2")
LABELS = {"hysparse": "HySparse tiny", "hysparse2": "HySparse2 tiny"}
SEEDS = {"hysparse": 41, "hysparse2": 42}
VOCAB_LOW, VOCAB_HIGH = 16, 8192  # skip the special tokens at the start of the tiny vocabulary
MAX_MODEL_LEN = 1024
ALONE_SALT = "alone"


# ---------------------------------------------------------------- requests

@dataclass
class Spec:
    """One distinct prompt: token ids and, for PIC, its segment lengths and seam."""
    prompt: list[int]
    pic_segments: list[int] | None = None
    pic_seam: int | None = None
    docs: list[int] | None = None  # PIC: which pool documents, in order

    @property
    def kind(self) -> str:
        return "pic" if self.pic_segments else "plain"

    def xargs(self) -> dict:
        if not self.pic_segments:
            return {}
        return {"vllm_xargs": {"pic_segments": self.pic_segments, "pic_seam_tokens": self.pic_seam}}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


class DocPool:
    """A few system prefixes and documents that PIC requests share, in new orders."""

    def __init__(self, rng: random.Random, n_prefixes: int = 3, n_docs: int = 8, doc_lens=(24, 200)):
        self.prefixes = [_tokens(rng, rng.choice((8, 16, 24))) for _ in range(n_prefixes)]
        self.docs = [_tokens(rng, rng.randint(*doc_lens)) for _ in range(n_docs)]

    def spec(self, rng: random.Random, seams=(4, 8, 16), max_docs: int = 4) -> Spec:
        prefix = rng.choice(self.prefixes)
        order = rng.sample(range(len(self.docs)), rng.randint(1, max_docs))
        query = _tokens(rng, rng.randint(4, 32))
        pieces = [prefix, *(self.docs[i] for i in order), query]
        return Spec([t for p in pieces for t in p], [len(p) for p in pieces], rng.choice(seams), order)


def make_specs(rng: random.Random, n: int, pic_fraction: float, prompt_lens: tuple[int, int], pool: DocPool
               ) -> list[Spec]:
    """`n` distinct prompts: a `pic_fraction` share PIC, the rest plain with log-uniform lengths."""
    n_pic = round(n * pic_fraction)
    specs = [pool.spec(rng) for _ in range(n_pic)]
    specs += [Spec(_tokens(rng, _log_uniform(rng, *prompt_lens))) for _ in range(n - n_pic)]
    rng.shuffle(specs)
    return specs


@dataclass
class Job:
    """One client's request: which spec, how many tokens, whether it disconnects and after how many chunks."""
    spec: int
    max_tokens: int
    disconnect_after: int | None = None  # chunks with tokens, then close the stream


def make_jobs(rng: random.Random, specs: list[Spec], clients: int, output_lens: tuple[int, int],
              disconnect_fraction: float) -> list[Job]:
    """`clients` jobs over `specs` (each spec about equally often, shuffled), output lengths uniform in
    `output_lens` (capped by `MAX_MODEL_LEN`), a `disconnect_fraction` share cut short."""
    order = [i % len(specs) for i in range(clients)]
    rng.shuffle(order)
    n_disc = round(clients * disconnect_fraction)
    disc = set(rng.sample(range(clients), n_disc))
    jobs = []
    for c, s in enumerate(order):
        out = rng.randint(*output_lens)
        out = min(out, MAX_MODEL_LEN - len(specs[s].prompt))
        jobs.append(Job(s, out, rng.randint(1, max(1, out - 1)) if c in disc else None))
    return jobs


# ---------------------------------------------------------------- clients

@dataclass
class Outcome:
    """How one request went; times in seconds from the burst's start, `tokens` the token ids received."""
    job: int
    kind: str
    max_tokens: int
    disconnect_after: int | None
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    tokens: list[int] = field(default_factory=list)
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    disconnected: bool = False

    @property
    def ttft(self):
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def tpot(self):
        if self.t_first is None or self.t_end is None or len(self.tokens) < 2 or self.disconnected:
            return None
        return (self.t_end - self.t_first) / (len(self.tokens) - 1)

    @property
    def e2e(self):
        return None if self.t_end is None else self.t_end - self.t_start


def make_client(root_url: str, timeout_s: float, connections: int):
    """An `openai.AsyncOpenAI` for `connections` concurrent streams: no retries, `timeout_s` per request."""
    import httpx2
    import openai

    # keepalive_expiry below uvicorn's 5 s keep-alive: a request on a connection the server is closing is reset.
    limits = httpx2.Limits(max_connections=connections + 16, max_keepalive_connections=connections + 16,
                           keepalive_expiry=1.0)
    return openai.AsyncOpenAI(base_url=f"{root_url}/v1", api_key="unused", max_retries=0,
                              timeout=httpx2.Timeout(timeout_s, connect=30.0), http_client=httpx2.AsyncClient(
                                  limits=limits, timeout=httpx2.Timeout(timeout_s, connect=30.0)))


async def stream_one(client, model: str, spec: Spec, job: Job, idx: int, t0: float, salt: str | None = None
                     ) -> Outcome:
    """One streaming request; closes the stream after `job.disconnect_after` chunks with tokens."""
    out = Outcome(idx, spec.kind, job.max_tokens, job.disconnect_after)
    body = {"return_token_ids": True, "ignore_eos": True, **spec.xargs()}
    if salt:
        body["cache_salt"] = salt
    out.t_start = time.monotonic() - t0
    stream = None
    try:
        stream = await client.completions.create(model=model, prompt=spec.prompt, max_tokens=job.max_tokens,
                                                 temperature=0, stream=True, extra_body=body)
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            ids = getattr(choice, "token_ids", None) or []
            if ids:
                if out.t_first is None:
                    out.t_first = time.monotonic() - t0
                out.tokens.extend(ids)
                out.chunks += 1
            if choice.finish_reason:
                out.finish_reason = choice.finish_reason
            if job.disconnect_after is not None and out.chunks >= job.disconnect_after:
                out.disconnected = True
                break
        out.t_end = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - every failure is a recorded outcome
        out.error = f"{type(e).__name__}: {e}"[:500]
        out.t_end = time.monotonic() - t0
    finally:
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.close()
    return out


async def run_burst(root_url: str, model: str, specs: list[Spec], jobs: list[Job], timeout_s: float,
                    overall_s: float, salt: str | None = None) -> tuple[list[Outcome], float]:
    """All jobs at once, one streaming connection each; (outcomes, wall seconds)."""
    client = make_client(root_url, timeout_s, len(jobs))
    t0 = time.monotonic()
    tasks = [asyncio.create_task(stream_one(client, model, specs[j.spec], j, i, t0, salt))
             for i, j in enumerate(jobs)]
    done, pending = await asyncio.wait(tasks, timeout=overall_s)
    for t in pending:
        t.cancel()
    outcomes = []
    for i, t in enumerate(tasks):
        if t in done:
            outcomes.append(t.result())
        else:
            o = Outcome(i, specs[jobs[i].spec].kind, jobs[i].max_tokens, jobs[i].disconnect_after,
                        error=f"not finished within the overall bound of {overall_s:.0f} s")
            outcomes.append(o)
    wall = time.monotonic() - t0
    with contextlib.suppress(Exception):
        await client.close()
    return outcomes, wall


def alone_answers(root_url: str, model: str, specs: list[Spec], max_tokens: list[int], timeout_s: float,
                  salt: str = ALONE_SALT) -> list[dict]:
    """Each spec served alone, one request at a time: token ids and the top-2 logprob margin per position."""
    import openai

    client = openai.OpenAI(base_url=f"{root_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    answers = []
    for spec, n in zip(specs, max_tokens):
        t = time.monotonic()
        res = client.completions.create(
            model=model, prompt=spec.prompt, max_tokens=n, temperature=0, logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True, "return_tokens_as_token_ids": True,
                        "cache_salt": salt, **spec.xargs()})
        choice = res.choices[0]
        margins = []
        for top in (choice.logprobs.top_logprobs or []):
            vals = sorted(top.values(), reverse=True) if top else []
            margins.append(vals[0] - vals[1] if len(vals) > 1 else None)
        answers.append({"tokens": list(choice.token_ids), "margins": margins, "s": time.monotonic() - t})
    client.close()
    return answers


def check_outcomes(outcomes: list[Outcome], jobs: list[Job], answers: list[dict]) -> dict:
    """Failures and mismatches against the alone answers (a mismatch notes the alone top-2 margin there)."""
    failed, mismatched, short = [], [], []
    completed = disconnected = prefix_checked = 0
    for o, j in zip(outcomes, jobs):
        want = answers[j.spec]["tokens"][:j.max_tokens]
        if o.error:
            failed.append({"job": o.job, "kind": o.kind, "error": o.error})
            continue
        if o.disconnected:
            disconnected += 1
            got, ref = o.tokens, want[:len(o.tokens)]
            prefix_checked += 1
        else:
            completed += 1
            got, ref = o.tokens, want
            if len(got) != j.max_tokens or o.finish_reason != "length":
                short.append({"job": o.job, "kind": o.kind, "got_len": len(got), "max_tokens": j.max_tokens,
                              "finish_reason": o.finish_reason})
        if got != ref:
            pos = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            margins = answers[j.spec]["margins"]
            mismatched.append({"job": o.job, "spec": j.spec, "kind": o.kind, "disconnected": o.disconnected,
                               "first_diff": pos, "got": got[pos:pos + 4], "alone": ref[pos:pos + 4],
                               "alone_top2_margin": margins[pos] if pos < len(margins) else None})
    return {"completed": completed, "disconnected": disconnected, "failed": failed, "mismatched": mismatched,
            "wrong_length": short, "prefix_checked": prefix_checked}


# ---------------------------------------------------------------- the server

def ensure_tiny(arch: str, directory: Path) -> Path:
    """`directory/<arch>-tiny`, the tiny checkpoint of `arch` (seed `SEEDS[arch]`), written once."""
    from vllm_hysparse.tools.make_checkpoint import write_checkpoint

    path = directory / f"{arch}-tiny"
    if not (path / "config.json").exists():
        write_checkpoint(path, arch, "tiny", seed=SEEDS[arch], force=True)
    return path


def serve_cmd(ckpt: Path, port: int, args) -> list[str]:
    """`vllm serve` on loopback for the load: `args.max_num_seqs`, `args.enforce_eager` (argparse namespace)."""
    cmd = [str(VLLM), "serve", str(ckpt), "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(args.max_num_seqs),
           "--disable-uvicorn-access-log"]
    return cmd + (["--enforce-eager"] if args.enforce_eager else [])
