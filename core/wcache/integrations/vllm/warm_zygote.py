"""The warm starter's zygote: a process that imported vLLM once and forks each vLLM OpenAI server from there.

Run as `python -P -m wcache.integrations.vllm.warm_zygote SOCKET READY_FD` by `WarmStarter.prepare`, in a
session of its own, with the write end of a pipe as READY_FD (one JSON line: ready, or the sentence why not)
and a pipe as stdin (its lifeline: EOF, i.e. the starter closed it or died, stops the zygote). It starts the
warm forkserver (`warm_context`), imports what a server imports, checks that both are single-threaded
and have not initialised CUDA, then serves requests on the Unix socket SOCKET, one JSON line each:

* `{"op": "start", "argv": [...], "env": {...}, "log_path": "...", "cwd": "..."}`: fork a server front that
  runs vLLM's `vllm.entrypoints.openai.api_server` as `__main__` with `argv`, `env` as its whole environment,
  stdout and stderr appended to `log_path`, as the leader of a new process group. Answered `{"pid": N}` (or
  `{"error": "..."}`), then `{"exit": CODE}` on the same connection when it has exited (negative: the signal
  that killed it), the way `subprocess.Popen.returncode` says it.
* `{"op": "status"}`: `{"pid", "forkserver_pid", "threads", "cuda_initialized", "frozen_objects"}` (what
  `gc.freeze` moved out of the collector's reach before the zygote forks).

The server is a process group leader in the zygote's session rather than a session leader: its engine core
and workers are forked by the forkserver (another process of this session) and join the server's group
(`WarmProcess`), which `setpgid` allows only within one session. A launcher stops the whole server with
`os.killpg(pid, ...)` either way.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from wcache.errors import EXIT_UNAVAILABLE
from wcache.integrations.vllm.warm_context import (
    PROBE_FOUND_CUDA,
    WARM_CONTEXT,
    apply_openmp_environment,
    check_fork_safe,
    cuda_initialized,
    freeze_imported_objects,
    import_preload,
    probe_target,
    route_vllm_to_warm_context,
    share_forkserver,
    start_forkserver,
    stop_forkserver,
    thread_count,
)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PROBE_TIMEOUT_S = 600.0  # the forkserver's imports, on a busy machine
REQUEST_TIMEOUT_S = 10.0
FORKSERVER_STOP_S = 10.0


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the starter went away: nobody to tell
        conn.sendall(json.dumps(message).encode() + b"\n")


def _read_request(conn: socket.socket) -> dict[str, Any]:
    conn.settimeout(REQUEST_TIMEOUT_S)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise ValueError("the request ended before its end of line")
        data += chunk
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request


def _run_server(request: dict[str, Any], keep: set[int]) -> int:
    """In the forked front: become the server and run vLLM's server main; its exit code."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    for fd in keep:
        with contextlib.suppress(OSError):
            os.close(fd)
    share_forkserver()
    log = os.open(request["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request.get("cwd") or Path.cwd())
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    apply_openmp_environment()
    sys.argv = [SERVER_MODULE, *request["argv"]]
    import atexit
    import runpy
    import warnings

    # runpy notes that the zygote imported the module it now runs as __main__; a cold server never does.
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                            category=RuntimeWarning)

    code: int = 0
    try:
        runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what interpreter exit runs (vLLM's shutdown hooks), then no zygote clean-up
    return code


class Zygote:
    def __init__(self, socket_path: str) -> None:
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(socket_path)
        Path(socket_path).chmod(0o600)
        self.listener.listen()
        self.socket_path = socket_path
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.children: dict[int, socket.socket] = {}
        self.forkserver_pid = 0
        self.stopping = False

    def _fds(self) -> set[int]:
        """The zygote's own descriptors, which a forked server must not keep (its stdin, the lifeline, is
        replaced by /dev/null)."""
        return {self.selector.fileno(), self.listener.fileno(), self.wake_r, self.wake_w,
                *(c.fileno() for c in self.children.values())}

    def start(self, conn: socket.socket, request: dict[str, Any]) -> None:
        check_fork_safe("zygote")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_server(request, self._fds() | {conn.fileno()})
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        with contextlib.suppress(OSError):  # set from both sides, so the group exists when the pid is known
            os.setpgid(pid, pid)
        self.children[pid] = conn
        _send(conn, {"pid": pid})

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if (conn := self.children.pop(pid, None)) is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request = _read_request(conn)
            if request.get("op") == "status":
                _send(conn, {"pid": os.getpid(), "forkserver_pid": self.forkserver_pid,
                             "threads": thread_count(), "cuda_initialized": cuda_initialized(),
                             "frozen_objects": gc.get_freeze_count()})
                conn.close()
                return
            if request.get("op") != "start":
                raise ValueError(f"unknown request {request.get('op')!r}")
            conn.settimeout(None)
            self.start(conn, request)
        except Exception as exc:
            _send(conn, {"error": str(exc)})
            conn.close()

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        self.selector.register(0, selectors.EVENT_READ, "lifeline")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "signal")
        while not self.stopping:
            for key, _ in self.selector.select():
                if key.data == "signal":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                    self.reap()
                elif key.data == "lifeline":
                    if not os.read(0, 4096):
                        self.stopping = True
                elif key.data == "listener":
                    self.accept()

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def close(self) -> None:
        self.selector.close()
        self.listener.close()
        Path(self.socket_path).unlink(missing_ok=True)
        stop_forkserver(FORKSERVER_STOP_S)
        _stop_resource_tracker()
        self.reap()


def _stop_resource_tracker() -> None:
    """The resource tracker ends once every process holding its pipe has: after the servers, the forkserver
    and this last descriptor."""
    from multiprocessing import resource_tracker

    tracker: Any = resource_tracker._resource_tracker
    if tracker._fd is None:
        return
    os.close(tracker._fd)
    tracker._fd = None
    if tracker._pid is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(tracker._pid, 0)
        tracker._pid = None


def _prepare() -> int:
    """Start the forkserver, import, probe; the forkserver's pid."""
    forkserver_pid = start_forkserver()
    import_preload()  # meanwhile the forkserver imports the same
    route_vllm_to_warm_context()
    probe = WARM_CONTEXT.Process(target=probe_target, name="wcache-warm-probe")
    probe.start()
    probe.join(PROBE_TIMEOUT_S)
    if probe.exitcode != 0:
        reason = ("it inherited CUDA" if probe.exitcode == PROBE_FOUND_CUDA else
                  f"its forked child exited with {probe.exitcode} (see the zygote's log)")
        raise RuntimeError(f"the warm forkserver cannot start vLLM's processes: {reason}")
    check_fork_safe("zygote")
    freeze_imported_objects()
    return forkserver_pid


def main() -> None:
    socket_path, ready_fd = sys.argv[1], int(sys.argv[2])
    ready = os.fdopen(ready_fd, "w")
    zygote = Zygote(socket_path)
    try:
        zygote.forkserver_pid = _prepare()
    except Exception as exc:
        ready.write(json.dumps({"error": str(exc)}) + "\n")
        ready.close()
        zygote.close()
        sys.exit(EXIT_UNAVAILABLE)
    ready.write(json.dumps({"ready": True, "pid": os.getpid(), "forkserver_pid": zygote.forkserver_pid}) + "\n")
    ready.close()
    try:
        zygote.serve()
    finally:
        zygote.close()


if __name__ == "__main__":
    main()
