# SPDX-License-Identifier: Apache-2.0
"""HySparse2 in the real vLLM engine (CPU, float32) against the reference model.

The tiny preset selects 16 tokens + a recent window of 16 (so prompts of 32 and
more tokens are genuinely sparse in the cross-decoder) and its self-decoder
slides a 32-token window. Prefill early exit is on by default.
"""

import os
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.vllm_utils import (
    Completion,
    check_logprobs_close,
    env_without,
    kv_cache_layout,
    make_llm,
    random_prompts,
    reference_greedy,
    shutdown,
    vllm_greedy,
)
from vllm_hysparse.models.config_hooks import EARLY_EXIT_ENV
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

LENGTHS = [1, 15, 16, 17, 31, 32, 33, 48, 100, 300]
MAX_TOKENS = 8


# A prompt row whose k-th and (k+1)-th best candidates by R lie closer than this (relative) is a near tie: float32
# rounding in the engine may pick the other token, and that row's logits then legitimately differ from the reference.
NEAR_TIE = 1e-4


def reference_with_margins(reference, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the reference over `prompt`: its log-probabilities `[T, V]` float64 and, per prompt row, the
    smallest relative gap `[T]` float64 between the k-th and (k+1)-th largest R among the candidates outside the
    window, over every cross full layer and KV group (inf where a row has no more than k candidates). The gaps are
    recorded by wrapping `ops.token_topk`, which the reference calls."""
    from unittest import mock

    from vllm_hysparse.reference import ops

    margins = torch.full((len(prompt),), float("inf"), dtype=torch.float64)
    original = ops.token_topk

    def recording(q, k, scale, topk_tokens, recent_window, reduce="max", forced_window=True, positions=None):
        assert forced_window, "the tiny preset forces the window"
        tq, tk = q.shape[1], k.shape[1]
        r = ops.reduce_heads(ops.sink_softmax(ops.attention_logits(q, k, scale, positions), None), k.shape[2], reduce)
        t = ops.query_positions(tq, tk, None, positions)
        outside = torch.arange(tk)[None, :] <= t[:, None] - recent_window  # causal and older than the window
        s = torch.sort(r.double().masked_fill(~outside, -1.0), dim=-1, descending=True).values
        s = torch.nn.functional.pad(s, (0, max(0, topk_tokens + 1 - tk)), value=-1.0)  # short prompts
        kth, next_ = s[..., topk_tokens - 1], s[..., topk_tokens]  # [B, G, Tq]
        gap = torch.where(next_ >= 0, (kth - next_) / kth, torch.inf).amin(dim=(0, 1))
        margins[t] = torch.minimum(margins[t], gap)
        return original(q, k, scale, topk_tokens, recent_window, reduce, forced_window, positions)

    with mock.patch.object(ops, "token_topk", recording), torch.no_grad():
        logits = reference(torch.tensor([prompt]), use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), -1), margins


def _worker_pid(worker) -> int:
    import os

    return os.getpid()


def _queries(llm) -> int:
    """This engine's worker's counter (other engines of this test session publish beside it)."""
    import json
    import os
    from pathlib import Path

    from vllm_hysparse.metrics import METRICS_DIR_ENV

    pid = llm.collective_rpc(_worker_pid)[0]
    time.sleep(0.6)  # the worker publishes within 0.2 s of a change: let earlier steps land first
    path = Path(os.environ[METRICS_DIR_ENV]) / f"worker-{pid}.json"
    return json.loads(path.read_text())["queries"] if path.exists() else 0


@pytest.fixture(scope="module")
def ckpt(tiny_model):
    return tiny_model("hysparse2")[0]


@pytest.fixture(scope="module")
def reference(tiny_model):
    return tiny_model("hysparse2")[1]


@pytest.fixture(scope="module")
def prompts(reference):
    return random_prompts(LENGTHS, reference.config.vocab_size, seed=7)


@pytest.fixture(scope="module")
def expected(reference, prompts):
    return reference_greedy(reference, prompts, MAX_TOKENS)


@pytest.fixture(scope="class")
def llm(shared_engine):
    return shared_engine("hysparse2")[0]  # the canonical engine (tests/conftest.py), early exit on


class TestEarlyExitEngine:
    """One eager engine with early exit for these tests, shut down before the engines of the tests below start (one
    in-process engine at a time)."""

    def test_early_exit_matches_reference_with_chunked_prefill(self, llm, prompts, expected):
        check_logprobs_close(expected, vllm_greedy(llm, prompts, MAX_TOKENS))

    def test_early_exit_runs_cross_decoder_on_logits_rows_only(self, llm, reference):
        cfg = reference.config
        n_cross_full = len(cfg.cross_full_layers)
        prompt = random_prompts([200], cfg.vocab_size, seed=8)
        before = _queries(llm)
        vllm_greedy(llm, prompt, 3)
        # The 200-token prompt runs in 4 chunks (64-token steps), then 2 decode steps: at most one
        # logits row per step (4 + 2) per cross full layer and KV group, against 202 rows without
        # early exit. The bound leaves room for a straggling publish from an earlier step.
        rows = (_queries(llm) - before) / (n_cross_full * cfg.num_key_value_heads)
        assert 3 <= rows <= 12, rows

    def test_prefix_cache_hits_match_reference(self, llm, reference, prompts):
        long_prompt = prompts[-1]
        shared = [long_prompt, long_prompt, long_prompt[:250] + prompts[-2][:40]]
        got = [vllm_greedy(llm, [p], MAX_TOKENS)[0] for p in shared]
        check_logprobs_close(reference_greedy(reference, shared, MAX_TOKENS), got)

    def test_concurrent_requests(self, llm, reference):
        lengths = [int(n) for n in torch.randint(1, 150, (16,), generator=torch.Generator().manual_seed(9))]
        many = random_prompts(lengths, reference.config.vocab_size, seed=10)
        check_logprobs_close(reference_greedy(reference, many, 4), vllm_greedy(llm, many, 4))

    def test_prompt_logprobs_per_request_with_early_exit(self, llm, reference):
        """A mixed batch under early exit: the requests that ask get every prompt row through the cross-decoder,
        exactly (chunked: 64-token steps), and the others still exit early."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seed = int(os.environ.get("HYSPARSE_PROMPT_LOGPROBS_SEED", random.SystemRandom().randrange(2**31)))
        print(f"seed {seed} (HYSPARSE_PROMPT_LOGPROBS_SEED replays it)")
        cfg = reference.config
        lengths = [150, 90, 120, 40, 200, 3]
        asks = [1, None, 0, None, None, 2]  # prompt_logprobs per request: None asks for none
        batch = random_prompts(lengths, cfg.vocab_size, seed=seed)
        params = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True, prompt_logprobs=k)
                  for k in asks]
        before = _queries(llm)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        rows = (_queries(llm) - before) / (len(cfg.cross_full_layers) * cfg.num_key_value_heads)
        checked = ties = 0
        for prompt, k, out in zip(batch, asks, outs, strict=True):
            if k is None:
                assert out.prompt_logprobs is None
                continue
            want, margins = reference_with_margins(reference, prompt)
            tied = margins < NEAR_TIE  # row pos - 1 predicts token pos
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
            for pos in range(1, len(prompt)):
                got = out.prompt_logprobs[pos]
                if tied[pos - 1]:
                    ties += 1
                    continue
                assert abs(got[prompt[pos]].logprob - float(want[pos - 1, prompt[pos]])) < 2e-3, (pos, k)
                top = torch.topk(want[pos - 1], k).indices.tolist() if k else []
                assert set(top) <= set(got), (pos, top, sorted(got))  # the k most likely, beside the actual token
                checked += 1
        print(f"prompt logprobs: {checked} positions match the reference, {ties} near ties in the selection skipped")
        assert checked + ties == sum(n - 1 for n, k in zip(lengths, asks) if k is not None) and ties <= 10
        expected = reference_greedy(reference, batch, 4)
        got = [Completion(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                                          for step in o.outputs[0].logprobs]) for o in outs]
        assert check_logprobs_close(expected, got, min_matched=1.0) == 4 * len(batch)
        # Every prompt row of the three that ask, plus one row per step for each other request (about 10 prefill
        # steps of 64 tokens, then 3 decode steps): without early exit their 330 prompt rows would add.
        asked = sum(n for n, k in zip(lengths, asks) if k is not None)
        assert asked <= rows <= asked + 100, (rows, asked)
        # The engine keeps serving.
        assert len(vllm_greedy(llm, batch[:1], 2)[0].token_ids) == 2

    def test_kv_cache_matches_spec(self, llm, reference):
        """SPEC §3.4: full-length caches for self full layers and one per bridged cross full layer only."""
        cfg = reference.config
        layout = llm.collective_rpc(kv_cache_layout)[0]
        owners = {n for g in layout["groups"] if g["type"] == "FullAttentionSpec" for n in g["layers"]}
        owners -= set(layout["shared"])
        self_full = [i for i in range(cfg.num_self_decoder_layers) if cfg.layer_types[i] == "full_attention"]
        assert owners == ({f"model.layers.{i}.self_attn.attn" for i in self_full}
                          | {f"model.bridges.{c}.attn" for c in cfg.cross_full_layers})
        cross = range(cfg.num_self_decoder_layers, cfg.num_hidden_layers)
        targets = {i: f"model.bridges.{i if cfg.layer_types[i] == 'full_attention' else cfg.oracle_layer[i]}.attn"
                   for i in cross}
        assert layout["shared"] == {f"model.layers.{i}.self_attn.attn": t for i, t in targets.items()}
        windowed = {n for g in layout["groups"] if g["type"] == "SlidingWindowSpec" for n in g["layers"]}
        assert windowed == {f"model.layers.{i}.self_attn.attn" for i, t in enumerate(cfg.layer_types)
                            if t == "sliding_attention"}

    def test_self_decoder_layers_run_our_tiled_roles(self, llm, reference):
        """On the CPU in float32 the self-decoder's full layers run our `dense` role on the C++ / PyTorch path (a
        prompt shared by several decode rows is read once, `csrc_triton/dense.py`), its sliding layers our `window`
        role (the C++ window walk, `csrc_triton/window.py`)."""
        cfg = reference.config
        backends = llm.collective_rpc(attention_backends)[0]
        for i in range(cfg.num_self_decoder_layers):
            full = cfg.layer_types[i] == "full_attention"
            want = ("HYSPARSE", "dense" if full else "window", "torch")
            assert backends[f"model.layers.{i}.self_attn.attn"] == want, i
        assert sum(cfg.layer_types[i] == "sliding_attention" for i in range(cfg.num_self_decoder_layers)) >= 1


def attention_backends(worker) -> dict[str, tuple]:
    """Runs in the worker: (backend name, HySparse role, kernel path) of every attention layer."""
    ctx = worker.model_runner.compilation_config.static_forward_context
    return {name: (layer.attn_backend.get_name(), getattr(layer.impl, "role", None),
                   getattr(layer.impl, "kernels", None))
            for name, layer in ctx.items() if getattr(layer, "attn_backend", None) is not None}


@pytest.fixture
def no_exit_llm(ckpt, monkeypatch):
    # For this test only: a module-wide setting would also turn early exit off for the engines of the tests below.
    monkeypatch.setenv(EARLY_EXIT_ENV, "0")
    engine = make_llm(ckpt, enforce_eager=True, block_size=32, max_num_batched_tokens=64)
    yield engine
    shutdown(engine)


def test_without_early_exit_matches_reference_and_serves_prompt_logprobs(no_exit_llm, reference, prompts,
                                                                          expected):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    check_logprobs_close(expected, vllm_greedy(no_exit_llm, prompts, MAX_TOKENS))
    prompt = prompts[-2]
    out = no_exit_llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                               SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt]), use_cache=False).logits[0].double()
    want = torch.log_softmax(logits, -1)
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert abs(got - float(want[pos - 1, prompt[pos]])) < 2e-3, pos


def test_compiled_early_exit_matches_reference(ckpt, prompts, expected):
    # Early exit's row selection traced by dynamo with guards dropped (a frozen branch would show here), and compiled
    # by inductor as served. Not dynamo-only (`make_llm(inductor=False)`): that engine core dies at its first forward
    # with "free(): invalid size" (seen 2026-12-03, as for MoE in test_moe.py), and `LLM.generate` waits forever.
    engine = make_llm(ckpt)
    try:
        check_logprobs_close(expected, vllm_greedy(engine, prompts, MAX_TOKENS))
    finally:
        shutdown(engine)


@pytest.mark.parametrize("overrides", [
    # NoPE -> RoPE on full/sparse layers, summed head scores, two bridge sources.
    {"full_rope": True, "score_head_reduce": "sum", "num_key_value_heads": 2,
     "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention",
                     "sparse_attention", "full_attention", "sparse_attention"],
     "num_self_decoder_layers": 3, "bridge_sources": [2, 0]},
], ids=["rope-sum-two-sources"])
def test_layout_variants_match_reference(tmp_path, overrides):
    ckpt = write_checkpoint(tmp_path / "variant", "hysparse2", "tiny", overrides=overrides, seed=13)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompts = random_prompts([5, 33, 90, 200], reference.config.vocab_size, seed=11)
    engine = make_llm(ckpt, enforce_eager=True, block_size=32, max_num_batched_tokens=64)
    try:
        got = vllm_greedy(engine, prompts, MAX_TOKENS)
    finally:
        shutdown(engine)
    check_logprobs_close(reference_greedy(reference, prompts, MAX_TOKENS), got)


def test_preemption_matches_reference(ckpt, reference):
    prompts = random_prompts([120] * 5, reference.config.vocab_size, seed=14)
    with env_without("VLLM_CPU_KVCACHE_SPACE"):
        engine = make_llm(ckpt, enforce_eager=True, block_size=32, kv_cache_memory_bytes=10 * 32 * 1024 * 3,
                          max_model_len=256, disable_log_stats=False)
    try:
        got = vllm_greedy(engine, prompts, 100)
        preempted = sum(m.value for m in engine.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        shutdown(engine)
    assert preempted > 0, "the small KV cache should have forced preemption"
    check_logprobs_close(reference_greedy(reference, prompts, 100), got)
