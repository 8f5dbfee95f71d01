# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests that drive the real vLLM engine on CPU and compare against the reference model."""

import collections
import contextlib
import os
import weakref
from dataclasses import dataclass

import pytest
import torch

# CPU vLLM needs these before an engine starts (see README); tests share engines
# per module because each start costs 20-60 s.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# Lets tests send a plain function to the worker (`collective_rpc`) to inspect
# what vLLM allocated; only our own processes talk to each other here.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

TOP_LOGPROBS = 5
# Engines this pytest process started, by kind (`tests/conftest.py` prints them at the end of the run):
# "offline" (`make_llm`), "serve" (a `vllm serve` subprocess), "load-check" (`offline_load_errors`).
ENGINE_STARTS: collections.Counter = collections.Counter()
# Seconds from start to ready, by test file: "file kind" -> seconds, and the number of starts timed
# (`tests/conftest.py` prints the table at the end of the run, to show where CI time goes).
ENGINE_START_SECONDS: collections.Counter = collections.Counter()
ENGINE_START_COUNTS: collections.Counter = collections.Counter()


@contextlib.contextmanager
def timed_start(kind: str, count: bool = True):
    """Adds the start's seconds to the current test file's row; `count`: count it in `ENGINE_STARTS` too
    (`vllm serve` is counted where its process starts, tests/conftest.py)."""
    import time

    if count:
        ENGINE_STARTS[kind] += 1
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::", 1)[0]
    t0 = time.monotonic()
    try:
        yield
    finally:
        ENGINE_START_SECONDS[f"{test} {kind}"] += time.monotonic() - t0
        ENGINE_START_COUNTS[f"{test} {kind}"] += 1
# Against a reference that rounds its K/V as the engine's caches do (`reference.layers.Fp8KVCache`), what is
# left is float32 summation order, and now and then an element that lands on the other side of a rounding
# boundary (measured: up to 5e-3).
FP8_EXACT_ATOL = 0.02


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, float]]  # per generated position: token id -> logprob (top-k and the chosen one)


# Eager single-process engines run their engine core inside the test process (vLLM's
# VLLM_ENABLE_V1_MULTIPROCESSING=0, the same engine core and worker without the extra process): a start
# then costs ~6 s instead of ~21 s, and a shutdown 1 s instead of 5. One at a time: an in-process engine core's
# shutdown tears down the process's distributed state (vllm/v1/engine/core.py, cleanup_dist_env_and_memory),
# which another in-process engine would still use. Compiled engines keep a process of their own, so that each
# compiles in a fresh torch.compile state; TP / PP engines have worker processes anyway.
# HYSPARSE_TEST_ENGINE_PROCESS=1 puts every engine core in its own process.
IN_PROCESS_ENGINES: "weakref.WeakSet" = weakref.WeakSet()  # the in-process engine alive (at most one)


class EnginePool:
    """Engines shared by the test files of one pytest process, keyed by (checkpoint, engine arguments)
    (`tests/conftest.py`'s `shared_engine` asks for them).

    It holds one engine at a time, the in-process one: asking for another key, or a `make_llm` that would run
    in process, shuts the held engine down first. So test files that ask for the same key one after another on
    a worker (`tests/conftest.py` XDIST_FILE_GROUPS keeps them on one) share one start. Each hit begins with an
    empty prefix cache, so that no file sees another's cached blocks. `shutdown` leaves a pooled engine alone;
    the pool's owner releases it at the end of the session.
    """

    def __init__(self):
        self.key, self.llm = None, None
        self.hits = 0

    def get(self, key: tuple, model_dir, **kwargs):
        if self.llm is not None and self.key == key:
            self.hits += 1
            self.llm.reset_prefix_cache()
            return self.llm
        self.release()
        self.llm = make_llm(model_dir, **kwargs)
        self.key = key
        return self.llm

    def release(self) -> None:
        llm, self.llm, self.key = self.llm, None, None
        if llm is not None:
            _shutdown(llm)


POOL = EnginePool()


def _wants_in_process(args: dict) -> bool:
    """Whether an engine with these arguments runs in process when the slot is free."""
    return (os.environ.get("HYSPARSE_TEST_ENGINE_PROCESS", "0") in ("", "0") and bool(args.get("enforce_eager"))
            and args.get("tensor_parallel_size", 1) == 1 and args.get("pipeline_parallel_size", 1) == 1)


def _in_process(args: dict) -> bool:
    return _wants_in_process(args) and not IN_PROCESS_ENGINES


def make_llm(model_dir, own_process: bool = False, inductor: bool = True, **kwargs):
    """`LLM(model_dir, float32, ...)`; `own_process`: keep the engine core in a process of its own.

    `inductor=False` (a compiled engine): dynamo still traces the model into vLLM's graph, with guards dropped as
    always on CPU, but the graph runs as traced instead of through inductor (vLLM's VLLM_CPU_CI_ENV,
    vllm/platforms/cpu.py): a cold start 66 s instead of 100. The tests about inductor's code keep it.

    An in-process engine core steps only inside `generate`, so the worker learns that the last requests
    finished at the next call (`tests.pic_utils.state` makes that call before it reads the PIC pins).
    """
    import vllm.envs
    from vllm import LLM

    args = dict(model=str(model_dir), dtype="float32", max_model_len=1024, seed=0)
    args.update(kwargs)
    if (args.get("tensor_parallel_size", 1) == 1 and args.get("pipeline_parallel_size", 1) == 1
            and "distributed_executor_backend" not in args):
        # One rank: the worker runs inside the engine core (vLLM's UniProcExecutor), not in a process of its own,
        # which halves the processes an own-process engine spawns (measured: a start 24 s instead of 48-62 s).
        # Given as the class, because vllm/platforms/cpu.py turns the string "uni" into "mp" when the engine core
        # has a process of its own.
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        args["distributed_executor_backend"] = UniProcExecutor
    if POOL.llm is not None and not own_process and _wants_in_process(args):
        POOL.release()  # the pool's engine holds the one in-process slot, which this engine wants
    if own_process or not _in_process(args):
        with pytest.MonkeyPatch.context() as mp, timed_start("offline"):
            if not inductor and not args.get("enforce_eager"):
                mp.setenv("VLLM_CPU_CI_ENV", "1")  # read in the engine core's process, which inherits it
            return LLM(**args)
    try:
        with pytest.MonkeyPatch.context() as mp, timed_start("offline in-process"):
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            llm = LLM(**args)
    finally:
        # An engine core caches vLLM's environment once it is up (vllm/v1/engine/core.py, enable_envs_cache);
        # in this process that would freeze it for every later test.
        vllm.envs.disable_envs_cache()
    IN_PROCESS_ENGINES.add(llm)
    return llm


def vllm_greedy(llm, prompts: list[list[int]], max_tokens: int, lora_request=None) -> list[Completion]:
    """`lora_request`: a `LoRARequest` for every prompt, or a list with one (or None) per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                        lora_request=lora_request)
    return [Completion(list(o.outputs[0].token_ids),
                       [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def reference_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
    """Greedy continuation by the reference model, step by step with its KV cache."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        tokens, logprobs, cache = [], [], None
        with torch.no_grad():
            for _ in range(max_tokens):
                res = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = res.past_key_values
                lp = torch.log_softmax(res.logits[0, -1].double(), dim=-1)
                top = torch.topk(lp, TOP_LOGPROBS)
                token = int(top.indices[0])
                tokens.append(token)
                logprobs.append({int(i): float(v) for i, v in zip(top.indices, top.values)})
                ids = torch.tensor([[token]])
        out.append(Completion(tokens, logprobs))
    return out


def check_logprobs_close(ref: list[Completion], test: list[Completion], atol: float = 2e-3,
                         min_matched: float = 0.8) -> int:
    """vLLM's convention: identical greedy tokens until a near-tie, where each side's token
    must be in the other's top-k; matched positions must also agree on the logprob.

    A near-tie ends the comparison of that prompt, so the positions compared
    before any divergence are counted: at least `min_matched` of all generated
    positions must match, or a comparison that diverged at token 0 would pass
    without checking anything. Returns the number of matched positions.
    """
    matched = total = 0
    for n, (a, b) in enumerate(zip(ref, test, strict=True)):
        total += len(a.token_ids)
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta != tb:
                assert ta in b.logprobs[i] and tb in a.logprobs[i], (
                    f"prompt {n}, token {i}: reference {ta} vs vLLM {tb}, not a near-tie "
                    f"(ref top {a.logprobs[i]}, vLLM top {b.logprobs[i]})")
                break
            assert abs(a.logprobs[i][ta] - b.logprobs[i][tb]) < atol, (
                f"prompt {n}, token {i}: logprob {a.logprobs[i][ta]:.5f} (reference) "
                f"vs {b.logprobs[i][tb]:.5f} (vLLM)")
            matched += 1
    assert matched >= min_matched * total, (
        f"only {matched} of {total} generated positions matched before a divergence (need {min_matched:.0%})")
    return matched


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the special tokens at the start of the vocabulary.
    return [torch.randint(16, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@contextlib.contextmanager
def env_without(*names: str):
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def kv_cache_layout(worker) -> dict:
    """Runs inside the worker: the KV cache groups, KV-sharing map and pool size vLLM allocated."""
    runner = worker.model_runner
    config = runner.kv_cache_config
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({"type": type(spec).__name__, "layers": list(group.layer_names),
                       "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes,
                       "sliding_window": getattr(spec, "sliding_window", None)})
    return {"num_blocks": config.num_blocks, "groups": groups, "shared": dict(runner.shared_kv_cache_layers),
            "tensor_bytes": sorted({t.size for t in config.kv_cache_tensors})}


def shutdown(llm) -> None:
    """Shut an engine down, unless it is the pool's (`EnginePool`): that one stays for the next test file."""
    if llm is not POOL.llm:
        _shutdown(llm)


def _shutdown(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    if llm in IN_PROCESS_ENGINES:
        # vLLM's in-process shutdown has undone its gc.freeze() and the distributed state; free the engine now.
        IN_PROCESS_ENGINES.discard(llm)
        import gc

        gc.collect()


# The offline API in one process for all weight cases: each engine start then costs seconds, not a
# minute (in-process engine core, worker in the engine core; the same load path as the server's).
OFFLINE = """
import contextlib, json, sys
from vllm import LLM
from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
errors = {}
for path in sys.argv[2:]:
    try:
        LLM(path, dtype="float32", max_model_len=512, enforce_eager=True, distributed_executor_backend="uni")
        errors[path] = None
    except Exception as e:
        errors[path] = f"{type(e).__name__}: {e}"
    with contextlib.suppress(Exception):
        destroy_model_parallel()
        destroy_distributed_environment()
open(sys.argv[1], "w").write(json.dumps(errors))
"""


def offline_load_errors(paths: list, work, timeout_s: float) -> dict[str, str | None]:
    """`LLM(path)` for every path in one fresh process: {str(path): None, or the exception as one string}."""
    import json
    import subprocess
    import sys

    result = work / "errors.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with timed_start("load-check"):
        run = subprocess.run([sys.executable, "-c", OFFLINE, str(result), *map(str, paths)],
                             capture_output=True, text=True, timeout=timeout_s, env=env)
    assert result.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(result.read_text())


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every mapping visible: peaked attention, non-unit norms, non-zero biases."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                # q.k / sqrt(D) with a std of about 3: attention far from uniform.
                p.copy_(noise * (3.0 / hidden) ** 0.5)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)

# ---------------------------------------------------------------- FP8 KV cache (tests/models, tests/pic)

FP8_SKIP_REASON = "vLLM's CPU build stores an FP8 KV cache only with AVX-512 or AMX"


def fp8_supported_here() -> bool:
    """vLLM's CPU attention stores FP8 only on x86 with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py)."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def fp8_engine(ckpt):
    """Body of a module's FP8-KV engine fixture: the engine, shut down after; a skip where vLLM cannot store FP8."""
    if not fp8_supported_here():
        pytest.skip("[hardware] " + FP8_SKIP_REASON)
    engine = make_llm(ckpt, enforce_eager=True, block_size=32, max_num_batched_tokens=64, max_num_seqs=8,
                      kv_cache_dtype="fp8")
    yield engine
    shutdown(engine)


def truncating_fp8_layers(llm) -> set[int]:
    """Decoder layers whose KV cache vLLM's own CPU backend (`CPU_ATTN`) writes: its FP8 write rounds toward
    zero (`Fp8KVCache(toward_zero=...)`); our backend's rounds to nearest."""
    return set(llm.collective_rpc(_cpu_attn_layers)[0])


def _cpu_attn_layers(worker) -> list[int]:
    import re

    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return sorted({int(re.search(r"layers\.(\d+)\.", name).group(1)) for name, layer in ctx.items()
                   if getattr(layer, "attn_backend", None) is not None and layer.attn_backend.get_name() == "CPU_ATTN"})


def reference_along(model, prompt: list[int], tokens: list[int], cache=None) -> list[torch.Tensor]:
    """The reference's full next-token logprobs `[vocab]` (float64) at each position of `tokens`, fed the prompt
    and then `tokens` themselves (another engine's continuation), step by step through `cache` (a fresh
    `Fp8KVCache()` for an FP8 engine), so that a near-tie the engine resolved the other way does not end the
    comparison."""
    ids, lps = torch.tensor([prompt]), []
    with torch.no_grad():
        for token in tokens:
            res = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = res.past_key_values
            lps.append(torch.log_softmax(res.logits[0, -1].double(), dim=-1))
            ids = torch.tensor([[token]])
    return lps


def check_along(ref_lps: list[list[torch.Tensor]], got: list, atol: float, tie: float) -> tuple[int, int]:
    """Every generated position, against the reference fed the engine's own tokens (`reference_along`): the
    engine's token is the reference's best or within `tie` of it, and its logprob within `atol` of the
    reference's. Returns (positions where the tokens agree, near-ties resolved the other way)."""
    agree = ties = 0
    worst_gap = worst_diff = 0.0
    for n, (lps, test) in enumerate(zip(ref_lps, got, strict=True)):
        assert len(lps) == len(test.token_ids), f"prompt {n}: {len(test.token_ids)} tokens, {len(lps)} references"
        for i, (lp, tb) in enumerate(zip(lps, test.token_ids)):
            ta = int(lp.argmax())
            gap = float(lp[ta] - lp[tb])
            assert gap <= tie, f"prompt {n}, token {i}: the engine's {tb} is {gap:.4f} below the reference's best {ta}"
            diff = abs(float(lp[tb]) - test.logprobs[i][tb])
            assert diff <= atol, f"prompt {n}, token {i}: logprobs differ by {diff:.4f}"
            agree, ties = agree + (ta == tb), ties + (ta != tb)
            worst_gap, worst_diff = max(worst_gap, gap), max(worst_diff, diff)
    print(f"every position checked: {agree} agree, {ties} near-ties resolved the other way "
          f"(largest gap {worst_gap:.2e}, largest logprob difference {worst_diff:.2e})")
    return agree, ties
