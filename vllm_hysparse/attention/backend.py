# SPDX-License-Identifier: Apache-2.0
"""HySparse attention backend: the roles of HySparse and HySparse2 layers in vLLM.

A full layer with sparse followers uses role `oracle`: it stores its K/V in
its paged cache, computes exact causal attention and writes, per query and KV
group, the oracle's top-k block ids (SPEC §3.1) into its index buffer. A sparse
layer's global branch uses role `block_sparse`: it owns no cache (vLLM KV
sharing binds it to the full layer's), reads that buffer and attends, with its
sink, over the selected blocks (SPEC §3.2). HySparse2's cross layers use
`token_oracle` / `token_sparse` the same way over token positions (SPEC §3.3);
its bridged caches are `kv_owner`s, written and never attended here. The SWA
branch is a plain windowed vLLM `Attention` with sinks; the global branch's op
runs it (`fused_window`), so a sparse layer costs one attention op, not two,
and mixes the two branches by their gates as it stores them (`gate_width`).
With `v_head_dim != head_dim` (SPEC §2.6) the layers vLLM would otherwise
serve run here too, because vLLM 0.32's CPU backend cannot store V at its own
width and ours can (`AttentionSpec.head_size_v`): role `dense` is plain causal
attention (HySparse's last full layer, HySparse2's self full layers; also on
the CPU in float32, where our tiled kernel reads a shared prompt once), role
`window` sink attention over the `window` most recent keys (the SWA branch,
HySparse2's sliding layers), the token-sparse kernels over positions built
from the step's row positions.

The cache is vLLM's logical page view `[blocks, G, page, D_k + D_v]`, D_v the
value head dim (`head_size_v` of the layer's spec, SPEC §2.6; vLLM's
CPU kernel packs its own layer caches in a private format, so those cannot be
shared). Every role is one entry of `ROLE_TABLE`: the `csrc_triton` function of
each kernel path and the arguments it takes. Two kernel paths, chosen by device
or by `VLLM_HYSPARSE_KERNELS`: `triton` (CUDA's default; on CPU it needs
`TRITON_INTERPRET=1`) and `torch` (the batched PyTorch twins, the CPU default:
decode rows of all requests together, sparse roles reading only the selected
keys). The forward reads no host value: what needs one (which rows are decode
rows, the prefill runs) is computed once per step by the metadata builder.
Both paths run inside vLLM's opaque attention op, so `torch.compile` never
traces them.

`kv_cache_dtype="fp8"` (= `"fp8_e4m3"`) stores K / k_scale and V / v_scale as
float8_e4m3fn (vLLM's per-layer `_k_scale` / `_v_scale`, 1.0 unless a checkpoint
gives them); every kernel path reads the e4m3 values and applies the scales
(`csrc_triton.paged_args.kv_scaled`). A layer reading a shared cache uses the
scales of the layer that owns (and wrote) it.
"""

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import is_quantized_kv_cache  # (0.32 and 0.33; vllm.utils.torch_utils in 0.32 only)
from vllm.v1.kv_cache_layout import KVCacheLayout

from csrc_triton import cpu_ext
from csrc_triton.paged_args import FP8_KV_DTYPE
from csrc_triton.paged_batch import BatchPlan, gated_store, make_plan
from vllm_hysparse import envs
from vllm_hysparse.attention.paged import bind_write_kv, split_kv_cache
from vllm_hysparse.metrics import worker_stats
from vllm_hysparse.vllm_glue.forward_context import attention_context, attention_layer

BACKEND_NAME = "HYSPARSE"
KERNELS_ENV = envs.KERNELS.name
KERNEL_PATHS = ("triton", "torch")
# vLLM's names of an e4m3 cache ("fp8" is "fp8_e4m3", vllm/utils/torch_utils.py); e5m2 is not supported.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def check_kv_cache_dtype(dtype: str) -> None:
    """Refuse a quantised `kv_cache_dtype` other than e4m3 FP8, the only quantised cache this backend stores."""
    if is_quantized_kv_cache(dtype) and dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: HySparse models support 'auto' or {list(FP8_KV_CACHE_DTYPES)} "
                         f"(FP8 e4m3), not {dtype!r}")


def serves_plain_attention(cache_dtype: str) -> bool:
    """Whether a layer vLLM's CPU attention could serve runs on one of our roles instead: a full layer with no
    oracle on `dense`, HySparse's SWA branch and HySparse2's sliding layers on `window`.

    Yes where our tiled C++ kernel serves it: on the CPU, on the `torch` path, C++ kernels not switched off,
    a float32 model (vLLM builds a model under its dtype: vllm/model_executor/model_loader/base_loader.py,
    `set_default_torch_dtype`) and an unquantised cache. Decode rows of requests on one prompt then read its
    pages once for all of them (vLLM's kernel reads them once per request); a window is walked as one range per
    tile of rows. Elsewhere ours would be the PyTorch fallback, so vLLM's kernel keeps the layer.
    """
    return (current_platform.is_cpu() and kernel_path(torch.device("cpu")) == "torch" and cpu_ext.enabled()
            and torch.get_default_dtype() == torch.float32 and not is_quantized_kv_cache(cache_dtype))


def kernel_path(device: torch.device) -> str:
    """`triton` or `torch`: `VLLM_HYSPARSE_KERNELS` if set, else Triton on CUDA and PyTorch elsewhere."""
    choice = os.environ.get(KERNELS_ENV)
    if choice is None:
        return "triton" if device.type == "cuda" else "torch"
    if choice not in KERNEL_PATHS:
        raise ValueError(f"{KERNELS_ENV}: must be one of {list(KERNEL_PATHS)} (got {choice!r})")
    return choice


class HySparseAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_KV_CACHE_DTYPES]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["HySparseAttentionImpl"]:
        return HySparseAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["HySparseMetadataBuilder"]:
        return HySparseMetadataBuilder

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...] | None:
        """Any layout, head-major page interiors (`[G, page, D_k + D_v]`, LBHNC) first on the CPU.

        vLLM resolves one layout for all of a model's backends, from these lists
        (vllm/v1/attention/backends/utils.py, `get_supported_kv_cache_layouts`). Its CPU
        backend takes only LBHNC, which is also what our C++ kernels read. With no
        preference here, a model with no layer on vLLM's backend got vLLM's default,
        token-major LBNHC, and our PyTorch fallback: 2.3 ms per decode call instead of
        0.27 (HySparse `small`, 512 tokens, one request, 2-core AMD EPYC).
        """
        if not current_platform.is_cpu():
            return None
        first = KVCacheLayout.LBHNC
        return (first, *(layout for layout in KVCacheLayout if layout is not first))

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class HySparseMetadata:
    """One step's batch layout. KV writes get their slots from vLLM directly (`do_kv_cache_update`)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    block_table: torch.Tensor  # [num_reqs, max_pages] int32
    max_seq_len: int  # host upper bound on seq_lens
    plan: BatchPlan  # decode rows, prefill runs and row positions, computed on the host once per step
    # per-step tensors derived from `plan`, built by the first layer that needs them (`window_positions`)
    derived: dict = field(default_factory=dict)


class HySparseMetadataBuilder(AttentionMetadataBuilder[HySparseMetadata]):
    # Honest level: the PyTorch path shapes its work from host values of each
    # step (prefill runs, the longest decode), which a captured graph would
    # freeze; the Triton path's launches depend only on tensor shapes, but its
    # row positions are per-step tensors, so no capture is claimed for either.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> HySparseMetadata:
        m = common_attn_metadata
        # vLLM keeps host copies of the sequence lengths; exact outside speculative decoding.
        seq_lens_cpu = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens.cpu()
        return HySparseMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            max_seq_len=m.max_seq_len,
            plan=make_plan(m.query_start_loc_cpu, seq_lens_cpu, m.num_actual_tokens, self.device),
        )


@dataclass(frozen=True)
class BlockSelection:
    """HySparse: top-`topk` blocks of `block_size` positions per query and KV group (SPEC §3.1)."""

    block_size: int
    topk: int


@dataclass(frozen=True)
class TokenSelection:
    """HySparse2: recent `window` ∪ top-`topk` tokens per query and KV group (SPEC §3.3)."""

    topk: int
    window: int
    reduce: str


@dataclass(frozen=True)
class WindowSelection:
    """Keys `[t - window + 1, t]` of every query (a sliding-window layer, SPEC §2.5)."""

    window: int


def window_positions(row_pos: torch.Tensor, num_rows: int, num_kv_heads: int, window: int) -> torch.Tensor:
    """`[num_rows, G, window]` int32 key positions `[max(0, t - window + 1), t]` of every row, ascending, -1 padded
    at the end; rows past `row_pos` (padding tokens) get -1 only. Device ops only: no host value is read."""
    pos = torch.full((num_rows,), -1, dtype=torch.long, device=row_pos.device)
    pos[:row_pos.shape[0]] = row_pos
    offsets = torch.arange(window, device=pos.device)
    ids = (pos - window + 1).clamp_min(0)[:, None] + offsets
    ids = torch.where(offsets[None, :] < torch.clamp(pos + 1, max=window)[:, None], ids, -1)
    return ids.to(torch.int32)[:, None, :].expand(num_rows, num_kv_heads, window)


def step_window_positions(meta: "HySparseMetadata", num_rows: int, num_kv_heads: int, window: int) -> torch.Tensor:
    """`window_positions` of this step, built once and shared by every window layer of the step."""
    key = ("window", num_rows, num_kv_heads, window)
    if key not in meta.derived:
        meta.derived[key] = window_positions(meta.plan.row_pos, num_rows, num_kv_heads, window)
    return meta.derived[key]


@dataclass(frozen=True)
class Role:
    """What one role runs: the kernel of each path (`module:function` in `csrc_triton`) and its arguments.

    `publishes` roles return `(out, ids)` and hand the ids to their followers
    through the index buffer; `reads_index` roles take that buffer as input,
    `reads_window` roles the positions of their window (`window_positions`).
    """

    kernels: dict[str, str]
    kwargs: Callable[["HySparseAttentionImpl"], dict]
    publishes: bool = False
    reads_index: bool = False
    reads_window: bool = False
    positions_per_id: Callable[["HySparseAttentionImpl"], int] = lambda impl: 1
    bounded_by_seq_len: bool = False  # the Triton kernel sizes its scratch by a host `max_seq_len`
    # The `torch` path's C++ kernel bound once per layer and cache (`module:function(q, k_cache, v_cache, *, scale,
    # **kwargs)` -> `run(q, block_table, plan, out, ids)` or None); None: the role always calls its `torch` kernel.
    cpu_bind: str | None = None
    # Its keywords where they differ from `kwargs` (those of the `torch` kernel).
    bind_kwargs: Callable[["HySparseAttentionImpl"], dict] | None = None
    # The paths whose kernel stores its rows through a gate (`gate=`, `accumulate=`: a sparse layer's branches
    # mixed in the kernels' stores); on the others `paged_batch.gated_store` gates the kernel's rows after it.
    gated_paths: tuple[str, ...] = ()


ROLE_TABLE: dict[str, Role | None] = {
    "oracle": Role(
        kernels={"triton": "csrc_triton.oracle.kernel:oracle_attention",
                 "torch": "csrc_triton.oracle.batched:oracle_attention_batched"},
        kwargs=lambda impl: dict(sparse_block_size=impl.selection.block_size, topk=impl.selection.topk),
        publishes=True, positions_per_id=lambda impl: impl.selection.block_size,
        cpu_bind="csrc_triton.oracle.batched:bind_oracle"),
    "token_oracle": Role(
        kernels={"triton": "csrc_triton.token_oracle.kernel:token_oracle_attention",
                 "torch": "csrc_triton.token_oracle.batched:token_oracle_attention_batched"},
        kwargs=lambda impl: dict(topk_tokens=impl.selection.topk, recent_window=impl.selection.window,
                                 score_head_reduce=impl.selection.reduce),
        publishes=True, bounded_by_seq_len=True, cpu_bind="csrc_triton.token_oracle.batched:bind_token_oracle"),
    "block_sparse": Role(
        kernels={"triton": "csrc_triton.block_sparse.kernel:block_sparse_attention",
                 "torch": "csrc_triton.block_sparse.batched:block_sparse_attention_batched"},
        kwargs=lambda impl: dict(sparse_block_size=impl.selection.block_size, sinks=impl.sinks),
        reads_index=True, cpu_bind="csrc_triton.block_sparse.batched:bind_block_sparse", gated_paths=("triton",)),
    "token_sparse": Role(
        kernels={"triton": "csrc_triton.token_sparse.kernel:token_sparse_attention",
                 "torch": "csrc_triton.token_sparse.batched:token_sparse_attention_batched"},
        kwargs=lambda impl: dict(sinks=impl.sinks),
        reads_index=True, cpu_bind="csrc_triton.token_sparse.batched:bind_token_sparse", gated_paths=("triton",)),
    # Plain causal attention (no sink, no selection): on the CPU the tiled oracle kernel (a shared prompt walked
    # once for all its decode rows), in Triton the token oracle's kernel. Used where `serves_plain_attention` says.
    "dense": Role(
        kernels={"triton": "csrc_triton.dense:dense_attention",
                 "torch": "csrc_triton.dense:dense_attention_batched"},
        kwargs=lambda impl: {},
        bounded_by_seq_len=True, cpu_bind="csrc_triton.dense:bind_dense"),
    # Sliding-window sink attention: the token-sparse kernels over each row's window positions; on the CPU the
    # tiled window walk, which needs no positions. Used with v_head_dim != head_dim, and for HySparse's SWA branch
    # and HySparse2's sliding layers where `serves_plain_attention` says (`models.layers.window_attention`).
    "window": Role(
        kernels={"triton": "csrc_triton.token_sparse.kernel:token_sparse_attention",
                 "torch": "csrc_triton.token_sparse.batched:token_sparse_attention_batched"},
        kwargs=lambda impl: dict(sinks=impl.sinks),
        reads_window=True, cpu_bind="csrc_triton.window:bind_window",
        bind_kwargs=lambda impl: dict(sinks=impl.sinks, window=impl.selection.window), gated_paths=("triton",)),
    "kv_owner": None,  # a HySparse2 bridged cache: written by the bridge op, never attended
}
ROLES = tuple(ROLE_TABLE)


def load_kernel(spec: str) -> Callable:
    """`"package.module:function"` -> the function (kernel modules import Triton only when loaded)."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


class HySparseAttentionImpl(AttentionImpl):
    """Attention with a HySparse role (see `ROLE_TABLE`).

    Extra args (from `Attention(**extra_impl_args)`):
        hysparse_role: a key of `ROLE_TABLE`.
        index_buffer: `[max_num_batched_tokens, G, width]` int32, written by an
            oracle role and read by the sparse roles that follow it.
        selection: `BlockSelection`, `TokenSelection` or `WindowSelection` of the roles that need one.
        sinks: `[H]` float32 sink logits (sparse roles), or None.
        fused_window: name of a sliding-window `Attention` (a HySparse sparse layer's SWA branch) whose
            cache write and attention this layer's op runs too, on the key / value it is given; its output
            then has two halves, `[2T, H, Dv]`: this layer's rows, then the window layer's.
        gate_width: with `fused_window`, the width per head of each branch's gate (Dv elementwise, 1 headwise;
            SPEC §2.5), 0 for none. The output buffer then carries the gates in: flat, `[T, 2, H, gate_width]`
            (this layer's, the window layer's), then `[T, H, Dv]`, where the op stores
            `sigmoid(g_sparse) * global + sigmoid(g_swa) * window` (`models.hysparse`, `run_attention_op`).
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, *,
                 hysparse_role: str, index_buffer: torch.Tensor | None = None,
                 selection: BlockSelection | TokenSelection | WindowSelection | None = None,
                 sinks: torch.Tensor | None = None, fused_window: str | None = None, gate_width: int = 0):
        if hysparse_role not in ROLE_TABLE:
            raise ValueError(f"hysparse_role: must be one of {ROLES} (got {hysparse_role!r})")
        if alibi_slopes is not None or logits_soft_cap:
            raise ValueError("the HySparse backend supports no ALiBi or soft cap")
        check_kv_cache_dtype(kv_cache_dtype)
        window = selection.window if isinstance(selection, WindowSelection) else None
        if sliding_window != window:
            # vLLM frees pages out of the window (SlidingWindowSpec): only the window role may have one
            raise ValueError(f"sliding_window: the HySparse role {hysparse_role!r} needs {window} "
                             f"(got {sliding_window})")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.role = hysparse_role
        self.index_buffer = index_buffer
        self.selection = selection
        self.sinks = sinks
        if gate_width and fused_window is None:
            raise ValueError("gate_width: only with fused_window (a sparse layer's two branches)")
        self.fused_window = fused_window
        self.gate_width = gate_width
        self._kernel: tuple[str, Callable] | None = None  # (path, function), resolved on the first call
        if current_platform.is_cpu() and kernel_path(torch.device("cpu")) == "torch":
            # at model load: a build needed here must never happen inside a request (one log line if it runs)
            cpu_ext.preload()
        self._cache_owner = None  # the layer whose K/V scales this layer's cache holds, found on the first call
        self._bound: tuple[torch.Tensor, Callable | None] | None = None  # (kv_cache, its bound C++ kernel or None)
        self._writer: tuple[torch.Tensor, Callable] | None = None  # (kv_cache, its bound `write_kv`)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """key `[T, G, D]`, value `[T, G, Dv]` -> the layer's pages at `slot_mapping` (FP8: quantised by its scales)."""
        if self._writer is None or self._writer[0] is not kv_cache:  # bound once per cache, as `_bound_kernel`
            self._writer = (kv_cache, bind_write_kv(*split_kv_cache(kv_cache, self.head_size)))
        self._writer[1](key, value, slot_mapping, layer._k_scale_float, layer._v_scale_float)

    def _kv_scales(self, layer) -> tuple[float, float]:
        """(k_scale, v_scale) of the cache `layer` reads: the owner's, for a layer bound to another's cache.

        Host floats vLLM keeps beside its scale tensors, fixed after weight loading: no device read.
        """
        if self._cache_owner is None:
            target = self.kv_sharing_target_layer_name
            self._cache_owner = layer if target is None else attention_layer(target)
        return self._cache_owner._k_scale_float, self._cache_owner._v_scale_float

    @property
    def kernels(self) -> str | None:
        """The kernel path this layer runs (`triton` / `torch`), None before its first call."""
        return None if self._kernel is None else self._kernel[0]

    def _resolve(self, device: torch.device) -> tuple[str, Callable]:
        if self._kernel is None:
            role = ROLE_TABLE[self.role]
            if role is None:
                raise RuntimeError("a HySparse2 bridged cache is written by the bridge op and never attended directly")
            path = kernel_path(device)
            self._kernel = (path, load_kernel(role.kernels[path]))
        return self._kernel

    def _bound_kernel(self, query: torch.Tensor, kv_cache: torch.Tensor) -> Callable | None:
        """The role's C++ kernel bound to `kv_cache` (`Role.cpu_bind`), or None; bound on the first call.

        vLLM hands a layer the same cache tensor every step, so the binding is
        looked up by identity: a new cache (a reallocation) binds again. The
        binding holds a view of the cache; only the CPU path binds, and vLLM's
        CPU worker never frees a cache while it runs (no sleep mode there:
        vllm/v1/worker/cpu_worker.py, `sleep`).
        """
        if self._bound is None or self._bound[0] is not kv_cache:
            role = ROLE_TABLE[self.role]
            key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
            run = None if role.cpu_bind is None else load_kernel(role.cpu_bind)(
                query, key_cache, value_cache, scale=self.scale, **(role.bind_kwargs or role.kwargs)(self))
            self._bound = (kv_cache, run)
        return self._bound[1]

    def _selection(self, meta: HySparseMetadata, n: int) -> torch.Tensor | None:
        """The ids the role reads (`[n, G, W]`: the index buffer, or its window's positions), or None."""
        role = ROLE_TABLE[self.role]
        if role.reads_index:
            return self.index_buffer[:n]
        if role.reads_window:
            return step_window_positions(meta, n, self.num_kv_heads, self.selection.window)
        return None

    def _window_branch(self, query, key, value, output, gate=None) -> None:
        """The `fused_window` layer's step, as vLLM's two attention ops would run it: its cache write, then its
        attention (its own backend, metadata, cache and slots) -> `output [T, H, Dv]`.

        One op instead of two for a sparse layer's two branches: vLLM's wrappers of the window layer's two ops
        took 0.08 + 0.06 ms of host time per sparse layer (torch.profiler self time, compiled, HySparse `small`,
        one request at 512 tokens, CPU), 1.3 ms of a 27-30 ms decode step over 9 sparse layers. vLLM's per-layer
        KV-connector hooks (`maybe_transfer_kv_layer`) wrap the op of this layer only, not the window layer's.
        """
        metadata, layer, kv_cache, slots = attention_context(self.fused_window)
        # As `Attention.forward` and `unified_kv_cache_update` (vllm/model_executor/layers/attention/attention.py):
        # a backend that writes inside its forward gets no separate write. Through the layer's impl, so PIC's tap
        # sees the write.
        if slots is not None and not layer.attn_backend.forward_includes_kv_cache_update:
            layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
        if isinstance(layer.impl, HySparseAttentionImpl):
            layer.impl.forward(layer, query, key, value, kv_cache, metadata, output=output, gate=gate)
        elif gate is None:
            layer.impl.forward(layer, query, key, value, kv_cache, metadata, output=output)
        else:  # vLLM's own backend serves the window (`models.layers.window_attention`): gated afterwards
            rows = layer.impl.forward(layer, query, key, value, kv_cache, metadata, output=torch.empty_like(output))
            if metadata is not None:
                gated_store(output, rows, gate, accumulate=False)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: HySparseMetadata | None, output,
                output_scale=None, output_block_scale=None, gate=None, accumulate=False):
        """query `[T, H, D]`, kv_cache `[blocks, G, page, D + Dv]` -> `output [T, H, Dv]` (`[2T, H, Dv]` with
        `fused_window`: this layer's rows, then the window layer's, from key `[T, G, D]` and value `[T, G, Dv]`;
        with `gate_width`, the gated sum of both in the flat buffer described in the class docstring).

        gate `[T, H, Dv]` (a last stride of 0: one per head): rows stored as `paged_batch.gated_store`,
        `output = (output if accumulate else 0) + sigmoid(gate) * attention`; a sparse layer's op passes it to its
        window layer and to its own rows."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the HySparse backend")
        t = query.shape[0]
        if self.gate_width:
            gates = output[: t * 2 * self.num_heads * self.gate_width].view(t, 2, self.num_heads, self.gate_width)
            output = output[gates.numel():].view(t, self.num_heads, -1)
            g_sparse, g_swa = (g.expand(-1, -1, output.shape[2]) for g in gates.unbind(1))
            self._window_branch(query, key, value, output, gate=g_swa)
            self._attend(layer, query, kv_cache, attn_metadata, output, g_sparse, True)
            return output
        if self.fused_window is not None:
            self._window_branch(query, key, value, output[t:])
        return self._attend(layer, query, kv_cache, attn_metadata, output, gate, accumulate)

    def _attend(self, layer, query, kv_cache, attn_metadata: HySparseMetadata | None, output, gate, accumulate):
        """This layer's role over the step (`forward`, after the window branch of a sparse layer)."""
        if attn_metadata is None:  # profiling / warm-up run
            return output
        path, kernel = self._resolve(query.device)
        role = ROLE_TABLE[self.role]
        meta = attn_metadata
        n = meta.num_actual_tokens
        run = self._bound_kernel(query, kv_cache) if path == "torch" and query.device.type == "cpu" else None
        if run is not None:  # the CPU serving path: one C++ call, no per-call checks
            rows = meta.plan.num_tokens
            # the bound kernels take the index buffer; the window walk needs no positions
            ids = self.index_buffer[:rows] if role.publishes or role.reads_index else None
            gated = () if gate is None else (gate[:rows], accumulate)
            run(query[:rows], meta.block_table, meta.plan, output[:rows], ids, *gated)
            if rows < n and not accumulate:  # padding rows
                output[rows:n].zero_()
                if role.publishes:
                    self.index_buffer[rows:n].fill_(-1)
            if role.publishes:
                worker_stats().add(ids, meta.plan.row_pos, role.positions_per_id(self), kv_cache.shape[2])
            return output
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        args = [query[:n], key_cache, value_cache, meta.block_table, meta.query_start_loc, meta.seq_lens]
        selection = self._selection(meta, n)
        if selection is not None:
            args.append(selection)
        kwargs = role.kwargs(self)
        if key_cache.dtype == FP8_KV_DTYPE:
            kwargs["k_scale"], kwargs["v_scale"] = self._kv_scales(layer)
        if path == "torch":
            kwargs["plan"] = meta.plan
            if role.publishes and self.role == "oracle":
                kwargs["indices"] = self.index_buffer[:n]  # the kernel writes the followers' ids in place
        elif role.bounded_by_seq_len:
            kwargs["max_seq_len"] = meta.max_seq_len
        gated_after = gate is not None and path not in role.gated_paths
        if gate is not None and not gated_after:
            kwargs.update(gate=gate[:n], accumulate=accumulate)
        result = kernel(*args, scale=self.scale, out=torch.empty_like(output[:n]) if gated_after else output[:n],
                        **kwargs)
        if gated_after:
            gated_store(output[:n], result, gate[:n], accumulate)
        if role.publishes:
            ids = result[1]
            if ids.data_ptr() != self.index_buffer.data_ptr():
                self.index_buffer[:n].copy_(ids)
            worker_stats().add(ids[:meta.plan.num_tokens], meta.plan.row_pos, role.positions_per_id(self),
                               key_cache.shape[2])
        return output
