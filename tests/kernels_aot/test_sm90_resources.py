# SPDX-License-Identifier: Apache-2.0
"""Every `csrc_triton` kernel, at the launch configs its launcher picks, builds for sm_90 without spills.

Shapes: the GQA group size and selection sizes of each preset of the model
that uses the kernel (`vllm_hysparse.tools.presets`), head dims 64 / 128 /
256 and the papers' q/k 192 with v 128 (SPEC §2.6), 16-slot pages, bf16 and
fp16, and bf16 queries over an FP8 (e4m3) KV cache (`kv_cache_dtype="fp8"`). Each launcher runs on `meta` tensors and
its launches are built ahead of time (`sm90.py`), all at once in worker
processes; a case fails on any spilled byte or on more shared memory than sm_90
gives a block. The resource table is printed at the end of the run.

    .venv/bin/python -m pytest tests/kernels_aot -q   # its own process: no TRITON_INTERPRET
"""

import dataclasses
import functools
from dataclasses import dataclass

import pytest
import torch

from tests.kernels_aot.sm90 import (RESULTS, SM90_MAX_SHARED, Build, build_pool, record_launches, skip_reason,
                                    start_builds)
from vllm_hysparse.tools.presets import PRESETS

_SKIP = skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=f"sm_90 AOT builds unavailable: {_SKIP}")

PAGE_SIZE = 16
# (q/k head dim, v head dim)
HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# two KV groups per program grid; G only sizes the grid, never a compiled constant
NUM_KV_HEADS = 2
# Prefill: 2 requests, 300 query rows, up to 4K keys. Decode: one-token requests over up to 64K keys;
# 4 of them take the launchers' most KV splits (16), 200 fill the GPU and take 1 split, the two ends of
# the split-KV range. Counts are neither 1 nor multiples of 16, so the JIT would not specialise on them.
PREFILL = {"num_reqs": 2, "num_tokens": 300, "max_keys": 4096}
DECODE = {"num_reqs": 4, "num_tokens": 4, "max_keys": 65536}
DECODE_BATCH = {"num_reqs": 200, "num_tokens": 200, "max_keys": 65536}


@dataclass(frozen=True)
class Shape:
    """A preset's attention shape at one head dim and dtype."""

    preset: str  # "<model>/<preset>"
    heads_per_group: int
    head_dim: int
    dtype: str
    head_dim_v: int = 0  # 0: head_dim
    block_size: int = 0  # HySparse: sparse_block_size, sparse_topk_blocks
    topk_blocks: int = 0
    topk_tokens: int = 0  # HySparse2: sparse_topk_tokens, recent_window
    window: int = 0
    kv: str = ""  # "fp8": an e4m3 KV cache; "": the cache in q's dtype

    def __str__(self):
        dv = f"v{self.head_dim_v}" if self.head_dim_v not in (0, self.head_dim) else ""
        kv = f"-{self.kv}kv" if self.kv else ""
        return f"{self.preset.replace('/', '-')}-hpg{self.heads_per_group}-d{self.head_dim}{dv}-{self.dtype}{kv}"


def preset_shapes(model: str, dtypes=tuple(DTYPES)) -> list[Shape]:
    """Every preset of `model` at every head dim and dtype (presets give group and selection sizes).

    Presets with the same attention shape (e.g. `tiny_moe` and `tiny`: only the MLP differs) build once.
    """
    shapes, seen = [], set()
    for name, cfg in PRESETS[model].items():
        hpg = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
        for d, dv in HEAD_DIMS:
            for dt in dtypes:
                shape = Shape(f"{model}/{name}", hpg, d, dt, head_dim_v=dv,
                              block_size=cfg.get("sparse_block_size", 0),
                              topk_blocks=cfg.get("sparse_topk_blocks", 0),
                              topk_tokens=cfg.get("sparse_topk_tokens", 0),
                              window=cfg.get("recent_window", 0))
                key = dataclasses.replace(shape, preset="")
                if key not in seen:
                    seen.add(key)
                    shapes.append(shape)
    return shapes


def paged_batch(shape: Shape, num_reqs: int, num_tokens: int, max_keys: int):
    """Meta tensors of a vLLM paged batch: (q, k_cache, v_cache, block_table, query_start_loc, seq_lens).

    q `[T, H, D]`; k `[pages, G, PAGE_SIZE, D]` and v `[pages, G, PAGE_SIZE, Dv]` views of one
    `[pages, G, PAGE_SIZE, D + Dv]` tensor (vLLM's layout); block_table `[R, max_keys / PAGE_SIZE]`.
    """
    meta = {"device": "meta"}
    dtype = DTYPES[shape.dtype]
    d, h, g = shape.head_dim, shape.heads_per_group * NUM_KV_HEADS, NUM_KV_HEADS
    dv = shape.head_dim_v or d
    max_pages = max_keys // PAGE_SIZE
    q = torch.empty(num_tokens, h, d, dtype=dtype, **meta)
    kv_dtype = torch.float8_e4m3fn if shape.kv == "fp8" else dtype
    kv = torch.empty(num_reqs * max_pages, g, PAGE_SIZE, d + dv, dtype=kv_dtype, **meta)
    block_table = torch.empty(num_reqs, max_pages, dtype=torch.int32, **meta)
    query_start_loc = torch.empty(num_reqs + 1, dtype=torch.int32, **meta)
    seq_lens = torch.empty(num_reqs, dtype=torch.int32, **meta)
    return q, kv[..., :d], kv[..., d:], block_table, query_start_loc, seq_lens


def oracle(shape: Shape, batch: dict):
    """HySparse full layer: `oracle_attention` (prefill kernel, or both split-KV decode kernels)."""
    import csrc_triton.oracle.decode as decode
    import csrc_triton.oracle.kernel as kernel

    with record_launches(kernel, decode) as launches:
        kernel.oracle_attention(*paged_batch(shape, **batch), scale=0.1, sparse_block_size=shape.block_size,
                                topk=shape.topk_blocks)
    return launches


def gate_of(q, v_cache, gated: bool, accumulate: bool) -> dict:
    """The keywords of a gated store: a HySparse sparse layer's branch as served, `[T, H, Dv]` gates in q's dtype
    (a view of the op's buffer); none otherwise."""
    if not gated:
        return {}
    gate = torch.empty(*q.shape[:2], v_cache.shape[3], dtype=q.dtype, device="meta")
    return {"gate": gate, "accumulate": accumulate}


def block_sparse(shape: Shape, batch: dict, gated: bool = False):
    """HySparse sparse layer: `block_sparse_attention` with sinks; `gated`: its rows added through the gate."""
    import csrc_triton.block_sparse.kernel as kernel

    args = paged_batch(shape, **batch)
    q, k_cache = args[0], args[1]
    ids = torch.empty(q.shape[0], k_cache.shape[1], shape.topk_blocks, dtype=torch.int32, device="meta")
    sinks = torch.empty(q.shape[1], dtype=torch.float32, device="meta")
    with record_launches(kernel) as launches:
        kernel.block_sparse_attention(*args, ids, scale=0.1, sparse_block_size=shape.block_size, sinks=sinks,
                                      **gate_of(q, args[2], gated, accumulate=True))
    return launches


def token_oracle(shape: Shape, batch: dict):
    """HySparse2 cross full layer: `token_oracle_attention` (stats and score kernels)."""
    import csrc_triton.token_oracle.kernel as kernel

    with record_launches(kernel) as launches:
        kernel.token_oracle_attention(*paged_batch(shape, **batch), scale=0.1, topk_tokens=shape.topk_tokens,
                                      recent_window=shape.window)
    return launches


def token_sparse(shape: Shape, batch: dict, gated: bool = False):
    """HySparse2 cross sparse layer: `token_sparse_attention` over top-k + window positions, with sinks;
    `gated`: HySparse's window branch (the `window` role) storing its rows through the gate (the global branch
    adds its own after it)."""
    import csrc_triton.token_sparse.kernel as kernel

    args = paged_batch(shape, **batch)
    q, k_cache = args[0], args[1]
    ids = torch.empty(q.shape[0], k_cache.shape[1], max(1, shape.topk_tokens + shape.window), dtype=torch.int32,
                      device="meta")
    sinks = torch.empty(q.shape[1], dtype=torch.float32, device="meta")
    with record_launches(kernel) as launches:
        kernel.token_sparse_attention(*args, ids, scale=0.1, sinks=sinks,
                                      **gate_of(q, args[2], gated, accumulate=False))
    return launches


# kind: (launcher, batch, model whose presets size it, dtypes). Block- and token-sparse configs do not
# depend on the batch, so they build once. fp16 has built exactly as bf16 (same registers and shared
# memory) in every case, so the 1-split decode batches, whose kernels differ from the 16-split ones in
# NUM_SPLITS only, build in bf16 alone to keep the run short.
KINDS = {
    "oracle-prefill": (oracle, PREFILL, "hysparse", ("bf16", "fp16")),
    "oracle-decode": (oracle, DECODE, "hysparse", ("bf16", "fp16")),
    "oracle-decode_batch": (oracle, DECODE_BATCH, "hysparse", ("bf16",)),
    "block_sparse": (block_sparse, PREFILL, "hysparse", ("bf16", "fp16")),
    "token_oracle-prefill": (token_oracle, PREFILL, "hysparse2", ("bf16", "fp16")),
    "token_oracle-decode": (token_oracle, DECODE, "hysparse2", ("bf16", "fp16")),
    "token_oracle-decode_batch": (token_oracle, DECODE_BATCH, "hysparse2", ("bf16",)),
    "token_sparse": (token_sparse, PREFILL, "hysparse2", ("bf16", "fp16")),
    # a HySparse sparse layer's two branches as served on a GPU: the gates in the kernels' stores
    "block_sparse-gated": (functools.partial(block_sparse, gated=True), PREFILL, "hysparse", ("bf16",)),
    "window-gated": (functools.partial(token_sparse, gated=True), PREFILL, "hysparse", ("bf16",)),
}
# fp16 cases are in the benchmark tier (`-m bench`, `bash scripts/test.sh --bench`): they have built as bf16 in
# every run, and leaving them out takes 72 of 240 builds off CI's CPU.
CASES = [pytest.param(kind, shape, id=f"{kind}-{shape}",
                      marks=[pytest.mark.bench] if shape.dtype == "fp16" else [])
         for kind, (_, _, model, dtypes) in KINDS.items() for shape in preset_shapes(model, dtypes)]
# An FP8 KV cache changes only the K/V loads (e4m3, widened to bf16): every kernel family at bf16, prefill and
# the 16-split decode. CI builds them at the paper presets (the most heads per KV group, hence the most
# registers); the smaller presets' FP8 builds (64 of them) are in the benchmark tier.
FP8_KINDS = ("oracle-prefill", "oracle-decode", "block_sparse", "token_oracle-prefill", "token_oracle-decode",
             "token_sparse")
CASES += [pytest.param(kind, shape, id=f"{kind}-{shape}",
                       marks=[] if shape.preset.endswith("/paper") else [pytest.mark.bench])
          for kind in FP8_KINDS
          for shape in (dataclasses.replace(s, kv="fp8") for s in preset_shapes(KINDS[kind][2], ("bf16",)))]

_CONFIG_KEYS = ("BLOCK_Q", "BLOCK_M", "BLOCK_H", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "NUM_SPLITS")


def describe(kwargs: dict) -> str:
    """The launch config in brief, e.g. `Q8 H16 N64 D128 w8` (block sizes, S: KV splits, w: warps)."""
    parts = [f"{k.removeprefix('BLOCK_').replace('NUM_SPLITS', 'S')}{kwargs[k]}" for k in _CONFIG_KEYS
             if k in kwargs]
    return " ".join(parts + [f"w{kwargs.get('num_warps', 4)}"])


def launch_case(kind: str, shape: Shape):
    """The launches the kind's launcher makes at this shape."""
    launcher, batch, _, _ = KINDS[kind]
    return launcher(shape, batch)


@pytest.fixture(scope="module")
def builds(request):
    """Build -> future Usage for every launch of the selected cases, all started at once in worker processes."""
    cases = [(item.callspec.params["kind"], item.callspec.params["shape"]) for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")]
    pool = build_pool()
    try:
        yield start_builds([Build.of(launch) for case in cases for launch in launch_case(*case)], pool)
    finally:
        # after a failure with -x, drop the builds not started yet
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("kind, shape", CASES)
def test_sm90_no_spills(kind, shape, builds):
    """Every kernel the launcher launches at this shape: no spilled byte, shared memory within sm_90's limit."""
    launches = launch_case(kind, shape)
    assert launches, f"{kind}: the launcher launched no kernel"
    problems = []
    for launch in launches:
        usage = builds[Build.of(launch)].result()
        row = {"kind": kind, "shape": str(shape), "kernel": launch.fn.__name__, "config": describe(launch.kwargs),
               **vars(usage)}
        RESULTS.append(row)
        what = (f"{row['kernel']} [{row['config']}]: {usage.regs} regs, {usage.spill_stores} B spill stores, "
                f"{usage.spill_loads} B spill loads, {usage.shared} B shared")
        if usage.spill_stores or usage.spill_loads:
            problems.append(f"spills: {what}")
        if usage.shared > SM90_MAX_SHARED:
            problems.append(f"shared memory over sm_90's {SM90_MAX_SHARED} B: {what}")
    assert not problems, "\n".join(problems)
