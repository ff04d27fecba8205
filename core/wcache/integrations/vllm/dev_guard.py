"""vLLM's development routes behind the engine's control token, for a server `wcache serve --follow` runs.

Following needs vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`: /pause, /collective_rpc, …), which check
nobody, and a loopback address keeps out other hosts but not other users of this one. `wcache serve --follow`
therefore adds this ASGI middleware to its server (vLLM's own `--middleware`): a request that could change what
the server serves, any method but GET or HEAD outside vLLM's serving routes, must carry `Authorization: Bearer
<token>` with the token of the file `WCACHE_ENGINE_TOKEN_FILE` names (the operator's, else one the launcher made in
its run dir, mode 0600); anything else is answered 401 before vLLM sees it. Deny by default: a development or RL
route a later vLLM adds is guarded too. vLLM's `--api-key` guards the serving routes as before.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from wcache.ipc.run_dir.engine_token import operator_token

# Routes that serve requests (completions, tokenizers, pooling): open as vLLM leaves them, whatever the method.
SERVING_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank",
                    "/invocations", "/inference/")
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MIDDLEWARE = f"{__name__}.require_control_token"  # what `--middleware` names

_token: list[str] = []  # read once, on the first guarded request


def guarded(method: str, path: str) -> bool:
    """Whether a request needs the control token: it may change what the server serves."""
    return method.upper() not in READ_METHODS and not path.startswith(SERVING_PREFIXES)


async def require_control_token(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """vLLM's `@app.middleware("http")` function: 401 for a guarded request without the control token."""
    if not guarded(request.method, request.url.path):
        return await call_next(request)
    if not _token:
        token = operator_token()
        if token is None:  # started without a token file: nobody may change what it serves
            return _unauthorized("this server takes no request that changes its weights")
        _token.append(token)
    offered = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(offered.encode(), _token[0].encode()):
        return _unauthorized("this route changes what the server serves: send its control token "
                             "(Authorization: Bearer …)")
    return await call_next(request)


def _unauthorized(error: str) -> Any:
    from starlette.responses import JSONResponse  # vLLM's server brings it: only a server running this imports it

    return JSONResponse({"error": error}, status_code=401)
