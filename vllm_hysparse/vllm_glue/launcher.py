# SPDX-License-Identifier: Apache-2.0
"""vLLM's OpenAI API server app (vllm/entrypoints/launchers/app.py): middleware of our own, innermost.

`build_app` adds vLLM's middleware (`init_entrypoints_middleware`, defined in
vllm/entrypoints/serve/middleware/register.py) after every router; `--middleware`
classes go outside vLLM's `AuthenticationMiddleware`. Middleware added before
that call is the innermost one, so it runs after authentication, CORS and the
rest; vLLM has no hook there, so the module global `build_app` calls is replaced.
"""

import sys

_APP_MODULE = "vllm.entrypoints.launchers.app"


def add_api_server_middleware(flag: str, middleware: type, task: str) -> None:
    """Add `middleware` to every API server app this process builds that serves `task`, innermost. Idempotent.

    Only acts in a process that has already imported vLLM's app module (`vllm serve`
    has by the time plugins load); elsewhere (engine core, workers, offline `LLM`)
    it does nothing and imports nothing. Changes the module global
    `init_entrypoints_middleware` of vllm/entrypoints/launchers/app.py, which
    `build_app(args, ..., supported_tasks)` calls as `(args, app, supported_tasks)`.
    """
    app_module = sys.modules.get(_APP_MODULE)
    if app_module is None:
        return
    original = app_module.init_entrypoints_middleware
    if getattr(original, flag, False):
        return

    def init_entrypoints_middleware(args, app, supported_tasks):
        if task in supported_tasks:
            # Added before vLLM's own middleware, so it is the innermost: after authentication.
            app.add_middleware(middleware)
        return original(args, app, supported_tasks)

    init_entrypoints_middleware.__wrapped__ = original
    setattr(init_entrypoints_middleware, flag, True)
    app_module.init_entrypoints_middleware = init_entrypoints_middleware


# What middleware of ours reads of the API server: the app state vLLM's launcher fills
# (`init_app_state`, vllm/entrypoints/launchers/api_server/app_state.py) and its authentication and error helpers.


def served_state(scope):
    """The API server app's `state` for an ASGI `scope`, or None."""
    return getattr(scope.get("app"), "state", None)


def served_vllm_config(state):
    """The served engine's `VllmConfig` (`app.state.vllm_config`), or None before the launcher sets it."""
    return getattr(state, "vllm_config", None)


def served_tokenizer(state):
    """The served engine's tokenizer (`app.state.engine_client.renderer`)."""
    return state.engine_client.renderer.get_tokenizer()


def request_authorized(scope, state) -> bool:
    """vLLM's own API-key check (`AuthenticationMiddleware.verify_token`,
    vllm/entrypoints/serve/middleware/authenticate.py), or True without `--api-key`."""
    from starlette.datastructures import Headers
    from vllm import envs
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    args = getattr(state, "args", None)
    tokens = [k for k in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if k]
    return not tokens or AuthenticationMiddleware(None, tokens).verify_token(Headers(scope=scope))


def validation_error_response(message: str, parameter: str):
    """vLLM's 400 JSON `ErrorResponse` for a `VLLMValidationError` naming `parameter`, as an ASGI app
    (`create_error_response`, vllm/entrypoints/serve/exception_handling/error_response.py)."""
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMValidationError

    err = create_error_response(VLLMValidationError(message, parameter=parameter))
    return JSONResponse(content=err.model_dump(), status_code=err.error.code)
