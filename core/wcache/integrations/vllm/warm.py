"""Starting vLLM OpenAI servers warm: no process of a server imports anything when it starts.

`WarmStarter` is the warm implementation of `wcache serve`'s server starter (`prepare`, `start`, `close`; the
launcher's `ServerStarter` protocol, met by duck typing so this module never imports the launcher). `prepare`
starts a zygote (`warm_zygote`) that imports vLLM and starts a forkserver that imports what vLLM's engine
core and CPU workers import (`warm_context`); `start` asks the zygote to fork a server front, whose engine
core and TP workers are then forked by the forkserver instead of spawned. Neither the zygote nor the
forkserver has initialised CUDA or runs a second thread when it forks; both refuse to fork otherwise.

This module is the launcher's side: the standard library only, no vLLM and no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wcache.errors import UnavailableError, closed_on_error
from wcache.integrations.vllm.warm_context import SINGLE_THREAD_ENV
from wcache.ipc.interpreter import python_module_argv
from wcache.ipc.run_dir.directory import process_created

ZYGOTE_MODULE = "wcache.integrations.vllm.warm_zygote"
PREPARE_TIMEOUT_S = 600.0  # the zygote's and the forkserver's imports on a busy machine
REPLY_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 30.0
# A server's exit status once the zygote (its parent, which alone can know it) has died before it.
UNKNOWN_EXIT = 255


class WarmStartError(UnavailableError):
    """The warm starter could not prepare or start a server; the message is one sentence."""


class WarmServer:
    """One vLLM OpenAI server front forked by the zygote (the launcher's `ServerProcess`). Its exit status
    comes from the zygote, its parent, over the connection the start was asked on (`UNKNOWN_EXIT` once the
    server has gone after the zygote died)."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self._conn = conn
        self._buffer = b""
        self.returncode: int | None = None

    def _read(self, timeout: float | None) -> None:
        if self._conn.fileno() < 0:  # the zygote is gone: all that is left to know is whether the pid is
            if process_created(self.pid) is None:
                self.returncode = UNKNOWN_EXIT
            elif timeout:
                time.sleep(min(timeout, 0.1))
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        chunk = self._conn.recv(4096)
        if not chunk:
            self._conn.close()  # the zygote died without saying how the server ended
            return
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.returncode = int(message["exit"])
                self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class WarmStarter:
    """Starts vLLM's OpenAI servers from a pre-imported zygote (the launcher's `ServerStarter`).

    `zygote_log` receives the zygote's, the forkserver's and multiprocessing's resource tracker's own output
    (default: a file in the starter's private directory, removed by `close`); that directory (the zygote's
    socket) is made in `base_dir` (default: the system's temporary directory); `env` is the zygote's
    environment (default: this process's; each server gets the one `start` is given)."""

    def __init__(self, zygote_log: Path | None = None, env: Mapping[str, str] | None = None,
                 base_dir: Path | None = None) -> None:
        self._zygote_log = zygote_log
        self._env = dict(os.environ if env is None else env)
        self._base_dir = base_dir
        self._dir: Path | None = None
        self._zygote: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        if self._dir is None:
            raise WarmStartError("the warm starter is not prepared")
        return self._dir / "zygote.sock"

    @property
    def zygote_pid(self) -> int | None:
        return None if self._zygote is None else self._zygote.pid

    def prepare(self) -> None:
        """Start the zygote and its forkserver and wait until both have imported vLLM (seconds, once)."""
        if self._zygote is not None:
            return
        self._dir = Path(tempfile.mkdtemp(prefix="wcache-warm-", dir=self._base_dir))
        log_path = self._zygote_log or self._dir / "zygote.log"
        ready_r, ready_w = os.pipe()
        try:
            with open(log_path, "ab") as log:
                self._zygote = subprocess.Popen(
                    python_module_argv(ZYGOTE_MODULE, str(self.socket_path), str(ready_w)),
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=[ready_w],
                    env={**self._env, **SINGLE_THREAD_ENV}, start_new_session=True)
        except BaseException:
            os.close(ready_r)
            self.close()
            raise
        finally:
            os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            line = _read_line(ready, self._zygote, PREPARE_TIMEOUT_S)
        message = json.loads(line) if line else {}
        if not message.get("ready"):
            self.close()
            reason = message.get("error") or f"it exited before it was ready (see {log_path})"
            raise WarmStartError(f"the warm starter's zygote did not start: {reason}")

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> WarmServer:
        """Fork one vLLM OpenAI server with `argv` (what follows `python -m vllm.entrypoints.openai.api_server`)
        and `env` as its whole environment, its output appended to `log_path`. A zygote that died is replaced
        (its imports are paid again)."""
        if self._zygote is not None and self._zygote.poll() is not None:
            self.close()
        self.prepare()
        reply, conn = self._ask({"op": "start", "argv": list(argv), "env": dict(env),
                                 "log_path": str(Path(log_path).absolute()), "cwd": str(Path.cwd())}, keep=True)
        if "pid" not in reply:
            conn.close()
            raise WarmStartError(f"the warm zygote could not start the server: {reply.get('error', reply)}")
        return WarmServer(int(reply["pid"]), conn)

    def status(self) -> dict[str, Any]:
        """The zygote's pid, its forkserver's, its thread count and whether it has initialised CUDA."""
        reply, conn = self._ask({"op": "status"}, keep=False)
        conn.close()
        return reply

    def _ask(self, request: dict[str, Any], *, keep: bool) -> tuple[dict[str, Any], socket.socket]:
        conn = socket.socket(socket.AF_UNIX)
        with closed_on_error(conn.close, lambda exc: WarmStartError(
                f"the warm zygote does not answer ({exc.strerror or exc})")):
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.connect(str(self.socket_path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise WarmStartError("the warm zygote closed the connection without an answer")
                data += chunk
            conn.settimeout(None)
        return json.loads(data), conn

    def close(self) -> None:
        """Stop the zygote, its forkserver and resource tracker (servers it started must already be stopped)."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            with contextlib.suppress(OSError):
                if zygote.stdin is not None:
                    zygote.stdin.close()  # the lifeline: the zygote stops its forkserver and exits
            try:
                zygote.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(zygote.pid, signal.SIGKILL)  # the forkserver and tracker are in its group
                zygote.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> WarmStarter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _read_line(stream: Any, process: subprocess.Popen[bytes], timeout: float) -> bytes:
    """One line from `stream`, or b"" once `process` has exited or `timeout` has passed."""
    deadline = time.monotonic() + timeout
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n") and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
        elif process.poll() is not None:
            break
    return data
