"""How the launcher starts vLLM's OpenAI server processes: the seam (`ServerStarter`) and the cold starter.

A warm starter (pre-imported parents) implements the same two Protocols by duck typing, so it needs nothing
from this package; the launcher takes any `ServerStarter`. Every server a starter starts leads a process group
of its own (its engine core and workers inherit it), so the launcher stops the whole tree with `os.killpg`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from wcache.ipc.interpreter import python_module_argv

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class ServerProcess(Protocol):
    """One running vLLM OpenAI server (its front process)."""

    pid: int

    def poll(self) -> int | None: ...  # exit status once exited (negative: killed by that signal), else None

    def wait(self, timeout: float | None = None) -> int: ...  # raises subprocess.TimeoutExpired on timeout

    def send_signal(self, sig: int) -> None: ...  # no-op once exited


class ServerStarter(Protocol):
    """Starts vLLM's OpenAI server processes; `prepare` pays one-time costs (imports) before the first start."""

    def prepare(self) -> None: ...

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> ServerProcess: ...

    def close(self) -> None: ...  # stops helper processes; servers it started must already be stopped


class ColdStarter:
    """A fresh interpreter per server: `python -m vllm.entrypoints.openai.api_server ARGV`, importing everything."""

    def prepare(self) -> None:
        """Nothing to pay ahead: each start imports vLLM anew."""

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> ServerProcess:
        with log_path.open("ab") as log:
            return subprocess.Popen(python_module_argv(SERVER_MODULE, *argv), env=dict(env), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def close(self) -> None:
        """No helper processes."""


def is_group_leader(process: ServerProcess) -> bool:
    """Whether `process` leads its own process group, which the launcher relies on to stop its whole tree."""
    try:
        return os.getpgid(process.pid) == process.pid
    except ProcessLookupError:
        return True  # gone already: nothing of its group can be told apart any more
