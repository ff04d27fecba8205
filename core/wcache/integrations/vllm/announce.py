"""Each vLLM rank that runs the `wcache` load format announces itself in the run dir, hit or fallback.

What the reference engine's server writes (`wcache.ipc.run_dir.engines`), so that `wcache top` and `wcache
status` list vLLM engines without being told where they are: the rank's pid, the model, the key, the daemon,
how it attached (a fallback with its reason) and, for a server, the URL of its API, whose `/metrics` they scrape.

The loader runs in vLLM's engine core or a TP worker, never in the API server, so the URL is found where it
can be: `WCACHE_ENGINE_URL` when a launcher (`wcache serve`) set it, else the command line of the vLLM OpenAI
server this process descends from (`vllm serve …`, `python -m vllm.entrypoints.openai.api_server …`: its
`--host` and `--port`, vLLM's defaults otherwise). A server configured another way (`--config FILE`, `--uds`)
announces no URL; an offline `LLM` has none.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path, PurePath

from wcache.checkpoint.display_name import display_name
from wcache.ipc.attach_summary import AttachSummary
from wcache.ipc.run_dir.engines import VLLM_ENGINE, EngineDescriptor, write_engine_descriptor

log = logging.getLogger("vllm.wcache")

URL_VARIABLE = "WCACHE_ENGINE_URL"
# Set to "1" by a launcher that moves its server to the weights' newest version (`wcache serve --follow`).
FOLLOWS_VARIABLE = "WCACHE_ENGINE_FOLLOWS"
# vLLM's OpenAI server's defaults: all interfaces, port 8000.
DEFAULT_PORT = 8000
# Hosts a server listens on that a client reaches on this machine as the loopback address.
_ANY_HOST = {"", "0.0.0.0", "::", "[::]"}
_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# How far up the process tree the server is looked for: API server → engine core → TP worker, and a spare.
MAX_ANCESTORS = 4


def server_url_from_argv(argv: Sequence[str]) -> str | None:
    """The URL a vLLM OpenAI server started with `argv` serves on; None when `argv` is not one, or names a
    socket or a config file instead (where the port may be)."""
    args = list(argv)
    names = [PurePath(a).name for a in args[:3]]
    is_server = ("vllm" in names and "serve" in args[:3]) or _SERVER_MODULE in args[:3]
    if not is_server:
        return None
    values: dict[str, str] = {}
    for i, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in ("--host", "--port", "--uds", "--config"):
            values[flag.removeprefix("--")] = value if equals else (args[i + 1] if i + 1 < len(args) else "")
    if "uds" in values or ("config" in values and "port" not in values):
        return None
    host = values.get("host", "")
    host = "127.0.0.1" if host in _ANY_HOST else host
    port = values.get("port", str(DEFAULT_PORT))
    if not port.isdigit():
        return None
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{int(port)}"


def served_url() -> str | None:
    """This rank's server's URL: the launcher's, else its ancestors' command lines' (None: not a server)."""
    if url := os.environ.get(URL_VARIABLE):
        return url.rstrip("/")
    import psutil

    try:
        process: psutil.Process | None = psutil.Process()
        for _ in range(MAX_ANCESTORS):
            if process is None:
                break
            if (url := server_url_from_argv(process.cmdline())) is not None:
                return url
            process = process.parent()
    except (psutil.Error, OSError):
        return None
    return None


def announce(run_dir: Path, *, model: str, source: str, attach: AttachSummary, key_id: str | None, tp_rank: int,
             tp_size: int) -> None:
    """Write this rank's announcement (again after a reload); a run dir it cannot write is a warning, never a
    failed start: the engine serves either way."""
    descriptor = EngineDescriptor(
        pid=os.getpid(), url=served_url(), model=display_name(model), source=source, attach=attach,
        key_id=key_id, started=time.time(), engine=VLLM_ENGINE, tp_rank=tp_rank, tp_size=tp_size,
        follows=os.environ.get(FOLLOWS_VARIABLE) == "1")
    try:
        write_engine_descriptor(run_dir, descriptor)
    except OSError as exc:
        log.warning("wcache: cannot announce this engine in %s (%s); wcache top will not list it", run_dir,
                    exc.strerror or exc)
