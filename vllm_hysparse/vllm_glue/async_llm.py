# SPDX-License-Identifier: Apache-2.0
"""vLLM's async engine client (vllm/v1/engine/async_llm.py): what the OpenAI server's `AsyncLLM` reads of its config.

`AsyncLLM.add_request` refuses every request with `prompt_logprobs` while
`cache_config.kv_sharing_fast_prefill` is on, before any hook of ours runs. HySparse2's
runner serves them per request under its early exit (`runner.FastPrefillPromptLogprobsMixin`),
so the server's own view of the config is given the switch off: the engine core and its
workers keep theirs (a copy in their own process, or the original object in-process).
"""

import copy
from collections.abc import Callable


def wrap_async_llm_config(flag: str, api_view: Callable) -> None:
    """After `AsyncLLM.__init__`, set `self.vllm_config = api_view(vllm_config)` where that is not None. Idempotent.

    Replaces the class attribute `AsyncLLM.__init__`; depends on `add_request` reading
    `self.vllm_config.cache_config.kv_sharing_fast_prefill` (vllm/v1/engine/async_llm.py) and on every
    consumer that __init__ builds (engine core, input processor, renderer) having taken the original.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.__init__
    if getattr(original, flag, False):
        return

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        view = api_view(vllm_config)
        if view is not None:
            self.vllm_config = view

    __init__.__wrapped__ = original
    setattr(__init__, flag, True)
    AsyncLLM.__init__ = __init__


def without_fast_prefill(vllm_config):
    """A shallow copy of `vllm_config` whose `cache_config` (copied too) has `kv_sharing_fast_prefill` off;
    every other part is shared with the original, so changes to them reach both."""
    cache_config = copy.copy(vllm_config.cache_config)
    cache_config.kv_sharing_fast_prefill = False
    view = copy.copy(vllm_config)
    view.cache_config = cache_config
    return view
