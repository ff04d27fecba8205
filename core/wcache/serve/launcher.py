"""The supervision loop of `wcache serve`: start the server, wait for /health, restart it when it dies or is asked.

One server at a time, started through a `ServerStarter` (cold, or a warm one plugged in). A death is one line
(how it ended and its log's last meaningful line) and a restart after a backoff; SIGHUP, or `wcache restart`
(a request file and a SIGHUP), restarts it at once, perhaps with new arguments; SIGTERM and SIGINT stop it.
Every stop takes the server's whole process group (engine core, workers): SIGTERM, a grace period, SIGKILL; then
the shared memory vLLM leaves behind goes too.
The daemon group stays up across restarts. The run dir's record says what is going on for `status` and `top`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from wcache.daemon.sd_notify import Notifier
from wcache.errors import WcacheError, marked
from wcache.ipc.run_dir import servers
from wcache.ipc.run_dir.engines import remove_gone_announcements
from wcache.ipc.run_dir.servers import ServerRecord, take_restart_request, write_server_record
from wcache.serve.backoff import Backoff
from wcache.serve.exit_reason import death_line, log_size
from wcache.serve.process_group import group_members, mapped_segments, remove_segments
from wcache.serve.starter import ServerProcess, ServerStarter
from wcache.vllm_served import server_pids

POLL_S = 0.25
HEALTH_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 900.0  # a first start imports vLLM and may compile; far past any healthy start here
STOP_GRACE_S = 20.0
GROUP_GONE_S = 10.0

# What ended a wait: the server died, a stop or a restart was asked, it answered /health.
DIED, STOP, RESTART, READY = "died", "stop", "restart", "ready"


class Watcher(Protocol):
    """What runs beside a serving server and stops before it is stopped (`serve.follow`'s follower)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class LaunchSpec:
    """What the launcher runs: the vLLM arguments it builds from the user's, where the server answers, where
    it logs, and the check a restart's new user arguments go through (returning the full server arguments)."""

    model: str
    user_argv: list[str]
    server_argv: Callable[[Sequence[str]], list[str]]  # user's vLLM arguments -> the server's, checked
    env: dict[str, str]
    url: str
    run_dir: Path
    log: Path
    daemons: tuple[str, ...] = ()
    ready_timeout_s: float = READY_TIMEOUT_S
    stop_grace_s: float = STOP_GRACE_S
    watcher: Callable[[], Watcher] | None = None  # one made for each server once it serves (`--follow`)


@dataclass
class _Flags:
    """What signal handlers ask of the loop; `wake` cuts every wait short."""

    wake: threading.Event = field(default_factory=threading.Event)
    stop_signal: int | None = None
    restart: bool = False


class Launcher:
    """Supervises one served vLLM; `run` returns the signal that stopped it."""

    def __init__(self, starter: ServerStarter, spec: LaunchSpec, notifier: Notifier, say: Callable[[str], None],
                 backoff: Backoff | None = None) -> None:
        self.starter = starter
        self.spec = spec
        self.notifier = notifier
        self.say = say
        self.backoff = backoff or Backoff()
        self.flags = _Flags()
        self.started_at = time.time()
        self.restarts = 0
        self.last_ready_s: float | None = None
        self.last_exit: str | None = None
        self._notified_ready = False
        self._recording = threading.RLock()  # the loop's record and a follower's move write it one at a time
        self._recorded: tuple[str, int | None] | None = None  # the state and pid last recorded
        self._segments: set[Path] = set()  # the shared memory the server's processes mapped once it served

    # -- signals ----------------------------------------------------------------------------------------

    def install_signals(self) -> dict[int, object]:
        """SIGTERM and SIGINT stop, SIGHUP restarts; the handlers they replace, to put back."""
        previous: dict[int, object] = {}
        for signum, handler in ((signal.SIGTERM, self._on_stop), (signal.SIGINT, self._on_stop),
                                (signal.SIGHUP, self._on_restart)):
            previous[signum] = signal.signal(signum, handler)
        return previous

    def _on_stop(self, signum: int, frame: object) -> None:
        self.flags.stop_signal = signum
        self.flags.wake.set()

    def _on_restart(self, signum: int, frame: object) -> None:
        self.request_restart()

    def request_restart(self) -> None:
        """Restart the server at once, with the arguments it has (SIGHUP; a follower moving a TP > 1 server)."""
        self.flags.restart = True
        self.flags.wake.set()

    # -- the record -------------------------------------------------------------------------------------

    def _record(self, state: str, pid: int | None) -> None:
        with self._recording:
            self._recorded = (state, pid)
            write_server_record(self.spec.run_dir, ServerRecord(
                launcher_pid=os.getpid(), started=self.started_at, model=self.spec.model, url=self.spec.url,
                state=state, pid=pid, restarts=self.restarts, last_ready_s=self.last_ready_s,
                last_exit=self.last_exit, log=str(self.spec.log), daemons=self.spec.daemons,
                argv=tuple(self.spec.user_argv)))

    def serving_from(self, daemons: tuple[str, ...]) -> None:
        """The daemons the server is on now (a following server was moved, from the follower's thread): the record
        says so at once, for `status` and `top`."""
        with self._recording:
            self.spec.daemons = daemons
            if self._recorded is not None:
                self._record(*self._recorded)

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until a stop signal; returns its number. The record is removed and every server stopped."""
        try:
            self.starter.prepare()
            while self.flags.stop_signal is None:
                self._serve_once()
        finally:
            self._record(servers.STOPPING, None)
            self.notifier.stopping("stopping the vLLM server")
            self.starter.close()
            with self._recording:
                servers.remove_server_files(self.spec.run_dir, os.getpid())
                self._recorded = None  # gone: a move reported late writes nothing back
        return self.flags.stop_signal or signal.SIGTERM

    def _serve_once(self) -> None:
        argv = self.spec.server_argv(self.spec.user_argv)
        log_start = log_size(self.spec.log)
        began = time.monotonic()
        try:
            process = self.starter.start(argv, self.spec.env, self.spec.log)
        except WcacheError as exc:  # a warm starter whose zygote died is replaced by the next start
            self.last_exit = f"the vLLM server could not be started: {marked(exc)}"
            delay = self.backoff.next_delay(None)
            self.say(f"{self.last_exit.rstrip('.')}; trying again in {delay:g} s.")
            self._record(servers.BACKING_OFF, None)
            self._pause(delay)
            return
        serving_since: float | None = None
        try:
            self._record(servers.STARTING, process.pid)
            outcome = self._wait_ready(process, began)
            if outcome == READY:
                serving_since = time.monotonic()
                self.last_ready_s = serving_since - began
                self._record(servers.SERVING, process.pid)
                self._segments = mapped_segments(group_members(process.pid))
                self._announce_ready(process.pid)
                watcher = self.spec.watcher() if self.spec.watcher is not None else None
                if watcher is not None:
                    watcher.start()
                try:
                    outcome = self._watch(process)
                finally:
                    if watcher is not None:
                        watcher.stop()  # before the server goes: no switch reaches a stopping server
        except BaseException:
            self._stop_group(process)  # the run dir failing us (a full disk) must not orphan a server
            raise
        if outcome == DIED:
            status = process.wait()
            served = None if serving_since is None else time.monotonic() - serving_since
            log_end = log_size(self.spec.log)  # what its engine core logs while it is stopped is not why it died
            self._stop_group(process)
            self.last_exit = death_line(process.pid, status, self.spec.log, log_start, log_end)
            delay = self.backoff.next_delay(served)
            self.say(f"{self.last_exit}; restarting in {delay:g} s.")
            self._record(servers.BACKING_OFF, None)
            self._pause(delay)
            self.restarts += self.flags.stop_signal is None
            return
        self._stop_group(process)
        if outcome == RESTART:
            self.restarts += 1
            self.backoff.reset()

    def _announce_ready(self, pid: int) -> None:
        ready = f"vLLM serves {self.spec.model} at {self.spec.url} (pid {pid}, ready in {self.last_ready_s:.1f} s)"
        self.say(ready + ".")
        if not self._notified_ready:
            self._notified_ready = True
            self.notifier.ready(ready)
        else:
            self.notifier.send("READY=1", ready)

    def _pause(self, seconds: float) -> None:
        """Wait `seconds`, cut short by a stop or a restart request (which then starts the server at once)."""
        deadline = time.monotonic() + seconds
        while self.flags.stop_signal is None and not self.flags.restart:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.flags.wake.wait(min(left, POLL_S))
            self.flags.wake.clear()
        if self.flags.restart:
            self._take_restart()

    def _event(self) -> str | None:
        """A stop, or a restart whose arguments hold, asked since the last look."""
        self.flags.wake.clear()
        if self.flags.stop_signal is not None:
            return STOP
        if self.flags.restart and self._take_restart():
            return RESTART
        return None

    def _take_restart(self) -> bool:
        """Apply a restart request's new arguments; False (and one line) when they are refused."""
        self.flags.restart = False
        request = take_restart_request(self.spec.run_dir, os.getpid())
        if request.argv is not None:
            try:
                self.spec.server_argv(request.argv)
            except WcacheError as exc:
                self.say(f"restart refused, the server keeps running: {marked(exc)}")
                return False
            self.spec.user_argv = list(request.argv)
        self.notifier.send("RELOADING=1", "restarting the vLLM server")
        self.say("restarting the vLLM server" + (" with new arguments." if request.argv is not None else "."))
        return True

    def _wait_ready(self, process: ServerProcess, began: float) -> str:
        while True:
            event = self._event_or_death(process)
            if event is not None:
                return event
            if _health_ok(self.spec.url) and _answered_by(process, self.spec.url):
                return READY
            if time.monotonic() - began > self.spec.ready_timeout_s:
                self.say(f"the vLLM server (pid {process.pid}) did not answer /health within "
                         f"{self.spec.ready_timeout_s:g} s; stopping it.")
                self._stop_group(process)
                return DIED
            self.flags.wake.wait(POLL_S)

    def _watch(self, process: ServerProcess) -> str:
        while True:
            event = self._event_or_death(process)
            if event is not None:
                return event
            self.flags.wake.wait(POLL_S)

    def _event_or_death(self, process: ServerProcess) -> str | None:
        """A signalled event, else DIED once the server has exited, else None (keep waiting)."""
        event = self._event()
        if event is not None:
            return event
        return DIED if process.poll() is not None else None

    def _stop_group(self, process: ServerProcess) -> None:
        """Stop the server's whole process group: SIGTERM, the grace period, SIGKILL; wait until it is gone, then
        remove the shared memory it left behind (`wcache.serve.process_group`)."""
        group = process.pid
        segments, self._segments = self._segments | mapped_segments(group_members(group)), set()
        deadline = time.monotonic() + self.spec.stop_grace_s
        _signal_group(group, signal.SIGTERM)
        with contextlib.suppress(Exception):
            process.wait(timeout=self.spec.stop_grace_s)
        # Its engine core and workers may outlive the front process (it was killed outright): they go too.
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        _signal_group(group, signal.SIGKILL)
        with contextlib.suppress(Exception):
            process.wait(timeout=GROUP_GONE_S)
        deadline = time.monotonic() + GROUP_GONE_S
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not group_members(group):  # a member still exiting may still use them
            remove_segments(segments)
        # Ranks killed by a signal leave their announcements; the next server answers at the same URL.
        remove_gone_announcements(self.spec.run_dir, self.spec.url)


def _signal_group(group: int, sig: int) -> None:
    # The group's id stays taken (never a new process's pid) while any member lives, so this reaches only ours.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def _answered_by(process: ServerProcess, url: str) -> bool:
    """Whether `process` (or a process above it) listens at `url`: another process that took the port meanwhile
    answers /health while this server fails to bind it. Where the listener cannot be told, it is taken as this one."""
    listening = server_pids(url)
    return listening is None or process.pid in listening


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
