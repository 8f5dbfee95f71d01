# SPDX-License-Identifier: Apache-2.0
"""A router in front of N `vllm serve` instances that share a PIC tier: cold segments prefilled in parallel.

    python -m vllm_hysparse.pic.router --backends http://10.0.0.1:8000 http://10.0.0.2:8000 --port 9000

It speaks the OpenAI API. A PIC completion (`vllm_xargs.pic_segments` over a token-id prompt) is served in two
phases:
1. **Segments.** Each reusable segment (a middle one, longer than the seam) goes, longest first, to the backend
   with the least work assigned (HYPIC's LPT schedule), as a publish-only PIC request of its own
   (`vllm_hysparse.pic.publish`): `[first prompt token] + segment + [last prompt token]`, `max_tokens` 0, the
   request's `cache_salt` kept. A backend that holds the segment already (its store or the shared tier) answers
   at once; one that does not computes it in isolation and answers once it has written it to the shared tier.
2. **The request** goes whole to the backend that computed the most segment tokens (they are in its own store);
   it finds the rest in the shared tier, and its answer (streamed or not) is passed back.

Everything else (plain completions, chat, `/v1/models`, streaming) is passed to the least-loaded backend.
`/health` is the router's own (healthy while one backend is), and `/metrics` gives the router's queue depth,
per-backend load and the time PIC requests spent in each phase (`vllm:hysparse_pic_router_*`). A backend that
fails (connection refused or dropped before its answer began) is marked down for `DOWN_S` and its work goes to
another one.

Without a shared tier on the backends the router still balances load; the segments phase then only warms the
backends it ran on.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field

from vllm_hysparse.pic.layout import DEFAULT_SEAM, SEAM_FIELD, SEGMENTS_FIELD

logger = logging.getLogger("vllm.hysparse.router")

DOWN_S = 10.0
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


class RouterConfigError(ValueError):
    """A bad router setting, in one line."""


@dataclass(eq=False)  # one object per backend, hashed by identity
class Backend:
    url: str  # http://host:port, no trailing slash
    in_flight: int = 0  # requests (and segment requests) now running on it
    assigned_tokens: int = 0  # segment tokens of the current LPT schedules not yet done
    down_until: float = 0.0
    served: int = 0

    def up(self) -> bool:
        return time.monotonic() >= self.down_until


@dataclass
class Router:
    backends: list[Backend]
    timeout_s: float = 600.0
    queue_depth: int = 0  # PIC requests in their segments phase
    segment_requests: int = 0
    retries: int = 0
    # Seconds PIC requests spent in each phase (segments: until every segment request was answered, i.e. written
    # to the shared tier; request: the whole request, until its answer began), and how many went through them.
    phase_seconds: dict = field(default_factory=lambda: {"segments": 0.0, "request": 0.0})
    pic_requests: int = 0

    def pick(self, exclude=()) -> Backend:
        """The backend with the least work, among those up (all of them if none is)."""
        live = [b for b in self.backends if b.up() and b not in exclude] or \
            [b for b in self.backends if b not in exclude] or self.backends
        return min(live, key=lambda b: (b.assigned_tokens + 64 * b.in_flight, b.in_flight))

    def mark_down(self, backend: Backend, why: str) -> None:
        backend.down_until = time.monotonic() + DOWN_S
        logger.warning("backend %s failed (%s); marked down for %.0f s", backend.url, why, DOWN_S)


def check_backends(urls: list[str]) -> list[str]:
    """Normalised backend URLs; one-line `RouterConfigError` for anything else."""
    from urllib.parse import urlparse

    if not urls:
        raise RouterConfigError("--backends: give at least one http://host:port")
    out = []
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path.strip("/") not in ("", "v1"):
            raise RouterConfigError(f"--backends: {url!r} is not http(s)://host:port")
        out.append(f"{parsed.scheme}://{parsed.netloc}")
    if len(set(out)) != len(out):
        raise RouterConfigError("--backends: the same backend is named twice")
    return out


def segment_jobs(body: dict) -> list[dict]:
    """The segment requests of a PIC completion body, longest first; [] when it is not a token-id PIC request."""
    xargs = body.get("vllm_xargs") or {}
    segments, prompt = xargs.get(SEGMENTS_FIELD), body.get("prompt")
    if not isinstance(segments, list) or not isinstance(prompt, list) or not prompt \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) \
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in segments) \
            or sum(segments) != len(prompt) or len(segments) < 3:
        return []  # not ours to plan: the backend validates and answers it
    seam = xargs.get(SEAM_FIELD, DEFAULT_SEAM)
    jobs, start = [], segments[0]
    for n in segments[1:-1]:
        if isinstance(seam, int) and n > seam:
            job = {"model": body.get("model"), "prompt": [prompt[0], *prompt[start:start + n], prompt[-1]],
                   "max_tokens": 0,
                   "vllm_xargs": {SEGMENTS_FIELD: [1, n, 1], SEAM_FIELD: seam}}
            if body.get("cache_salt") is not None:
                job["cache_salt"] = body["cache_salt"]
            jobs.append(job)
        start += n
    return sorted(jobs, key=lambda j: -len(j["prompt"]))


def build_app(router: Router, headers_for_backends: dict | None = None):
    """The router's ASGI app (Starlette)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(timeout=httpx.Timeout(router.timeout_s, connect=5.0))
    extra_headers = headers_for_backends or {}

    def forward_headers(request) -> dict:
        return {**{k: v for k, v in request.headers.items() if k.lower() not in _HOP}, **extra_headers}

    async def run_segment(job: dict, headers: dict) -> Backend | None:
        """Send one segment request, retrying on other backends; returns the backend that answered."""
        tried = []
        while len(tried) < len(router.backends):
            backend = router.pick(exclude=tried)
            tried.append(backend)
            backend.in_flight += 1
            backend.assigned_tokens += len(job["prompt"])
            try:
                r = await client.post(f"{backend.url}/v1/completions", json=job, headers=headers)
                if r.status_code >= 500:
                    raise httpx.HTTPError(f"status {r.status_code}")
                router.segment_requests += 1
                return backend if r.status_code == 200 else None
            except httpx.HTTPError as e:
                router.mark_down(backend, f"{type(e).__name__}: {e}")
                router.retries += 1
            finally:
                backend.in_flight -= 1
                backend.assigned_tokens -= len(job["prompt"])
        return None

    async def prefill_segments(body: dict, headers: dict) -> Backend | None:
        """Run the segment requests (each answered once its segment is in the shared tier); returns the backend
        that computed the most segment tokens, which runs the whole request: it holds those in its own store."""
        jobs = segment_jobs(body)
        if not jobs:
            return None
        router.queue_depth += 1
        try:
            # Longest first onto the least-loaded backend: pick() counts each backend's assigned tokens, and
            # the tasks start in order, so each job sees the ones before it.
            t0 = time.monotonic()
            used = await asyncio.gather(*(run_segment(job, headers) for job in jobs))
            router.phase_seconds["segments"] += time.monotonic() - t0
            router.pic_requests += 1
            tokens: dict[Backend, int] = {}
            for backend, job in zip(used, jobs):
                if backend is not None:
                    tokens[backend] = tokens.get(backend, 0) + len(job["prompt"])
            return max(tokens, key=tokens.get, default=None)
        finally:
            router.queue_depth -= 1

    async def proxy(request: Request, body: bytes, path: str, prefer: Backend | None = None):
        """Pass the request to `prefer` if it is up, else the least-loaded backend; retry on another one until its
        answer begins."""
        headers = forward_headers(request)
        tried = []
        while True:
            backend = prefer if prefer is not None and prefer.up() and not tried else router.pick(exclude=tried)
            tried.append(backend)
            backend.in_flight += 1
            try:
                upstream = await client.send(client.build_request(request.method, f"{backend.url}{path}",
                                                                  content=body, headers=headers,
                                                                  params=request.query_params), stream=True)
            except httpx.HTTPError as e:
                backend.in_flight -= 1
                router.mark_down(backend, f"{type(e).__name__}: {e}")
                if len(tried) >= len(router.backends):
                    return JSONResponse({"error": {"message": "no backend answered", "type": "BadGateway",
                                                   "code": 502}}, status_code=502)
                router.retries += 1
                continue
            backend.served += 1

            async def stream(upstream=upstream, backend=backend):
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:
                    await upstream.aclose()
                    backend.in_flight -= 1

            keep = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            return StreamingResponse(stream(), status_code=upstream.status_code, headers=keep)

    async def completions(request: Request):
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not (isinstance(parsed, dict) and segment_jobs(parsed)):
            return await proxy(request, body, "/v1/completions")
        t0 = time.monotonic()
        prefer = await prefill_segments(parsed, forward_headers(request))
        answer = await proxy(request, body, "/v1/completions", prefer)
        router.phase_seconds["request"] += time.monotonic() - t0
        return answer

    async def passthrough(request: Request):
        return await proxy(request, await request.body(), request.url.path)

    async def health(_):
        for backend in router.backends:
            try:
                if (await client.get(f"{backend.url}/health", timeout=5)).status_code == 200:
                    return Response(status_code=200)
            except httpx.HTTPError:
                continue
        return Response(status_code=503)

    async def metrics(_):
        lines = [
            "# TYPE vllm:hysparse_pic_router_queue_depth gauge",
            f"vllm:hysparse_pic_router_queue_depth {router.queue_depth}",
            "# TYPE vllm:hysparse_pic_router_segment_requests_total counter",
            f"vllm:hysparse_pic_router_segment_requests_total {router.segment_requests}",
            "# TYPE vllm:hysparse_pic_router_retries_total counter",
            f"vllm:hysparse_pic_router_retries_total {router.retries}",
            "# TYPE vllm:hysparse_pic_router_pic_requests_total counter",
            f"vllm:hysparse_pic_router_pic_requests_total {router.pic_requests}",
            "# TYPE vllm:hysparse_pic_router_phase_seconds_total counter",
            *(f'vllm:hysparse_pic_router_phase_seconds_total{{phase="{phase}"}} {seconds:.6f}'
              for phase, seconds in router.phase_seconds.items()),
            "# TYPE vllm:hysparse_pic_router_backend_in_flight gauge",
            *(f'vllm:hysparse_pic_router_backend_in_flight{{backend="{b.url}"}} {b.in_flight}'
              for b in router.backends),
            "# TYPE vllm:hysparse_pic_router_backend_served_total counter",
            *(f'vllm:hysparse_pic_router_backend_served_total{{backend="{b.url}"}} {b.served}'
              for b in router.backends),
            "# TYPE vllm:hysparse_pic_router_backend_up gauge",
            *(f'vllm:hysparse_pic_router_backend_up{{backend="{b.url}"}} {int(b.up())}' for b in router.backends),
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/{path:path}", passthrough, methods=["GET", "POST"])]
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_hysparse.pic.router", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=[], help="the vllm serve instances, http://host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a backend may take to answer")
    args = parser.parse_args(argv)
    try:
        urls = check_backends(args.backends)
        if not 0 < args.port < 65536:
            raise RouterConfigError(f"--port: {args.port} is not a TCP port")
        if not args.timeout > 0:
            raise RouterConfigError(f"--timeout: must be > 0 (got {args.timeout})")
    except RouterConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    router = Router([Backend(u) for u in urls], timeout_s=args.timeout)
    logger.info("routing to %s", ", ".join(urls))
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
