# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests that drive the real vLLM engine on CPU and compare against the reference model."""

import contextlib
import os
from dataclasses import dataclass

import torch

# CPU vLLM needs these before an engine starts (see README); tests share engines
# per module because each start costs 20-60 s.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# Lets tests send a plain function to the worker (`collective_rpc`) to inspect
# what vLLM allocated; only our own processes talk to each other here.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

TOP_LOGPROBS = 5


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, float]]  # per generated position: token id -> logprob (top-k and the chosen one)


def make_llm(model_dir, **kwargs):
    from vllm import LLM

    args = dict(model=str(model_dir), dtype="float32", max_model_len=1024, seed=0)
    args.update(kwargs)
    return LLM(**args)


def vllm_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
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
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
