# SPDX-License-Identifier: Apache-2.0
"""PIC inside vLLM's model runner: splice stored segment K/V and run the layers on recomputed rows only.

vLLM's scheduler cannot leave holes in a request's computed prefix, so it
schedules every prompt token of a PIC request as usual. The saving happens
here, around the model call of each step that holds spliced rows:

1. **Isolated pass** for cold segments (first seen, or evicted): each is a
   virtual request at local positions 0..len-1 over scratch pages, run
   through the whole model; a tap on every KV-owning layer's cache write
   records the K/V it stores, which become the segment's store entry.
2. **Splice**: for every spliced row (a reused segment's rows after its
   seam), every KV-owning layer's stored K (rotated by the segment's new
   start on rotary layers) and V are written into the row's own slots.
3. **Recompute pass**: the model runs on the other rows only (prefix, seams,
   query, decode rows, plain requests). Each run of consecutive such rows of
   a request is a virtual request over that request's block table, so it
   attends causally to everything before it, spliced rows included.

All of it is eager Python between compiled model calls, with the forward
context swapped for each call (the attention ops read it at run time); a
step without spliced rows calls the model exactly as vLLM does. What of it
touches vLLM's runner, layers or forward context goes through
`vllm_hysparse.vllm_glue` (`runner`, `forward_context`).
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_hysparse.metrics import PIC_COUNTERS, worker_stats
from vllm_hysparse.pic.layout import POOL_SALT_FIELD, PICError, PICLayout, parse_layout
from vllm_hysparse.pic.rotation import rotate_by
from vllm_hysparse.pic.shared import Publisher, SharedEntryError, decode_entry, open_shared_tier
from vllm_hysparse.pic.store import SegmentStore, model_fingerprint, segment_key
from vllm_hysparse.vllm_glue import forward_context
from vllm_hysparse.vllm_glue.runner import (
    attention_layers,
    build_attention_metadata,
    last_rows,
    logits_row_counts,
    step_block_tables,
    swapped_kv_caches,
    wrap_kv_cache_update,
    write_kv_unobserved,
)

logger = init_logger("vllm.hysparse")


@dataclass
class RequestPIC:
    layout: PICLayout
    keys: dict[int, tuple[str, tuple[int, ...]]]  # middle segment index -> (store key, token ids)
    pool: str = "public"
    seen: set[int] = field(default_factory=set)  # segments already counted as hit or cold


@dataclass
class Splice:
    key: str
    rows: np.ndarray  # batch rows that take stored K/V
    offsets: np.ndarray  # positions within the segment
    start: int  # the segment's start a_i in the prompt (rotation)


@dataclass
class StepPlan:
    recompute: np.ndarray  # bool [num_tokens]
    splices: list[Splice]
    cold: dict[str, tuple[tuple[int, ...], str, list[str]]]  # key -> (token ids, pool, request ids)
    entries: dict = field(default_factory=dict)  # key -> store Entry (hits; cold ones added after the isolated pass)
    stats: dict = field(default_factory=dict)


class KVTap:
    """Wraps every KV-owning layer's cache write; records what it writes while `capture` is a dict."""

    def __init__(self):
        self.capture: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def install(self, layer, name: str) -> None:
        def record(key, value, slot_mapping):
            if self.capture is not None:
                n = slot_mapping.shape[0]
                self.capture.setdefault(name, []).append((key[:n].clone(), value[:n].clone()))

        wrap_kv_cache_update(layer, record)


class PICEngine:
    """Per-worker PIC state: the segment store, request layouts and the step executor."""

    def __init__(self, runner):
        self.store = SegmentStore()
        self.active: dict[str, RequestPIC] = {}  # PIC requests, by id, until they finish or are preempted
        self.tap = KVTap()
        self.counters = dict.fromkeys(PIC_COUNTERS, 0)
        self.shared = None  # the second tier (`pic.shared`), if VLLM_HYSPARSE_PIC_SHARED names one
        self.publisher: Publisher | None = None
        self._ready = False
        self.fingerprint = ""
        self.kv_layers: dict[str, object] = {}  # KV-owning attention layers by name
        self.ropes: dict[str, object] = {}
        self.windows: dict[str, int | None] = {}  # sliding-window layers: their window
        self._scratch: dict[str, torch.Tensor] = {}  # KV-owning layer name -> its isolated pass's cache
        self.drafts: dict[str, list[int]] = {}  # this step's speculative draft tokens, by request id

    # ---- setup -------------------------------------------------------------------------------------
    def _setup(self, runner) -> None:
        if self._ready:
            return
        model = runner.get_model()
        layers = attention_layers(runner)
        for name, layer in layers.items():
            if getattr(layer, "kv_sharing_target_layer_name", None) is None and hasattr(layer, "impl"):
                self.kv_layers[name] = layer
                self.tap.install(layer, name)
                parent = model.get_submodule(name.rsplit(".", 1)[0])
                self.ropes[name] = getattr(parent, "rotary_emb", None)
                self.windows[name] = getattr(layer, "sliding_window", None)
        self.fingerprint = model_fingerprint(model, runner.model_config.hf_config, runner.model_config.dtype)
        self.shared = open_shared_tier()  # the config hook has checked the setting at engine start
        if self.shared is not None:
            self.publisher = Publisher(self.shared, self.counters, on_change=lambda: self.publish(flush=True))
        self._ready = True

    def release(self, req_ids) -> None:
        for rid in req_ids:
            self.active.pop(rid, None)
            self.store.release(rid)
        self.publish()

    def publish(self, flush: bool = False) -> None:
        """Counters and store state to `/metrics` (host ints; the metrics thread writes them within 0.2 s, or now
        with `flush`: the shared-tier counters, which a publish-only request waits on, are flushed as they move)."""
        worker_stats().set_pic({**self.counters, **self.store.stats()}, flush=flush)

    def admit(self, runner, rid: str, params, prompt_token_ids) -> None:
        """A request entering the batch (new, or resumed after preemption): keep its layout if it has one."""
        if params is None or prompt_token_ids is None:
            return
        try:
            layout = parse_layout(params.extra_args, len(prompt_token_ids))
        except PICError as e:  # the frontend refuses these; never let one stop the worker
            logger.warning("request %s served without PIC: %s", rid, e)
            return
        if layout is None:
            return
        self._setup(runner)
        salt = (params.extra_args or {}).get(POOL_SALT_FIELD)
        keys = {}
        for i, a, n in layout.middle():
            ids = tuple(prompt_token_ids[a:a + n])
            keys[i] = (segment_key(ids, self.fingerprint, salt), ids)
        self.active[rid] = RequestPIC(layout, keys, "private" if salt else "public")

    # ---- planning (host, once per step) --------------------------------------------------------------
    def plan(self, runner) -> StepPlan | None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        qsl = runner.query_start_loc.np[:num_reqs + 1]
        recompute = None
        splices, cold, entries = [], {}, {}
        stats = dict(segments_hit=0, segments_cold=0, tokens_reused=0, tokens_recomputed=0)
        if not self.active:
            return None
        prefilled = []
        for rid, info in self.active.items():
            i = batch.req_id_to_index.get(rid)
            if i is None:  # not scheduled this step
                continue
            start, count = int(batch.num_computed_tokens_cpu[i]), int(qsl[i + 1] - qsl[i])
            spliced_here = 0
            for seg, a, _ in info.layout.middle():
                lo, hi = info.layout.spliced_span(seg)
                lo, hi = max(lo, start), min(hi, start + count)
                if lo >= hi:
                    continue
                key, ids = info.keys[seg]
                if key not in entries and key not in cold:
                    entry = self.store.lookup(info.pool, key, ids, rid) or self._from_shared(info.pool, key, ids, rid)
                    if entry is None:
                        cold[key] = (ids, info.pool, [])
                    else:
                        entries[key] = entry
                elif key in entries:
                    self.store.lookup(info.pool, key, ids, rid)  # pin for this request too
                if seg not in info.seen:  # once per request, though chunks may splice it in several steps
                    info.seen.add(seg)
                    stats["segments_cold" if key in cold else "segments_hit"] += 1
                if key in cold:
                    cold[key][2].append(rid)
                rows = np.arange(lo, hi) - start + qsl[i]
                if recompute is None:
                    recompute = np.ones(int(qsl[num_reqs]), dtype=bool)
                recompute[rows] = False
                splices.append(Splice(key, rows, np.arange(lo, hi) - a, a))
                spliced_here += hi - lo
            if start + count >= info.layout.prompt_len:
                prefilled.append(rid)  # decode rows need no planning; its pins stay until it finishes
            prompt_rows = max(0, min(start + count, info.layout.prompt_len) - start)
            stats["tokens_reused"] += spliced_here
            stats["tokens_recomputed"] += prompt_rows - spliced_here
        for rid in prefilled:
            del self.active[rid]
        if recompute is None:
            if stats["tokens_recomputed"]:
                self._count(stats)
            return None
        return StepPlan(recompute, splices, cold, entries, stats)

    def _from_shared(self, pool: str, key: str, ids: tuple, rid: str):
        """A segment missing from this instance's store, from the second tier into the first (pinned), or None.

        Every failure costs a recompute: a missing entry, a storage error (logged), an entry refused as
        truncated, corrupt or foreign (logged, and left for its writer's next publish to replace).
        """
        if self.shared is None:
            return None
        try:
            data = self.shared.get(key)
        except OSError as e:
            self.counters["shared_errors"] += 1
            logger.warning("PIC shared tier %s: cannot read segment %s (%s); recomputing it", self.shared.url,
                           key[:12], e)
            return None
        if data is None:
            self.counters["shared_misses"] += 1
            return None
        try:
            kv = decode_entry(data, key, self.fingerprint, pool, ids)
            if kv.keys() != self.kv_layers.keys():
                raise SharedEntryError("foreign entry: other attention layers")
        except SharedEntryError as e:
            self.counters["shared_refused"] += 1
            logger.warning("PIC shared tier %s: refused segment %s: %s; recomputing it", self.shared.url, key[:12], e)
            return None
        device = next(iter(self.kv_layers.values())).kv_cache.device
        kv = {name: (k.to(device), v.to(device), first) for name, (k, v, first) in kv.items()}
        self.counters["shared_hits"] += 1
        self.counters["shared_bytes_read"] += len(data)
        return self.store.insert(pool, key, ids, kv, rid)

    def _count(self, stats: dict) -> None:
        for k, v in stats.items():
            self.counters[k] += v
        self.publish()

    # ---- execution ---------------------------------------------------------------------------------
    def forward(self, runner, plan: StepPlan, input_ids, positions, inputs_embeds, model_kwargs):
        if plan.cold:
            # The compiled model runs without guards: its inputs keep the dtypes it was traced with.
            self._isolated_pass(runner, plan, input_ids.dtype, positions.dtype)
        self._splice(plan, positions)
        rows = torch.from_numpy(np.flatnonzero(plan.recompute)).to(positions.device)
        hidden = self._recompute_pass(runner, plan, rows, input_ids, positions, inputs_embeds, model_kwargs)
        self._count(plan.stats)
        return hidden

    def _call_model(self, runner, metadata, slots, input_ids, positions, inputs_embeds, model_kwargs):
        """Run the model on a virtual batch: this step's forward context with `metadata` and `slots` instead."""
        with forward_context.overridden(metadata, slots):
            return runner.model(input_ids=input_ids, positions=positions, intermediate_tensors=None,
                                inputs_embeds=inputs_embeds, **model_kwargs)

    def _splice(self, plan: StepPlan, positions: torch.Tensor) -> None:
        """Write every spliced row's stored K/V (K rotated to its new start) into its slots, layer by layer."""
        step_slots = forward_context.slot_mapping()
        rows = torch.from_numpy(np.concatenate([s.rows for s in plan.splices])).to(positions.device)
        starts = torch.from_numpy(np.concatenate([np.full(len(s.rows), s.start) for s in plan.splices]))
        starts = starts.to(positions.device, positions.dtype)
        for name, layer in self.kv_layers.items():
            ks, vs, take = [], [], []
            for s in plan.splices:
                k, v, first = plan.entries[s.key].kv[name]
                keep = s.offsets >= first  # a windowed layer stores (and splices) only a segment's tail
                ks.append(k[torch.from_numpy(s.offsets[keep] - first)])
                vs.append(v[torch.from_numpy(s.offsets[keep] - first)])
                take.append(keep)
            take = torch.from_numpy(np.concatenate(take)).to(rows.device)
            k, v = torch.cat(ks), torch.cat(vs)
            if k.shape[0] == 0:
                continue
            rope = self.ropes[name]
            if rope is not None:
                k = rotate_by(rope, k.reshape(k.shape[0], -1), starts[take]).view(k.shape)
            write_kv_unobserved(layer, k, v, step_slots[name][rows[take]])

    def _recompute_pass(self, runner, plan, rows, input_ids, positions, inputs_embeds, model_kwargs):
        num_reqs = runner.input_batch.num_reqs
        qsl = runner.query_start_loc.np[:num_reqs + 1]
        pos_np = positions.cpu().numpy() if positions.device.type != "cpu" else positions.numpy()
        keep = plan.recompute
        # Runs of consecutive recomputed rows of one request are the virtual requests.
        v_req, v_start, v_end = [], [], []
        for i in range(num_reqs):
            r = np.flatnonzero(keep[qsl[i]:qsl[i + 1]]) + qsl[i]
            if len(r) == 0:
                continue
            breaks = np.flatnonzero(np.diff(r) != 1) + 1
            for run in np.split(r, breaks):
                v_req.append(i)
                v_start.append(run[0])
                v_end.append(run[-1] + 1)
        n = int(keep.sum())
        if n == 0:  # every row of this step is spliced: no layer runs at all
            return positions.new_zeros((positions.shape[0], runner.model_config.get_hidden_size()),
                                       dtype=runner.model_config.dtype)
        lens = np.array(v_end) - np.array(v_start)
        v_qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        seq_lens = np.array([pos_np[e - 1] + 1 for e in v_end], dtype=np.int32)
        # Logits rows, in the subset's numbering: each request's last scheduled row and, before it, one row per
        # speculative draft token, which vLLM also samples (gpu_model_runner.py `_calc_spec_decode_metadata`), or
        # every row of a request that asks for prompt logprobs. HySparse2's early exit runs its cross-decoder on
        # these rows only.
        new_index = np.full(len(keep), -1)
        new_index[np.flatnonzero(keep)] = np.arange(n)
        drafts = np.array([len(self.drafts.get(rid, ())) for rid in runner.input_batch.req_ids[:num_reqs]])
        counts = logits_row_counts(runner, drafts)
        logits = new_index[last_rows(qsl[1:].astype(np.int64), counts)]
        logits = logits[logits >= 0]
        if len(logits) == 0:  # every request's last row is spliced; the cross-decoder still needs one row
            logits = np.array([n - 1])
        tables = step_block_tables(runner, v_req, rows, forward_context.slot_mapping())
        metadata, slots = build_attention_metadata(runner, v_qsl, seq_lens, positions[rows], tables, logits,
                                                   max_logits=int(counts.max(initial=1)))
        ids = input_ids[rows] if input_ids is not None else None
        embeds = inputs_embeds[rows] if inputs_embeds is not None else None
        out = self._call_model(runner, metadata, slots, ids, positions[rows], embeds, model_kwargs)
        full = out.new_zeros((positions.shape[0], out.shape[-1]))  # rows past `keep` are padding
        full[rows] = out
        return full

    # ---- isolated pass ------------------------------------------------------------------------------
    def _scratch_caches(self, pages: int) -> dict[str, torch.Tensor]:
        """One scratch cache of `pages` kernel pages (page 0: the null block) per KV-owning layer.

        Per layer, not per vLLM tensor: vLLM may back layers of different KV cache groups with one
        tensor, which their disjoint block ids keep apart; the isolated pass gives every group the
        same scratch block ids, so each layer needs its own.
        """
        for name, layer in self.kv_layers.items():
            scratch = self._scratch.get(name)
            if scratch is None or scratch.shape[0] < pages:
                self._scratch[name] = layer.kv_cache.new_zeros((pages, *layer.kv_cache.shape[1:]))
        return self._scratch

    def _isolated_pass(self, runner, plan: StepPlan, ids_dtype: torch.dtype, pos_dtype: torch.dtype) -> None:
        budget = runner.scheduler_config.max_num_batched_tokens
        groups = runner.kv_cache_config.kv_cache_groups
        block = groups[0].kv_cache_spec.block_size
        if any(g.kv_cache_spec.block_size != block for g in groups):
            raise RuntimeError("PIC needs one block size across KV cache groups")
        # Kernel pages per manager block (the cache tensors are in kernel pages).
        any_cache = next(iter(self.kv_layers.values())).kv_cache
        per_block = block // any_cache.shape[2]
        segments = list(plan.cold.items())
        base, first_block = {}, 1  # block 0 is the scratch's null block
        for key, (ids, _, _) in segments:
            base[key] = first_block
            first_block += -(-len(ids) // block)
        scratch = self._scratch_caches(first_block * per_block)
        # Pieces (segment, lo, hi) packed into passes of at most `budget` rows; one segment's pieces stay in order.
        passes, current, room = [], [], budget
        for key, (ids, _, _) in segments:
            lo = 0
            while lo < len(ids):
                take = min(room, len(ids) - lo)
                current.append((key, lo, lo + take))
                lo += take
                room -= take
                if room == 0:
                    passes.append(current)
                    current, room = [], budget
        if current:
            passes.append(current)
        captured = {key: {} for key, _ in segments}
        caches = {}
        for name, layer in forward_context.attention_layers().items():
            owner = name if name in scratch else getattr(layer, "kv_sharing_target_layer_name", None)
            if owner in scratch:  # KV-sharing layers read their target's scratch
                caches[layer] = scratch[owner]
        with swapped_kv_caches(caches):
            for pieces in passes:
                self._run_isolated(runner, plan, pieces, base, block, captured, ids_dtype, pos_dtype)
        for key, (ids, pool, rids) in segments:
            kv = {name: self._stored_rows(name, torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts]))
                  for name, parts in captured[key].items()}
            entry = self.store.insert(pool, key, ids, kv, rids[0])
            for rid in rids[1:]:
                self.store.lookup(pool, key, ids, rid)
            plan.entries[key] = entry
            if self.publisher is not None:  # written by the publisher's thread, off this step
                self.counters["shared_queued"] += 1
                self.publisher.submit(key, self.fingerprint, pool, ids, kv)
        if self.publisher is not None and segments:
            self.publish(flush=True)  # the queued count is on file before this step's outputs leave the worker

    def _stored_rows(self, name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(K, V, first offset) a layer keeps of a segment.

        A sliding-window layer keeps the last `window - 1` rows only: the
        rows after the segment's seam are spliced, never recomputed, so the
        only rows that read this layer's K/V of the segment are later ones
        (next seams, the query), and their windows reach no further back.
        """
        window = self.windows[name]
        first = 0 if window is None else max(0, k.shape[0] - (window - 1))
        return k[first:].clone(), v[first:].clone(), first

    def _run_isolated(self, runner, plan, pieces, base, block, captured, ids_dtype, pos_dtype) -> None:
        device = runner.device
        pos = np.concatenate([np.arange(lo, hi) for _, lo, hi in pieces])
        ids = torch.as_tensor(np.concatenate([np.asarray(plan.cold[k][0][lo:hi]) for k, lo, hi in pieces]),
                              dtype=ids_dtype, device=device)
        lens = np.array([hi - lo for _, lo, hi in pieces])
        v_qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        seq_lens = np.array([hi for _, _, hi in pieces], dtype=np.int32)
        max_pages = max(-(-hi // block) for _, _, hi in pieces)
        table = torch.zeros((len(pieces), max_pages), dtype=torch.int32)
        for j, (key, _, hi) in enumerate(pieces):
            table[j, :-(-hi // block)] = torch.arange(base[key], base[key] + -(-hi // block), dtype=torch.int32)
        slot_np = np.concatenate([(base[k] + np.arange(lo, hi) // block) * block + np.arange(lo, hi) % block
                                  for k, lo, hi in pieces])
        slot = torch.as_tensor(slot_np, dtype=torch.int64, device=device)
        positions = torch.as_tensor(pos, dtype=pos_dtype, device=device)
        tables = {gid: (table.to(device), slot) for gid in range(len(runner.kv_cache_config.kv_cache_groups))}
        logits = v_qsl[1:] - 1
        metadata, slots = build_attention_metadata(runner, v_qsl, seq_lens, positions, tables, logits)
        self.tap.capture = {}
        try:
            self._call_model(runner, metadata, slots, ids, positions, None, {})
            taken = self.tap.capture
        finally:
            self.tap.capture = None
        for name, writes in taken.items():
            k = torch.cat([w[0] for w in writes])
            v = torch.cat([w[1] for w in writes])
            for j, (key, lo, hi) in enumerate(pieces):
                a, b = int(v_qsl[j]), int(v_qsl[j + 1])
                captured[key].setdefault(name, []).append((k[a:b], v[a:b]))


class PICRunnerMixin:
    """Mixed into vLLM's model runner class by our worker (see `vllm_hysparse.pic.worker`)."""

    def _pic(self) -> PICEngine:
        engine = getattr(self, "_pic_engine", None)
        if engine is None:
            engine = self._pic_engine = PICEngine(self)
        return engine

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        engine = self._pic()
        done = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        if done:
            engine.release(done)
        engine.drafts = scheduler_output.scheduled_spec_decode_tokens
        for new in scheduler_output.scheduled_new_reqs:
            engine.admit(self, new.req_id, new.sampling_params, new.prompt_token_ids)
        for rid in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            state = self.requests.get(rid)
            if state is not None:
                engine.admit(self, rid, state.sampling_params, state.prompt_token_ids)
        return super().execute_model(scheduler_output, intermediate_tensors)

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        engine = self._pic()
        plan = engine.plan(self) if intermediate_tensors is None and forward_context.attn_metadata() else None
        if plan is None:
            return super()._model_forward(input_ids=input_ids, positions=positions,
                                          intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                                          **model_kwargs)
        return engine.forward(self, plan, input_ids, positions, inputs_embeds, model_kwargs)
