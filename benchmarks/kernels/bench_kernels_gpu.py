# SPDX-License-Identifier: Apache-2.0
"""GPU benchmark of the `csrc_triton` kernels: correctness at realistic shapes, then timings against torch.

Run from the repository root. Nothing here imports vLLM or `vllm_hysparse`:

    PYTHONPATH=. python benchmarks/kernels/bench_kernels_gpu.py --out-dir "$OUT"     # H200, about 3-6 minutes
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/kernels/bench_kernels_gpu.py --smoke   # CPU, tiny shapes

1. Correctness against the PyTorch twins (`*_naive`): GQA 32/8 head dim 128 in bf16 and fp16, token-sparse
   also MQA 64/1 head dim 256. Oracle indices are compared as sets and through the reference scores (near
   ties may swap). One PASS/FAIL line per check; a failure does not stop the run.
2. Timings (CUDA events, L2 flushed before every rep, median): copy bandwidth and a bf16 matmul as ceilings;
   oracle prefill vs SDPA FLASH / cuDNN / naive gather + FLASH (TFLOP/s, causal FLOPs 2*T^2*H*D); oracle decode,
   block-sparse and token-sparse decode vs dense SDPA decode and naive gather + SDPA (TB/s of the KV bytes each
   must read, share of the copy bandwidth, pages per query).
3. A Markdown table of the targets (MET / MISSED) and one JSON with everything, both written after every
   section, so a run cut short still leaves its numbers.

`--budget-s` skips the remaining sections once the elapsed time passes it.
"""

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # imported late at run time (`build_paged`, `kernels()`)
    from csrc_triton.testing import PagedBatch

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
# the budget counts from here (after the torch import)
T_START = time.monotonic()
L2_FLUSH_BYTES = 256 << 20
# output tolerances against the float32 twins (the kernel tests use the same)
OUT_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
# a selected block is right when its reference score equals the reference pick's within this share of the row max
SCORE_RTOL = 1e-3
NOTE_NO_SWITCH = ("the oracle kernel has no switch to turn emission off (top-k is always computed); "
                  "the proxy is SDPA FLASH on the same shape")
NOTE_SWA = "the block-sparse kernel is the global branch only; the window-128 SWA branch is a separate call, not timed"


@dataclass(frozen=True)
class Config:
    """Shapes of one run. The defaults are the issue's; `smoke()` shrinks them for the CPU interpreter."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    block_size: int = 64
    topk: int = 16
    window: int = 128
    token_topk: int = 1024
    prefill_lens: tuple = (4096, 16384, 32768)
    emission_len: int = 16384
    decode_batch: int = 64
    decode_ctx: int = 32768
    sparse_ctxs: tuple = (32768, 131072)
    mqa: tuple = (64, 1, 256)  # heads, KV heads, head dim
    mqa_batch: int = 16
    mqa_ctx: int = 131072
    copy_bytes: int = 1 << 30
    matmul_n: int = 8192
    # correctness batches: (q_lens, seq_lens); None seq_lens means random lengths up to decode_ctx
    check_prefill: tuple = ((4096,), (6144,))
    check_mixed: tuple = ((1000, 1, 1, 1, 517), (3000, 20000, 777, 32768, 517))
    check_decode_batch: int = 64
    check_split: tuple = ((1, 1, 1, 1), (32768, 20000, 1000, 65))
    check_sparse: tuple = ((256,) + (1,) * 31, (4096,) + (None,) * 31)
    check_mqa: tuple = ((64,) + (1,) * 7, (2048,) + (None,) * 7)


def smoke_config() -> Config:
    return Config(
        num_heads=8, num_kv_heads=2, head_dim=32, topk=4, window=32, token_topk=96,
        prefill_lens=(128, 256), emission_len=128, decode_batch=4, decode_ctx=512, sparse_ctxs=(512, 1024),
        mqa=(8, 1, 256), mqa_batch=2, mqa_ctx=512, copy_bytes=16 << 20, matmul_n=256,
        check_prefill=((96,), (160,)), check_mixed=((40, 1, 1, 17), (100, 300, 77, 17)), check_decode_batch=4,
        check_split=((1, 1), (500, 65)), check_sparse=((16, 1, 1, 1), (200, None, None, 3)),
        check_mqa=((8, 1, 1), (100, None, 5)),
    )


# ---------------------------------------------------------------- environment

def kernels():
    """The Triton launchers and the twins, imported late: TRITON_INTERPRET must be set before `@triton.jit` runs."""
    from csrc_triton.block_sparse import block_sparse_attention, block_sparse_attention_naive
    from csrc_triton.oracle import oracle_attention, oracle_attention_naive
    from csrc_triton.token_sparse import token_sparse_attention, token_sparse_attention_naive

    return {
        "oracle": oracle_attention, "oracle_naive": oracle_attention_naive,
        "block": block_sparse_attention, "block_naive": block_sparse_attention_naive,
        "token": token_sparse_attention, "token_naive": token_sparse_attention_naive,
    }


def run_quiet(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def command_line() -> str:
    """The command as typed (`python -m ...` included) where /proc has it, else sys.argv."""
    try:
        argv = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        return shlex.join(a.decode() for a in argv)
    except OSError:
        return shlex.join([sys.executable] + sys.argv)


def environment(device: torch.device) -> dict:
    import triton

    env = {
        "command": command_line(),
        "cwd": os.getcwd(),
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_runtime": torch.version.cuda,
        "git_commit": run_quiet(["git", "rev-parse", "HEAD"]),
        "git_dirty": bool(run_quiet(["git", "status", "--porcelain", "csrc_triton"])),
        "device": str(device),
        "host": platform.node(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
            gpu_mem_gib=round(props.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
            driver=run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        )
    else:
        env.update(gpu=None, driver=None, cpu=platform.processor() or platform.machine(),
                   threads=torch.get_num_threads())
    return env


# ---------------------------------------------------------------- paged batches (`csrc_triton.testing.PagedBatch`)

def resolve_lens(seq_lens, max_len: int, q_lens, seed: int) -> list[int]:
    """None entries become random lengths in [q_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(q, max_len + 1, (1,), generator=g)) if s is None else s for q, s in zip(q_lens, seq_lens)]


def build_paged(q_lens, seq_lens, *, num_kv_heads, head_dim, page_size, dtype, device, seed=0) -> "PagedBatch":
    """`csrc_triton.testing.make_paged_batch` drawn over the whole cache on `device` (one spare NaN page, no dense
    copy); it seeds the global RNG with `seed`, for the queries and indices drawn after it. Imported late, as
    `kernels()` does, so a missing PYTHONPATH gets `main`'s message."""
    from csrc_triton.testing import make_paged_batch

    return make_paged_batch(q_lens, seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                            dtype=dtype, seed=seed, device=device, spare_pages=1, draw="whole_cache", dense=False)


def random_block_indices(pos, num_kv_heads, topk, block_size) -> torch.Tensor:
    """[T, G, topk] int32: distinct random blocks at or before each row's position, ascending, -1 padded."""
    visible = pos // block_size + 1
    nb = int(visible.max())
    r = torch.rand(len(pos), num_kv_heads, nb, device=pos.device)
    r = r.masked_fill(torch.arange(nb, device=pos.device) >= visible[:, None, None], -1.0)
    val, idx = r.topk(min(topk, nb), dim=-1)
    return pad_sorted(idx.masked_fill(val < 0, -1), topk)


def random_token_indices(pos, num_kv_heads, topk, window) -> torch.Tensor:
    """[T, G, topk + window] int32: the last `window` positions plus `topk` random earlier ones, ascending."""
    dev = pos.device
    win = (pos[:, None] - window + 1 + torch.arange(window, device=dev))[:, None, :].expand(-1, num_kv_heads, -1)
    n_early = (pos + 1 - window).clamp_min(0)
    m = int(n_early.max())
    parts = [win]
    if m > 0:
        r = torch.rand(len(pos), num_kv_heads, m, device=dev)
        r = r.masked_fill(torch.arange(m, device=dev) >= n_early[:, None, None], -1.0)
        val, idx = r.topk(min(topk, m), dim=-1)
        parts.insert(0, idx.masked_fill(val < 0, -1))
    ids = torch.cat(parts, dim=-1)
    return pad_sorted(ids.masked_fill(ids < 0, -1), topk + window)


def pad_sorted(ids, width) -> torch.Tensor:
    """Ascending ids with the -1 entries moved to the end, padded with -1 to `width`."""
    big = torch.iinfo(torch.int64).max
    ids = ids.long().masked_fill(ids < 0, big).sort(dim=-1).values
    ids = ids.masked_fill(ids == big, -1)
    return F.pad(ids, (0, width - ids.shape[-1]), value=-1).to(torch.int32)


def block_positions(block_indices, pos, block_size) -> torch.Tensor:
    """[T, G, K * block] key positions the block-sparse kernel reads; -1 where it reads nothing."""
    b = block_indices.long()
    p = (b[..., None] * block_size + torch.arange(block_size, device=b.device)).flatten(2)
    valid = (b >= 0).repeat_interleave(block_size, dim=2) & (p <= pos[:, None, None])
    return p.masked_fill(~valid, -1)


def token_positions(token_indices, pos) -> torch.Tensor:
    p = token_indices.long()
    return p.masked_fill((p < 0) | (p > pos[:, None, None]), -1)


def pages_per_query(block_table, req, positions, page_size) -> torch.Tensor:
    """[T, G] float: distinct physical pages behind each row's key positions (-1 entries ignored)."""
    valid = positions >= 0
    pages = block_table.long()[req[:, None, None], positions.clamp_min(0) // page_size].masked_fill(~valid, -1)
    s = pages.sort(dim=-1).values
    new = (s[..., 1:] != s[..., :-1]) & (s[..., 1:] >= 0)
    return (new.sum(-1) + (s[..., 0] >= 0)).float()


# ---------------------------------------------------------------- torch baselines

def sdpa_backends(device) -> dict:
    """label -> SDPBackend. On CPU (smoke) MATH stands in for both, so that the logic runs."""
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return {"flash": SDPBackend.MATH, "cudnn": SDPBackend.MATH}


def gather_decode(q, k_cache, v_cache, block_table, req, positions, backend=None):
    """Naive torch decode: gather the rows' keys through the block table, then one SDPA call.

    q `[T, H, D]`, positions `[T, G, S]` (all valid). The group's heads are SDPA's query rows, so each
    KV head is read once (no expansion). Returns `[T, H, D]`.
    """
    page_size = k_cache.shape[2]
    t, h, d = q.shape
    g = k_cache.shape[1]
    pages = block_table.long()[req[:, None, None], positions // page_size]
    groups = torch.arange(g, device=q.device)[None, :, None]
    k = k_cache[pages, groups, positions % page_size]  # [T, G, S, D]
    v = v_cache[pages, groups, positions % page_size]
    out = sdpa_plain(q.view(t, g, h // g, d), k, v, backend)
    return out.reshape(t, h, d)


def sdpa_plain(q, k, v, backend=None):
    from torch.nn.attention import sdpa_kernel

    ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    with ctx:
        return F.scaled_dot_product_attention(q, k, v)


def sdpa_fused(q, k, v, **kw):
    """SDPA restricted to the fused CUDA backends (never MATH, which would expand K/V for GQA); any on CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def gather_dense(cache, block_table, num_keys) -> torch.Tensor:
    """`[R, G, num_keys, D]`: the first num_keys positions of every request, contiguous."""
    page_size = cache.shape[2]
    n = -(-num_keys // page_size)
    x = cache[block_table[:, :n].long()]  # [R, n, G, P, D]
    return x.permute(0, 2, 1, 3, 4).reshape(x.shape[0], x.shape[2], n * page_size, x.shape[4])[:, :, :num_keys]


# ---------------------------------------------------------------- timing

class Timer:
    """Median time of a callable in seconds: CUDA events with an L2 flush before each rep, or perf_counter."""

    def __init__(self, device, warmup_ms: float, rep_ms: float, cpu_reps: int = 2):
        self.device = device
        self.warmup_ms, self.rep_ms, self.cpu_reps = warmup_ms, rep_ms, cpu_reps
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> float:
        if self.device.type != "cuda":
            fn()
            times = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        est = max(start.elapsed_time(end) / 3, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        n = min(1000, max(5, int(self.rep_ms / est)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[n // 2] / 1e3


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- correctness

@dataclass
class Check:
    name: str
    passed: bool
    detail: dict = field(default_factory=dict)
    error: str | None = None

    def line(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        if self.error:
            return f"[{status}] {self.name}: ERROR {self.error}"
        return f"[{status}] {self.name}: " + ", ".join(f"{k} {fmt_num(v)}" for k, v in self.detail.items())


def compare_out(out, ref, tol) -> tuple[bool, dict]:
    finite = bool(torch.isfinite(out).all())
    err = (out.float() - ref.float()).abs()
    ok = finite and bool((err <= tol + tol * ref.float().abs()).all())
    return ok, {"out_max_abs_err": float(err.max()), "out_max_abs_ref": float(ref.float().abs().max()),
                "tol": tol, "finite": finite}


def compare_topk(ids, ref_ids, ref_scores) -> tuple[bool, dict]:
    """Equal selections, or swaps of blocks whose reference scores agree within SCORE_RTOL of the row max."""
    big = 1 << 40
    count_ok = (ids >= 0).sum(-1) == (ref_ids >= 0).sum(-1)
    key = ids.long().masked_fill(ids < 0, big)
    ascending = ((key[..., 1:] > key[..., :-1]) | (key[..., 1:] == big)).all(-1)

    def picked(x):
        return torch.gather(ref_scores, -1, x.long().clamp_min(0)).masked_fill(x < 0, -1.0).sort(-1).values

    diff = (picked(ids) - picked(ref_ids)).abs().amax(-1)
    row_max = ref_scores.amax(-1).clamp_min(1e-30)
    by_score = diff <= SCORE_RTOL * row_max + 1e-7
    good = count_ok & ascending & by_score
    return bool(good.all()), {
        "topk_rows": ids.shape[0] * ids.shape[1],
        "sets_equal_pct": 100 * float((ids == ref_ids).all(-1).float().mean()),
        "equal_by_score_pct": 100 * float(by_score.float().mean()),
        "bad_rows": int((~good).sum()),
        "max_score_diff_rel": float((diff / row_max).max()),
    }


def check_oracle(K, cfg, dtype, device, name, q_lens, seq_lens, seed) -> Check:
    batch = build_paged(q_lens, seq_lens, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                        page_size=cfg.page_size, dtype=dtype, device=device, seed=seed)
    q = torch.randn(batch.num_tokens, cfg.num_heads, cfg.head_dim, device=device).to(dtype)
    kw = dict(scale=cfg.head_dim ** -0.5, sparse_block_size=cfg.block_size, topk=cfg.topk)
    out, ids = K["oracle"](*batch.args(q), out=torch.full_like(q, float("nan")), **kw)
    return oracle_against_naive(K, name, batch, q, kw, out, ids)


def oracle_against_naive(K, name, batch, q, kw, out, ids) -> Check:
    ref_out, ref_ids, ref_scores = K["oracle_naive"](*batch.args(q), return_block_scores=True, **kw)
    ok_out, d_out = compare_out(out, ref_out, OUT_TOL[q.dtype])
    ok_ids, d_ids = compare_topk(ids, ref_ids, ref_scores)
    return Check(name, ok_out and ok_ids, {**d_out, **d_ids})


def sparse_kwargs(cfg, kind, head_dim) -> dict:
    kw = {"scale": head_dim ** -0.5}
    if kind == "block":
        kw["sparse_block_size"] = cfg.block_size
    return kw


def sparse_indices(cfg, kind, pos, num_kv_heads) -> torch.Tensor:
    if kind == "block":
        return random_block_indices(pos, num_kv_heads, cfg.topk, cfg.block_size)
    return random_token_indices(pos, num_kv_heads, cfg.token_topk, cfg.window)


def check_sparse(K, cfg, kind, dtype, device, name, q_lens, seq_lens, seed, heads) -> Check:
    num_heads, num_kv_heads, head_dim = heads
    batch = build_paged(q_lens, seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        page_size=cfg.page_size, dtype=dtype, device=device, seed=seed)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, device=device).to(dtype)
    idx = sparse_indices(cfg, kind, batch.pos, num_kv_heads)
    kw = sparse_kwargs(cfg, kind, head_dim)
    out = K[kind](*batch.args(q), idx, out=torch.full_like(q, float("nan")), **kw)
    return sparse_against_naive(K, kind, name, batch, q, idx, kw, out)


def sparse_against_naive(K, kind, name, batch, q, idx, kw, out) -> Check:
    ref = K[f"{kind}_naive"](*batch.args(q), idx, **kw)
    ok, detail = compare_out(out, ref, OUT_TOL[q.dtype])
    return Check(name, ok, detail)


def correctness_plan(cfg) -> list:
    """(name, callable(K, device, name) -> Check) for every compact check."""
    gqa = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    tag_gqa = f"H{cfg.num_heads}/G{cfg.num_kv_heads} D{cfg.head_dim}"
    h, g, d = cfg.mqa
    tag_mqa = f"MQA H{h}/G{g} D{d}"
    n_dec = cfg.check_decode_batch
    decode_lens = resolve_lens([None] * n_dec, cfg.decode_ctx, [1] * n_dec, seed=7)
    sq, ss = cfg.check_sparse
    ss = resolve_lens(ss, cfg.decode_ctx, sq, seed=11)
    mq, ms = cfg.check_mqa
    ms = resolve_lens(ms, cfg.decode_ctx, mq, seed=13)
    pq, ps = cfg.check_prefill
    plan = []
    for tag, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        plan += [
            (f"oracle prefill chunk q{pq[0]}/ctx{ps[0]} {tag_gqa} {tag}",
             lambda K, dev, n, dt=dt: check_oracle(K, cfg, dt, dev, n, pq, ps, seed=1)),
            (f"oracle decode B{n_dec} ctx<={cfg.decode_ctx} {tag_gqa} {tag}",
             lambda K, dev, n, dt=dt: check_oracle(K, cfg, dt, dev, n, [1] * n_dec, decode_lens, seed=2)),
            (f"block-sparse {cfg.topk}x{cfg.block_size} R{len(sq)} (chunk q{sq[0]} + decodes) {tag_gqa} {tag}",
             lambda K, dev, n, dt=dt: check_sparse(K, cfg, "block", dt, dev, n, sq, ss, 3, gqa)),
            (f"token-sparse {cfg.token_topk}+{cfg.window} R{len(sq)} (chunk q{sq[0]} + decodes) {tag_gqa} {tag}",
             lambda K, dev, n, dt=dt: check_sparse(K, cfg, "token", dt, dev, n, sq, ss, 4, gqa)),
            (f"token-sparse {cfg.token_topk}+{cfg.window} R{len(mq)} (chunk q{mq[0]} + decodes) {tag_mqa} {tag}",
             lambda K, dev, n, dt=dt: check_sparse(K, cfg, "token", dt, dev, n, mq, ms, 5, cfg.mqa)),
        ]
    xq, xs = cfg.check_mixed
    plan.append((f"oracle mixed batch R{len(xq)} q{list(xq)} ctx{list(xs)} {tag_gqa} bf16",
                 lambda K, dev, n: check_oracle(K, cfg, torch.bfloat16, dev, n, xq, xs, seed=6)))
    sq2, ss2 = cfg.check_split
    plan.append((f"oracle split-KV decode B{len(sq2)} ctx{list(ss2)} {tag_gqa} bf16",
                 lambda K, dev, n: check_oracle(K, cfg, torch.bfloat16, dev, n, sq2, ss2, seed=8)))
    return plan


# ---------------------------------------------------------------- the run

class Run:
    """Holds the results, the budget and the timer; writes JSON and Markdown after every section."""

    def __init__(self, cfg: Config, device, args, stem: Path):
        self.cfg, self.device, self.args, self.stem = cfg, device, args, stem
        self.t0 = T_START
        self.timer = Timer(device, args.warmup_ms, args.rep_ms)
        self.dtype = torch.bfloat16
        self.dense = {}  # (B, ctx, H, G, D) -> seconds of the fastest dense SDPA decode
        self.result = {
            "kind": "smoke (CPU, TRITON_INTERPRET=1; numbers are not performance)" if args.smoke else "gpu",
            "meta": environment(device),
            "config": asdict(cfg),
            "timing_method": ("CUDA events, median; 256 MiB L2 flush before every rep; "
                              f"warmup {args.warmup_ms} ms, reps {args.rep_ms} ms (5..1000 reps)")
            if device.type == "cuda" else f"perf_counter median of {self.timer.cpu_reps} reps after one warmup",
            "correctness": [],
            "timings": {},
            "targets": [],
            "sections": {},
            "errors": [],
            "skipped_checks": [],
            "notes": [NOTE_NO_SWITCH, NOTE_SWA,
                      "TB/s counts the K and V bytes a kernel must read (valid selected keys x G x D x 2 x dtype "
                      "size); the copy ceiling counts read + write",
                      "dense decode = the faster of SDPA on contiguous [B, G, ctx, D] K/V with the group's heads as "
                      "query rows (auto backend) and SDPA enable_gqa with q_len 1"],
        }

    # --- bookkeeping
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def section(self, name, fn):
        if self.args.sections and not any(name.startswith(s) for s in self.args.sections):
            return
        if self.elapsed() > self.args.budget_s:
            print(f"[SKIP] section {name}: elapsed {self.elapsed():.0f} s > budget {self.args.budget_s:.0f} s",
                  flush=True)
            self.result["sections"][name] = {"status": "skipped (budget)"}
            return
        print(f"\n=== {name} (elapsed {self.elapsed():.0f} s)", flush=True)
        t = time.monotonic()
        status = "ok"
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            status = f"error: {type(e).__name__}: {e}"[:500]
            self.result["errors"].append({"what": name, "error": status})
        finally:
            free_memory()
        self.result["sections"][name] = {"status": status, "seconds": round(time.monotonic() - t, 1)}
        self.save()

    @contextlib.contextmanager
    def guard(self, what):
        """Records a failure of one measurement and carries on with the next."""
        try:
            yield
        except Exception as e:
            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}"[:500]
            print(f"[ERROR] {what}: {msg}", flush=True)
            self.result["errors"].append({"what": what, "error": msg})
            free_memory()

    def add(self, key, *, name, shape, seconds, flops=None, nbytes=None, pages=None, pages_dense=None, note=""):
        copy = self.copy_tbps()
        tbps = nbytes / seconds / 1e12 if nbytes else None
        row = {
            "name": name, "shape": shape, "ms": seconds * 1e3,
            "tflops": flops / seconds / 1e12 if flops else None,
            "tbps": tbps, "bytes": nbytes,
            "copy_frac": tbps / copy if (tbps and copy and key != "ceiling/copy") else None,
            "pages_per_query": pages, "pages_dense": pages_dense, "note": note,
        }
        self.result["timings"][key] = row
        print(f"[time] {key}: {fmt_row(row)}", flush=True)
        return row

    def check(self, name, fn):
        try:
            c = fn()
        except Exception as e:  # a failing kernel must not stop the run
            traceback.print_exc()
            c = Check(name, False, error=f"{type(e).__name__}: {e}"[:500])
        print(c.line(), flush=True)
        self.result["correctness"].append(asdict(c))
        free_memory()

    def copy_tbps(self):
        return self.result["timings"].get("ceiling/copy", {}).get("tbps")

    def save(self):
        copy = self.copy_tbps()
        for key, row in self.result["timings"].items():
            if row["tbps"] and copy and key != "ceiling/copy":
                row["copy_frac"] = row["tbps"] / copy
                row["floor_ms_at_copy_bw"] = row["bytes"] / (copy * 1e12) * 1e3
        self.result["targets"] = evaluate_targets(self.result, self.cfg)
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        self.result["vllm_imported"] = "vllm" in sys.modules
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        self.stem.with_suffix(".json").write_text(json.dumps(self.result, indent=1, default=str))
        self.stem.with_suffix(".md").write_text(markdown_report(self.result))

    # --- shapes
    def paged(self, q_lens, seq_lens, heads=None, seed=0) -> "PagedBatch":
        h = heads or (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim)
        return build_paged(q_lens, seq_lens, num_kv_heads=h[1], head_dim=h[2], page_size=self.cfg.page_size,
                           dtype=self.dtype, device=self.device, seed=seed)

    def randn(self, *shape):
        return torch.randn(*shape, device=self.device, dtype=self.dtype)

    def kv_bytes(self, num_keys, num_kv_heads, head_dim) -> int:
        return int(num_keys) * num_kv_heads * head_dim * 2 * torch.finfo(self.dtype).bits // 8


def fmt_num(v) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if v == 0 or math.isnan(v) or math.isinf(v):
        return str(v)
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"


def fmt_row(row) -> str:
    parts = [f"{row['ms']:.4g} ms" if row["ms"] >= 0.1 else f"{row['ms'] * 1e3:.4g} us"]
    if row["tflops"] is not None:
        parts.append(f"{row['tflops']:.1f} TFLOP/s")
    if row["tbps"] is not None:
        parts.append(f"{row['tbps']:.2f} TB/s")
    if row["copy_frac"] is not None:
        parts.append(f"{100 * row['copy_frac']:.0f}% of copy")
    if row["pages_per_query"] is not None:
        parts.append(f"{row['pages_per_query']:.1f} pages/query (dense {row['pages_dense']})")
    if row["note"]:
        parts.append(row["note"])
    return ", ".join(parts)


# ---------------------------------------------------------------- sections

def time_ceilings(run: Run, K):
    n = run.cfg.copy_bytes // 2
    src = run.randn(n)
    dst = torch.empty_like(src)
    with run.guard("copy"):
        t = run.timer(lambda: dst.copy_(src))
        run.add("ceiling/copy", name="torch copy (bf16)", shape=f"{run.cfg.copy_bytes / 2**20:.0f} MiB", seconds=t,
                nbytes=2 * run.cfg.copy_bytes, note="read + write")
    del src, dst
    m = run.cfg.matmul_n
    a, b = run.randn(m, m), run.randn(m, m)
    with run.guard("matmul"):
        t = run.timer(lambda: a @ b)
        run.add("ceiling/matmul", name="torch matmul (bf16)", shape=f"{m}^3", seconds=t, flops=2 * m**3)


def time_prefill(run: Run, K, T):
    cfg = run.cfg
    H, G, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    batch = run.paged([T], [T], seed=20)
    q = run.randn(T, H, D)
    out = torch.empty_like(q)
    kw = dict(scale=D ** -0.5, sparse_block_size=cfg.block_size, topk=cfg.topk)
    flops = 2 * T * T * H * D  # causal: 4 * T^2 * H * D / 2
    shape = f"T={T} H{H}/G{G} D{D} bf16"
    with run.guard(f"prefill {T} oracle"):
        t = run.timer(lambda: K["oracle"](*batch.args(q), out=out, **kw))
        run.add(f"prefill/{T}/oracle", name=f"oracle prefill (top-{cfg.topk} of {cfg.block_size})", shape=shape,
                seconds=t, flops=flops)
    # SDPA on the same data, made contiguous: [1, H, T, D] and [1, G, T, D]
    q4 = q.view(1, T, H, D).transpose(1, 2).contiguous()
    k4 = gather_dense(batch.k_cache, batch.block_table, T)
    v4 = gather_dense(batch.v_cache, batch.block_table, T)
    flash = None
    for label, backend in sdpa_backends(run.device).items():
        with run.guard(f"prefill {T} sdpa {label}"):
            call, prep, mode = pick_sdpa(backend, q4, k4, v4, causal=True)
            kk, vv = prep(k4, v4)
            t = run.timer(lambda: call(kk, vv))
            run.add(f"prefill/{T}/sdpa_{label}", name=f"SDPA {label_backend(label, run.device)} causal", shape=shape,
                    seconds=t, flops=flops, note=mode)
            if label == "flash":
                flash = (call, prep)
            del kk, vv
    o = run.result["timings"].get(f"prefill/{T}/oracle")
    if o:
        ratios = [f"{o['tflops'] / r['tflops']:.2f}x {lab}" for lab in ("flash", "cudnn")
                  if (r := run.result["timings"].get(f"prefill/{T}/sdpa_{lab}"))]
        o["note"] = ", ".join(ratios)
    if flash is None:
        return
    call, prep = flash
    with run.guard(f"prefill {T} gather + flash"):
        def gather_flash():
            kk, vv = prep(gather_dense(batch.k_cache, batch.block_table, T), gather_dense(batch.v_cache,
                                                                                       batch.block_table, T))
            return call(kk, vv)

        t = run.timer(gather_flash)
        run.add(f"prefill/{T}/gather_flash", name=f"naive gather + SDPA {label_backend('flash', run.device)}",
                shape=shape, seconds=t, flops=flops)
    name = f"oracle prefill T={T} out vs SDPA {label_backend('flash', run.device)} on the same paged data bf16"
    run.check(name, lambda: Check(name, *compare_out(out, call(*prep(k4, v4))[0].transpose(0, 1), OUT_TOL[run.dtype])))


def label_backend(label, device) -> str:
    names = {"flash": "FLASH", "cudnn": "cuDNN"}
    return names[label] if device.type == "cuda" else f"MATH (stand-in for {names[label]} on CPU)"


def pick_sdpa(backend, q, k, v, *, causal):
    """(call(k, v), prep(k, v), mode) for one SDPA backend: native GQA, or K/V expanded when it refuses GQA."""
    from torch.nn.attention import sdpa_kernel

    gqa = q.shape[1] != k.shape[1]

    def call_native(kk, vv):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=kk.shape[1] != q.shape[1])

    try:
        call_native(k, v)
        return call_native, (lambda kk, vv: (kk, vv)), ("native GQA (enable_gqa)" if gqa else "")
    except RuntimeError:
        if not gqa:
            raise
    rep = q.shape[1] // k.shape[1]

    def prep(kk, vv):
        return kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)

    call_native(*prep(k, v))
    return call_native, prep, "K/V expanded to all heads (backend refused enable_gqa)"


def time_dense_decode(run: Run, B, ctx, heads):
    """Dense decode on contiguous K/V, allocated and freed here; stores the faster variant in run.dense."""
    H, G, D = heads
    key = (B, ctx, H, G, D)
    if key in run.dense:
        return run.dense[key]
    shape = f"B={B} ctx={ctx} H{H}/G{G} D{D} bf16"
    nbytes = run.kv_bytes(B * ctx, G, D)
    k, v = run.randn(B, G, ctx, D), run.randn(B, G, ctx, D)
    best = []
    with run.guard(f"dense decode {shape} packed"):
        qg = run.randn(B, G, H // G, D)
        t = run.timer(lambda: sdpa_plain(qg, k, v))
        run.add(f"dense/{B}x{ctx}x{D}/sdpa_packed", name="dense decode: SDPA, group heads as query rows (auto)",
                shape=shape, seconds=t, nbytes=nbytes, pages_dense=ctx // run.cfg.page_size)
        best.append(t)
    with run.guard(f"dense decode {shape} enable_gqa"):
        q1 = run.randn(B, H, 1, D)
        t = run.timer(lambda: sdpa_fused(q1, k, v, enable_gqa=True))
        run.add(f"dense/{B}x{ctx}x{D}/sdpa_gqa", name="dense decode: SDPA enable_gqa, q_len 1 (fused backends)",
                shape=shape, seconds=t, nbytes=nbytes)
        best.append(t)
    if best:
        run.dense[key] = min(best)
    return run.dense.get(key)


def time_oracle_decode(run: Run, K):
    cfg = run.cfg
    B, ctx = cfg.decode_batch, cfg.decode_ctx
    H, G, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dense = time_dense_decode(run, B, ctx, (H, G, D))
    free_memory()
    batch = run.paged([1] * B, [ctx] * B, seed=30)
    q = run.randn(B, H, D)
    out = torch.empty_like(q)
    kw = dict(scale=D ** -0.5, sparse_block_size=cfg.block_size, topk=cfg.topk)
    shape = f"B={B} ctx={ctx} H{H}/G{G} D{D} bf16"
    nbytes = run.kv_bytes(B * ctx, G, D)
    with run.guard("oracle decode"):
        from csrc_triton.oracle.kernel import default_num_splits

        splits = default_num_splits(B, B, G, batch.block_table.shape[1] * cfg.page_size, 64)
        t = run.timer(lambda: K["oracle"](*batch.args(q), out=out, **kw))
        note = f"num_splits={splits} (launcher's choice)"
        if dense:
            note += f"; {dense / t:.2f}x vs dense SDPA decode"
        run.add(f"decode/{ctx}/oracle", name=f"oracle decode (split-KV kernel, top-{cfg.topk})", shape=shape,
                seconds=t, nbytes=nbytes, pages=ctx / cfg.page_size, pages_dense=ctx // cfg.page_size, note=note)
    with run.guard("oracle decode gather baseline"):
        def gather_sdpa():
            k = gather_dense(batch.k_cache, batch.block_table, ctx)
            v = gather_dense(batch.v_cache, batch.block_table, ctx)
            return sdpa_plain(q.view(B, G, H // G, D), k, v)

        t = run.timer(gather_sdpa)
        run.add(f"decode/{ctx}/gather_sdpa", name="naive gather of the whole context + SDPA", shape=shape,
                seconds=t, nbytes=nbytes)
    name = f"oracle decode at the timing shape {shape} vs naive"
    run.check(name, lambda: oracle_against_naive(K, name, batch, q, kw, *K["oracle"](*batch.args(q), **kw)))


def time_sparse(run: Run, K, ctx, heads=None, kinds=("block", "token"), B=None, prefix="sparse"):
    """Block- and token-sparse decode at one context: kernel, naive gather + SDPA, pages per query, correctness."""
    cfg = run.cfg
    H, G, D = heads or (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    B = B or cfg.decode_batch
    dense = time_dense_decode(run, B, ctx, (H, G, D))
    free_memory()
    batch = run.paged([1] * B, [ctx] * B, heads=(H, G, D), seed=40)
    q = run.randn(B, H, D)
    out = torch.empty_like(q)
    shape = f"B={B} ctx={ctx} H{H}/G{G} D{D} bf16"
    labels = {"block": f"block-sparse {cfg.topk}x{cfg.block_size} (global branch; SWA not included)",
              "token": f"token-sparse {cfg.token_topk}+{cfg.window}"}
    for kind in kinds:
        with run.guard(f"{prefix} {ctx} {kind}"):
            idx = sparse_indices(cfg, kind, batch.pos, G)
            if kind == "block":
                positions = block_positions(idx, batch.pos, cfg.block_size)
            else:
                positions = token_positions(idx, batch.pos)
            kw = sparse_kwargs(cfg, kind, D)
            num_keys = int((positions >= 0).sum())
            nbytes = run.kv_bytes(num_keys, 1, D)  # positions already count every KV head
            pages = pages_per_query(batch.block_table, batch.req, positions, cfg.page_size)
            t = run.timer(lambda: K[kind](*batch.args(q), idx, out=out, **kw))
            note = f"{dense / t:.1f}x vs dense SDPA decode" if dense else ""
            run.add(f"{prefix}/{ctx}/{kind}", name=labels[kind], shape=shape, seconds=t, nbytes=nbytes,
                    pages=float(pages.mean()), pages_dense=ctx // cfg.page_size,
                    note=f"{num_keys // (B * G)} keys/query; {note}")
            run.result["timings"][f"{prefix}/{ctx}/{kind}"].update(
                keys_per_query=num_keys / (B * G), pages_max=float(pages.max()),
                speedup_vs_dense=dense / t if dense else None)
            t = run.timer(lambda: pages_per_query(batch.block_table, batch.req, positions, cfg.page_size))
            run.add(f"{prefix}/{ctx}/{kind}_pages_metric", name="pages/query metric (torch sort + count)",
                    shape=shape, seconds=t)
            if bool((positions >= 0).all()):
                t = run.timer(lambda: gather_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.req,
                                                    positions))
                run.add(f"{prefix}/{ctx}/{kind}_gather", name=f"naive gather of the same keys + SDPA ({kind})",
                        shape=shape, seconds=t, nbytes=nbytes)
            name = f"{labels[kind]} at the timing shape {shape} vs naive"
            run.check(name, lambda: sparse_against_naive(K, kind, name, batch, q, idx, kw,
                                                         K[kind](*batch.args(q), idx, **kw)))


def time_emission(run: Run, K):
    cfg = run.cfg
    T = cfg.emission_len
    H, G, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    batch = run.paged([T], [T], seed=50)
    q = run.randn(T, H, D)
    out = torch.empty_like(q)
    flops = 2 * T * T * H * D
    shape = f"T={T} H{H}/G{G} D{D} bf16"
    kw = dict(scale=D ** -0.5, sparse_block_size=cfg.block_size)
    variants = [("fused", f"oracle prefill, top-{cfg.topk} (as shipped)", dict(topk=cfg.topk)),
                ("scores", "oracle prefill + return_block_scores (debug: raw block maxima stored, R in torch)",
                 dict(topk=cfg.topk, return_block_scores=True)),
                ("topk2", "oracle prefill, top-2 (less top-k work; emission cannot be switched off)",
                 dict(topk=2))]
    for key, name, extra in variants:
        with run.guard(f"emission {key}"):
            t = run.timer(lambda: K["oracle"](*batch.args(q), out=out, **kw, **extra))
            run.add(f"emission/{T}/{key}", name=name, shape=shape, seconds=t, flops=flops)


def time_mqa(run: Run, K):
    cfg = run.cfg
    time_sparse(run, K, cfg.mqa_ctx, heads=cfg.mqa, kinds=("token",), B=cfg.mqa_batch, prefix="mqa")


# ---------------------------------------------------------------- targets and report

def evaluate_targets(res: dict, cfg: Config) -> list:
    tm = res["timings"]

    def get(key, f="ms"):
        return tm.get(key, {}).get(f)

    rows = []

    def target(name, value, threshold, measured, *, higher=True, kind="must", note=""):
        if value is None:
            status = "NOT RUN"
        elif math.isinf(threshold):
            status = "INFO"
        elif higher:
            status = "MET" if value >= threshold else "MISSED"
        else:
            status = "MET" if value <= threshold else "MISSED"
        rows.append({"target": name, "kind": kind, "value": value, "threshold": threshold,
                     "measured": measured if value is not None else "-", "status": status, "note": note})

    def ratio(a, b):
        return a / b if (a is not None and b) else None

    for T in cfg.prefill_lens[1:]:
        o, fl, cu = (get(f"prefill/{T}/{k}", "tflops") for k in ("oracle", "sdpa_flash", "sdpa_cudnn"))
        target(f"oracle prefill T={T}: TFLOP/s >= SDPA FLASH (emission on)", ratio(o, fl), 1.0,
               f"{fmt_num(o)} vs {fmt_num(fl)} TFLOP/s = {fmt_num(ratio(o, fl))}x")
        target(f"oracle prefill T={T}: >= 0.8x cuDNN", ratio(o, cu), 0.8,
               f"{fmt_num(o)} vs {fmt_num(cu)} TFLOP/s = {fmt_num(ratio(o, cu))}x", kind="stretch")
        over = ratio(get(f"prefill/{T}/oracle"), get(f"prefill/{T}/sdpa_flash"))
        target(f"emission overhead T={T} <= 10% (PROXY: vs SDPA FLASH)", None if over is None else over - 1, 0.10,
               f"{fmt_num(None if over is None else 100 * (over - 1))}% slower than FLASH", higher=False,
               kind="proxy", note=NOTE_NO_SWITCH)
    T = cfg.emission_len
    r = ratio(get(f"emission/{T}/scores"), get(f"emission/{T}/fused"))
    target(f"debug block scores T={T}: <= 1.15x the fused kernel (research doc 5)", r, 1.15,
           f"{fmt_num(r)}x", higher=False)
    r2 = ratio(get(f"emission/{T}/fused"), get(f"emission/{T}/topk2"))
    extra = None if r2 is None else r2 - 1
    target(f"top-{cfg.topk} vs top-2 cost T={T} (info: share of top-k maintenance)", extra, float("inf"),
           f"top-{cfg.topk} is {fmt_num(None if extra is None else 100 * extra)}% slower", kind="info")

    ctx, B = cfg.decode_ctx, cfg.decode_batch
    f = get(f"decode/{ctx}/oracle", "copy_frac")
    target(f"oracle decode B={B} ctx={ctx}: >= 70% of copy bandwidth", f, 0.70,
           f"{fmt_num(get(f'decode/{ctx}/oracle', 'tbps'))} TB/s = {fmt_num(None if f is None else 100 * f)}%")
    dense = min_or_none(*(get(f"dense/{B}x{ctx}x{cfg.head_dim}/{k}") for k in ("sdpa_packed", "sdpa_gqa")))
    s = ratio(dense, get(f"decode/{ctx}/oracle"))
    target(f"oracle decode B={B} ctx={ctx}: >= 1.0x dense SDPA decode (research doc 5)", s, 1.0, f"{fmt_num(s)}x")

    need = {0: 10.0, 1: 40.0}
    for i, c in enumerate(cfg.sparse_ctxs):
        f = get(f"sparse/{c}/block", "copy_frac")
        floor = get(f"sparse/{c}/block", "floor_ms_at_copy_bw")
        target(f"block-sparse B={B} ctx={c}: >= 65% of copy bandwidth (its bytes)", f, 0.65,
               f"{fmt_num(get(f'sparse/{c}/block', 'tbps'))} TB/s = {fmt_num(None if f is None else 100 * f)}%; "
               f"{fmt_num(get(f'sparse/{c}/block'))} ms vs floor {fmt_num(floor)} ms", note=NOTE_SWA)
        s = get(f"sparse/{c}/block", "speedup_vs_dense")
        if i in need:
            target(f"block-sparse B={B} ctx={c}: >= {need[i]:.0f}x faster than dense decode", s, need[i],
                   f"{fmt_num(s)}x ({fmt_num(get(f'sparse/{c}/block'))} ms)", note=NOTE_SWA)
        f = get(f"sparse/{c}/token", "copy_frac")
        target(f"token-sparse B={B} ctx={c}: >= 50% of copy bandwidth", f, 0.50,
               f"{fmt_num(get(f'sparse/{c}/token', 'tbps'))} TB/s = {fmt_num(None if f is None else 100 * f)}%")
    c = cfg.sparse_ctxs[0]
    per_key = ratio(ratio(get(f"sparse/{c}/token"), get(f"sparse/{c}/token", "keys_per_query")),
                    ratio(get(f"sparse/{c}/block"), get(f"sparse/{c}/block", "keys_per_query")))
    target(f"token-sparse ctx={c}: time per key <= 1.5x block-sparse (research doc 5)", per_key, 1.5,
           f"{fmt_num(per_key)}x", higher=False)
    p = get(f"sparse/{c}/block", "pages_max")
    target("block-sparse pages/query <= 73 (research doc 5 d)", p, 73, f"max {fmt_num(p)}", higher=False,
           note="window pages not included")
    f = get(f"mqa/{cfg.mqa_ctx}/token", "copy_frac")
    h, g, d = cfg.mqa
    target(f"token-sparse MQA H{h}/G{g} D{d} B={cfg.mqa_batch} ctx={cfg.mqa_ctx}: >= 50% of copy bandwidth", f, 0.50,
           f"{fmt_num(get(f'mqa/{cfg.mqa_ctx}/token', 'tbps'))} TB/s = {fmt_num(None if f is None else 100 * f)}%",
           kind="info")
    checks = res["correctness"]
    n_pass = sum(c["passed"] for c in checks)
    target("correctness: every check PASS", None if not checks else float(n_pass == len(checks)), 1.0,
           f"{n_pass}/{len(checks)} PASS")
    return rows


def min_or_none(*xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def markdown_report(res: dict) -> str:
    m = res["meta"]
    lines = [f"# csrc_triton kernel benchmark ({res['kind']})", "",
             f"- {m.get('gpu') or m.get('cpu')}, driver {m.get('driver')}, torch {m['torch']}, triton {m['triton']}, "
             f"CUDA {m.get('cuda_runtime')}, cuDNN {m.get('cudnn')}; {m['date']}; commit {m.get('git_commit')}"
             f"{' (csrc_triton modified)' if m.get('git_dirty') else ''}",
             f"- command: `{m['command']}` (cwd `{m['cwd']}`, env {m['env']})",
             f"- timing: {res['timing_method']}; elapsed {res.get('elapsed_s')} s; vLLM imported: "
             f"{res.get('vllm_imported')}", "", "## Correctness", ""]
    for c in res["correctness"]:
        lines.append("- " + Check(**c).line())
    lines += ["", "## Timings", "",
              "| key | what | shape | time | TFLOP/s | TB/s | % copy | pages/query (dense) | note |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key, r in res["timings"].items():
        t = f"{r['ms']:.4g} ms" if r["ms"] >= 0.1 else f"{r['ms'] * 1e3:.4g} us"
        lines.append("| " + " | ".join([
            key, r["name"], r["shape"], t, fmt_opt(r["tflops"], "{:.1f}"), fmt_opt(r["tbps"], "{:.2f}"),
            fmt_opt(r["copy_frac"] and 100 * r["copy_frac"], "{:.0f}%"),
            "" if r["pages_per_query"] is None else f"{r['pages_per_query']:.1f} ({r['pages_dense']})",
            r["note"]]) + " |")
    lines += ["", "## Targets", "", "| target | kind | measured | status |", "| --- | --- | --- | --- |"]
    for t in res["targets"]:
        lines.append(f"| {t['target']} | {t['kind']} | {t['measured']} | {t['status']} |")
    lines += ["", "## Sections", ""]
    for name, s in res["sections"].items():
        lines.append(f"- {name}: {s['status']}" + (f" ({s['seconds']} s)" if "seconds" in s else ""))
    if res.get("skipped_checks"):
        lines += ["", "## Skipped checks (budget)", ""] + [f"- {n}" for n in res["skipped_checks"]]
    if res["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['what']}: {e['error']}" for e in res["errors"]]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def fmt_opt(v, spec) -> str:
    return "" if v is None else spec.format(v)


# ---------------------------------------------------------------- main

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script's logic, not speed)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the JSON and Markdown go (default: $OUT if set, else benchmarks/results/; "
                             "--smoke: benchmarks/results/tmp/)")
    parser.add_argument("--budget-s", type=float, default=420,
                        help="skip the remaining sections once this many seconds have elapsed (default 420)")
    parser.add_argument("--check-budget-s", type=float, default=180,
                        help="skip the remaining compact correctness checks past this many seconds (default 180); "
                             "the checks at the timing shapes still run")
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--sections", nargs="*", default=None,
                        help="run only sections whose name starts with one of these "
                             "(correctness ceilings prefill_ decode sparse_ emission mqa)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # must precede the kernel imports: @triton.jit reads it when a kernel module is imported
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        cfg = smoke_config()
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("warning: TRITON_INTERPRET=1 is set on a GPU run", file=sys.stderr)
        device = torch.device("cuda")
        cfg = Config()
    # the float32 twins are the reference: no TF32 in their matmuls
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        K = kernels()
    except ImportError as e:
        print(f"cannot import csrc_triton ({e}); run from the repository root with PYTHONPATH=.", file=sys.stderr)
        return 2
    # smoke numbers are not results: they go to the gitignored tmp/ unless asked otherwise
    default_dir = RESULTS_DIR / "tmp" if args.smoke else RESULTS_DIR
    out_dir = args.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else default_dir)
    date = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    stem = out_dir / f"kernels_{'smoke' if args.smoke else 'gpu'}_{date}"
    run = Run(cfg, device, args, stem)
    meta = run.result["meta"]
    print(f"command: {meta['command']}")
    print(f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda_runtime']}, "
          f"device {meta.get('gpu') or meta.get('cpu')}, driver {meta.get('driver')}, cuDNN {meta.get('cudnn')}")
    print(f"outputs: {stem}.json / .md; budget {args.budget_s:.0f} s", flush=True)

    def correctness():
        for name, fn in correctness_plan(cfg):
            if run.elapsed() > args.check_budget_s:
                print(f"[SKIP] {name}: elapsed {run.elapsed():.0f} s > check budget {args.check_budget_s:.0f} s")
                run.result["skipped_checks"].append(name)
                continue
            run.check(name, lambda: fn(K, device, name))

    run.section("correctness", correctness)
    run.section("ceilings", lambda: time_ceilings(run, K))
    for T in cfg.prefill_lens:
        run.section(f"prefill_{T}", lambda: time_prefill(run, K, T))
    run.section("decode", lambda: time_oracle_decode(run, K))
    for c in cfg.sparse_ctxs:
        run.section(f"sparse_{c}", lambda: time_sparse(run, K, c))
        run.dense.clear()  # the next context needs its own dense baseline
    run.section("emission", lambda: time_emission(run, K))
    run.section("mqa", lambda: time_mqa(run, K))
    run.save()
    print("\n" + markdown_report(run.result))
    # a short summary last, so that the tail of a long log still holds the verdicts
    failed = [c for c in run.result["correctness"] if not c["passed"]]
    print(f"SUMMARY: {len(run.result['correctness']) - len(failed)}/{len(run.result['correctness'])} checks PASS, "
          f"{len(run.result['skipped_checks'])} skipped, {len(run.result['errors'])} errors, "
          f"elapsed {run.elapsed():.0f} s")
    for c in failed:
        print(f"  FAIL: {c['name']}")
    for t in run.result["targets"]:
        print(f"  {t['status']:8} {t['target']}: {t['measured']}")
    print(f"wrote {stem}.json and {stem}.md", flush=True)
    return 1 if failed or run.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
