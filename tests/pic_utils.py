# SPDX-License-Identifier: Apache-2.0
"""PIC requests in the real engine: generate with layouts, the worker's PIC counters, prompts from parts."""

from tests.vllm_utils import TOP_LOGPROBS, Completion
from vllm_hysparse.pic.layout import PICLayout

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
    return llm.collective_rpc(pic_state)[0]


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("segments_hit", "segments_cold", "tokens_reused", "tokens_recomputed")}


def assemble(parts: list[list[int]], seam: int) -> tuple[list[int], PICLayout]:
    return [t for p in parts for t in p], PICLayout(tuple(len(p) for p in parts), seam)
