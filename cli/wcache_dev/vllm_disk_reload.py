"""A served vLLM's own loader reading a checkpoint from disk in place: the reference a version's tokens must equal.

Through the server's development endpoints, as a switch goes but with vLLM's `auto` load format and no daemon:
pause (running requests finish), point the workers' load format at `auto`, reload from the checkpoint, reset the
prefix cache, resume. Used by the tests and benchmarks of `wcache serve --follow`.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

RELOAD_TIMEOUT_S = 600.0


def _post(url: str, path: str, body: dict[str, object] | None, token: str | None) -> None:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body or {}).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=RELOAD_TIMEOUT_S) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {path} answered {response.status}")


def reload_from_disk(url: str, checkpoint: Path, token: str | None = None) -> None:
    """Have the vLLM server at `url` load `checkpoint` from disk with its own loader, in place (`token`: the control
    token its development routes take, as under `wcache serve --follow`)."""
    _post(url, "/pause?mode=wait&clear_cache=false", None, token)
    try:
        _post(url, "/collective_rpc", {"method": "update_config", "args": [{"load_config": {
            "load_format": "auto", "model_loader_extra_config": {}}}]}, token)
        _post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {
            "weights_path": str(checkpoint), "is_checkpoint_format": True}}, token)
        _post(url, "/reset_prefix_cache", None, token)
    finally:
        _post(url, "/resume", None, token)
