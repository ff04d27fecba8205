"""`wcache switch URL` for a served reference engine: POST /v1/weights with the engine's control token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wcache.serving.client import EngineRequestError, call_engine
from wcache.serving.credentials import control_token


def switch_served_reference(url: str, model: Path | None, daemon: str | None) -> dict[str, Any] | None:
    """The engine's answer to the switch (a SwitchAnswer's wire form); None when the engine at `url` has no
    /v1/weights (it is no reference engine). `model` is absolute: the engine resolves paths in its own working
    directory."""
    body: dict[str, str] = {}
    if model is not None:
        body["model"] = str(model)
    if daemon is not None:
        body["daemon"] = daemon
    try:
        return call_engine(url, "POST", "/v1/weights", body, token=control_token(url))
    except EngineRequestError as exc:
        if exc.status != 404:
            raise
        return None
