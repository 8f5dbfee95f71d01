# SPDX-License-Identifier: Apache-2.0
"""vLLM's input processor (vllm/v1/engine/input_processor.py): checks on every request before vLLM registers it.

`InputProcessor` turns a prompt and its params into the `EngineCoreRequest`
sent to the engine core, in the offline `LLM`/`LLMEngine` and the OpenAI
server's `AsyncLLM` alike, and it runs before the request is registered with
the output processor: an error raised here reaches the caller (HTTP 400 for
a `VLLMValidationError`) instead of leaving an orphaned request behind.
vLLM has no hook there, so both functions replace a method on the class, for
every processor in this process.
"""

from collections.abc import Callable


def wrap_validate_params(flag: str, check: Callable) -> None:
    """Run `check(vllm_config, params)` before `InputProcessor._validate_params`. Idempotent per `flag`.

    Changes the class attribute `InputProcessor._validate_params`; depends on its
    signature `(self, params, supported_tasks)` and on `self.vllm_config`
    (vllm/v1/engine/input_processor.py). `check` raises to refuse a request.
    """
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, flag, False):
        return

    def _validate_params(self, params, supported_tasks):
        check(self.vllm_config, params)
        return original(self, params, supported_tasks)

    setattr(_validate_params, flag, True)
    InputProcessor._validate_params = _validate_params


def wrap_process_inputs(flag: str, make_check: Callable) -> None:
    """Run a check on every `EngineCoreRequest` that `InputProcessor.process_inputs` returns. Idempotent per `flag`.

    `make_check(vllm_config)` is called once per processor and returns `check(request)` (which may
    change the request in place, or raise to refuse it) or None to pass every request through.
    Changes the class attribute `InputProcessor.process_inputs` and keeps the processor's check in
    its instance `__dict__` under `flag`; depends on `self.vllm_config` (vllm/v1/engine/input_processor.py).
    """
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs
    if getattr(original, flag, False):
        return

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        checks = self.__dict__.get(flag)
        if checks is None:
            checks = self.__dict__[flag] = (make_check(self.vllm_config),)
        if checks[0] is not None:
            checks[0](request)
        return request

    process_inputs.__wrapped__ = original
    process_inputs.__doc__ = original.__doc__
    setattr(process_inputs, flag, True)
    InputProcessor.process_inputs = process_inputs
