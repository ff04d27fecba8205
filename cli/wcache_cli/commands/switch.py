"""`wcache switch`: move a served engine (wcache's reference engine, or vLLM's OpenAI server) to another daemon's
weights without a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from wcache.errors import BadInputError

from wcache_cli.output import out
from wcache_cli.params import DaemonOpt, JsonOpt


def switch(
    url: Annotated[str, typer.Argument(help="The engine's URL (http://HOST:PORT), as `attach --serve` prints it.",
                                       show_default=False)],
    model: Annotated[
        Path | None,
        typer.Argument(help="Checkpoint to serve from the next request on (directory, .safetensors file or repo "
                       "id); optional with --daemon, whose checkpoint it then is.", show_default=False,
                       readable=False),
    ] = None,
    daemon: DaemonOpt = None,
    json: JsonOpt = False,
) -> None:
    """Switch a served engine to the weights a daemon holds for MODEL, between requests.

    The engine is wcache's reference engine or vLLM's OpenAI server; vLLM must run with
    VLLM_SERVER_DEV_MODE=1, whose endpoints pause it, reload its weights in place through the wcache load
    format and reset its prefix cache. The request running finishes on the old weights; the next one runs on
    the new. The switch never falls back to disk: when no daemon holds MODEL's key under the engine's plan it
    is refused with the reason (exit 3) and the engine keeps serving its old weights. So is a vLLM server at
    tensor parallel > 1, whose in-place reload cannot take a rank's shards: restart it on the daemon instead
    (wcache serve --follow does).
    """
    from wcache.serving.api import SwitchAnswer
    from wcache.serving.client import read_answer

    if model is None and daemon is None:
        raise BadInputError("name the weights to switch to: MODEL, --daemon, or both.")
    if model is not None:
        from wcache.checkpoint.model_path import resolve_model_path

        # Absolute: the engine resolves paths in its own working directory, not this shell's.
        model = resolve_model_path(model).absolute()
    result = _switch(url, model, daemon)
    answer = read_answer(SwitchAnswer, result, url)
    if json:
        out.json(result)
        return
    previous, current = answer.previous, answer.current
    out.print(f"SWITCHED {url}: {previous.key_id} → {current.key_id} ({current.model}, daemon "
              f"{answer.attach.daemon}) in {answer.switch_ms:.1f} ms")


def _switch(url: str, model: Path | None, daemon: str | None) -> dict[str, Any]:
    """The answer of the first engine of the registry that recognizes the engine at `url` as its own."""
    from wcache.integrations.registry import not_served, served_switchers
    from wcache.serving.client import engine_base_url

    for switcher in served_switchers():
        result = switcher(url, model, daemon)
        if result is not None:
            return result
    raise not_served(engine_base_url(url))
