"""The preload supervisor: starts one daemon per rank, reports progress, serves health, watches the ranks.

`python -m wcache.daemon.supervisor ...` is started by `wcache preload`; it writes JSON status lines on
stdout until every rank is ready (or one failed), then keeps running without them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from wcache.daemon.argv import LoadArgs
from wcache.daemon.health import RankTable, serve_health
from wcache.errors import EXIT_OK, EXIT_UNAVAILABLE, WcacheError, api_words, in_words, marked, option
from wcache.ipc.http.server import http_url
from wcache.ipc.interpreter import python_module_argv
from wcache.ipc.run_dir.directory import census, ensure_run_dir, lock_path, lock_taken_if_free, remove_daemon_files
from wcache.ipc.run_dir.loading import forget_dead_rank
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.wire.framing import ProtocolError
from wcache.ipc.wire.status_pipe import (
    FROM_RANK,
    Exists,
    Failed,
    GroupReady,
    Progress,
    RankReady,
    StatusWriter,
    parse_line,
)
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event
from wcache.monitor.logs import configure as configure_logging

TERM_GRACE_S = 10.0

log = logging.getLogger("wcache.supervisor")


def rank_devices(device: str, tp_size: int) -> list[str]:
    """One device per rank: "cpu" for all; "cuda" for cuda:0..N-1; "cuda:0,1" as listed."""
    if device == "cpu":
        return ["cpu"] * tp_size
    if device == "cuda":
        return [f"cuda:{r}" for r in range(tp_size)]
    if device.startswith("cuda:"):
        indices = device.removeprefix("cuda:").split(",")
        if len(indices) != tp_size or not all(i.isdigit() for i in indices):
            raise WcacheError(f"{option('device', device)} must list exactly {tp_size} CUDA device numbers for "
                              f"{option('tp', tp_size)}.")
        return [f"cuda:{i}" for i in indices]
    raise WcacheError(f"{option('device')} must be cpu, cuda or cuda:N[,M...], not {device!r}.")


@dataclass
class _Rank:
    rank: int
    device: str
    process: subprocess.Popen[str]
    log_path: Path
    done: int = 0
    total: int = 0
    ready: RankReady | None = None
    failure: str | None = None
    failure_code: int = 1
    exists: str | None = None  # another daemon already holds (or is loading) this rank's key
    exit_code: int | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.status = StatusWriter()
        self.run_dir = ensure_run_dir(args.run_dir)
        self.devices = rank_devices(args.device, args.tp)
        self.table = RankTable(args.tp)
        self.ranks: list[_Rank] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.stopping = False

    def run(self) -> int:
        census(self.run_dir)  # clean descriptors of dead daemons before adding ours
        server = serve_health(self.table, self.args.health_host, self.args.health_port,
                              (option("health_host"), option("health_port")))
        health_url = http_url(self.args.health_host, server.server_address[1])
        append_event(self.run_dir, ev.Preload(source=str(self.args.model), device=self.args.device,
                                              tp_size=self.args.tp, health_url=health_url))
        began = time.perf_counter()
        for rank, device in enumerate(self.devices):
            self.ranks.append(self._spawn(rank, device, health_url))
        outcome = self._wait_until_settled()
        if outcome is not None and outcome[1] == 0:
            # The key is served already: not a failure, and nothing of ours may keep running.
            self._terminate_all()
            self.status.emit(Exists(reason=outcome[0]))
            server.shutdown()
            return EXIT_OK
        if outcome is not None:
            reason, code = outcome
            # The log and the event log are read as they are: options in a Python caller's words there; the
            # status line keeps them marked for the CLI to name as flags.
            log.error("preload failed: %s", in_words(reason, api_words))
            self._terminate_all()
            append_event(self.run_dir, ev.PreloadFailed(source=str(self.args.model),
                                                        reason=in_words(reason, api_words)))
            self.status.emit(Failed(reason=reason, exit_code=code))
            server.shutdown()
            return code
        log.info("all %d rank(s) ready in %.2f s; health %s", len(self.ranks), time.perf_counter() - began,
                 health_url)
        self.status.emit(GroupReady(seconds=round(time.perf_counter() - began, 3), health_url=health_url,
                                    ranks=tuple(r.ready for r in self.ranks if r.ready is not None)))
        self.status.close()
        # Watch until every rank has exited (stopped, or killed), then take the health server down.
        for r in self.ranks:
            r.finished.wait()
        server.shutdown()
        # A rank that died (rather than being stopped) makes this a failure: service managers restart on it.
        died = [r for r in self.ranks if r.exit_code not in (0, None)]
        return EXIT_OK if self.stopping or not died else EXIT_UNAVAILABLE

    def _spawn(self, rank: int, device: str, health_url: str) -> _Rank:
        a = self.args
        log_path = rank_log_path(self.run_dir, os.getpid(), rank)
        log_path.parent.mkdir(mode=0o700, exist_ok=True)
        command = python_module_argv(
            "wcache.daemon", *LoadArgs.from_namespace(a).for_rank(device, self.run_dir, log_path).to_argv(),
            "--rank", str(rank), "--health-url", health_url, "--supervisor-pid", str(os.getpid()),
        )
        # In the foreground the ranks share our stderr (journald, `docker logs`); their log file is kept too.
        log_file = None if a.foreground else log_path.open("a")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                   text=True, bufsize=1)
        if log_file is not None:
            log_file.close()
        log.info("started rank %d on %s (pid %d, log %s)", rank, device, process.pid, log_path)
        state = _Rank(rank, device, process, log_path)
        threading.Thread(target=self._follow, args=(state,), daemon=True).start()
        return state

    def _follow(self, state: _Rank) -> None:
        stream = state.process.stdout
        assert stream is not None  # started with stdout=PIPE
        for line in stream:
            try:
                message = parse_line(line, FROM_RANK)
            except ProtocolError as exc:
                log.warning("rank %d wrote a status line that is not one (%s): %r", state.rank, exc, line[:200])
                continue
            with self.changed:
                if isinstance(message, Progress):
                    state.done, state.total = message.done, message.total
                    done = sum(r.done for r in self.ranks)
                    total = sum(r.total for r in self.ranks)
                    self.status.emit(Progress(done=done, total=total))
                elif isinstance(message, RankReady):
                    state.ready = message
                    self.table.ready(state.rank, message.socket)
                    log.info("rank %d ready: daemon %s", state.rank, message.name)
                elif isinstance(message, Exists):
                    state.exists = message.reason
                elif isinstance(message, Failed):
                    state.failure = message.reason
                    state.failure_code = message.exit_code if message.exit_code > 0 else EXIT_UNAVAILABLE
                self.changed.notify_all()
        code = state.process.wait()
        if state.ready is None:
            self._clean_after(state)
        with self.changed:
            state.exit_code = code
            self.changed.notify_all()
        self.table.gone(state.rank)
        state.finished.set()
        # Expected: we stopped it, or it said why it would not serve (the failure is logged as an error already).
        expected = self.stopping or state.failure is not None or state.exists is not None
        log.log(logging.INFO if expected else logging.WARNING, "rank %d exited with code %d", state.rank, code)
        if state.ready is not None and not self.stopping:
            append_event(self.run_dir, ev.DaemonExited(daemon=state.ready.name, rank=state.rank, exit_code=code))
            if len(self.ranks) > 1:
                # A tensor-parallel group serves whole or not at all: the other ranks must not report ready.
                append_event(self.run_dir, ev.GroupStopped(source=str(self.args.model), rank=state.rank,
                                                           reason=f"rank {state.rank} exited with code {code}"))
                self.stop()

    def _wait_until_settled(self) -> tuple[str, int] | None:
        """None once every rank is ready; else the first failure's reason and exit code (0: the key is served)."""
        with self.changed:
            while True:
                for r in self.ranks:
                    if r.exists is not None:
                        return r.exists, 0
                    if r.failure is not None:
                        # The rank's own verdict (bad input 2, unavailable 3).
                        return f"rank {r.rank}: {r.failure}", r.failure_code
                    if r.exit_code is not None and r.ready is None:
                        return _death(r), EXIT_UNAVAILABLE
                if self.stopping:
                    return "preload was stopped before every rank was ready.", EXIT_UNAVAILABLE
                if all(r.ready is not None for r in self.ranks):
                    return None
                self.changed.wait(0.5)

    def _clean_after(self, state: _Rank) -> None:
        """A rank that died before it was ready leaves nothing behind: its loading record, and the socket and
        descriptor it may have published just before (its lock, free now, says nobody else owns them)."""
        name = forget_dead_rank(self.run_dir, state.process.pid)
        if name is not None:
            with lock_taken_if_free(lock_path(self.run_dir, name)) as free:
                if free:
                    remove_daemon_files(self.run_dir, name)

    def _terminate_all(self) -> None:
        for r in self.ranks:
            if r.process.poll() is None:
                r.process.terminate()
        deadline = time.monotonic() + TERM_GRACE_S
        for r in self.ranks:
            try:
                r.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait()

    def stop(self) -> None:
        log.info("stopping every rank")
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        threading.Thread(target=self._terminate_all, daemon=True).start()


def rank_log_path(run_dir: Path, supervisor_pid: int, rank: int) -> Path:
    return RunPaths(run_dir).rank_log(supervisor_pid, rank)


def _death(r: _Rank) -> str:
    """Why a rank that sent no reason is gone, as a user can act on it: how it ended, and where its log is."""
    code = r.exit_code or 0
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"rank {r.rank} (pid {r.process.pid}) {how} while loading; its log is {r.log_path}"


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wcache.daemon.supervisor")
    LoadArgs.add_to(parser)
    parser.add_argument("--health-host", default="127.0.0.1")
    parser.add_argument("--health-port", type=int, default=0)
    parser.add_argument("--foreground", action="store_true", help="ranks log to our stderr as well as their files")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    configure_logging("supervisor", args.log_level, args.log_format, args.log_file)
    try:
        supervisor = Supervisor(args)
    except WcacheError as exc:
        StatusWriter().emit(Failed(reason=marked(exc), exit_code=exc.exit_code))
        return exc.exit_code
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop())
    signal.signal(signal.SIGINT, lambda *_: supervisor.stop())
    try:
        return supervisor.run()
    except WcacheError as exc:  # the health server cannot listen (ListenError): the CLI shows this sentence
        supervisor._terminate_all()
        log.error("preload failed: %s", exc)
        append_event(supervisor.run_dir, ev.PreloadFailed(source=str(args.model), reason=str(exc)))
        supervisor.status.emit(Failed(reason=marked(exc), exit_code=exc.exit_code))
        return exc.exit_code
    except OSError as exc:
        supervisor._terminate_all()
        supervisor.status.emit(Failed(reason=f"the supervisor failed: {exc}.", exit_code=EXIT_UNAVAILABLE))
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
