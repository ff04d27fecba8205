"""The launcher's supervision loop over a starter of its own (the seam a warm starter plugs into): real processes
that answer `/health` over HTTP, each leading its process group with a child of its own, as vLLM's server and
engine core do. Killed, crashing, restarted by request and stopped, in seconds instead of vLLM's minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil
import pytest
from daemon_fixtures import http_status, wait_for
from helpers import free_port
from wcache.daemon.sd_notify import Notifier
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.run_dir.servers import RestartRequest, live_server_records, write_restart_request
from wcache.serve.backoff import Backoff
from wcache.serve.launcher import Launcher, LaunchSpec
from wcache.serve.starter import ServerProcess

# A server: a child that sleeps (its "engine core", in its group), then /health on the port its argv names, or,
# with --crash, a traceback and exit 1 as a start-up failure prints them; with --shm it maps two /dev/shm segments.
SERVER = r"""
import http.server, subprocess, sys, time
args = sys.argv[1:]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
if "--crash" in args:
    print("INFO starting", flush=True)
    print("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: max_model_len 99 is too long",
          flush=True)
    sys.exit(1)
if "--shm" in args:  # as vLLM's workers make theirs (never removed), and another segment of a name not vLLM's
    import mmap, os
    held = []
    for name in (f"vllm_-wcache-test-{os.getpid()}", f"arena-wcache-test-{os.getpid()}"):
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        held.append(mmap.mmap(fd, 4096))
port = int(args[args.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(" ".join(args).encode())
    def log_message(self, *a):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class ScriptStarter:
    """A ServerStarter by duck typing: one fresh interpreter per server, each the leader of its own group."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []
        self.closed = False

    def prepare(self) -> None:
        pass

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> ServerProcess:
        with log_path.open("ab") as log:
            process = subprocess.Popen([sys.executable, "-c", SERVER, *argv], env=dict(env), stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started.append(process)
        return process

    def close(self) -> None:
        self.closed = True


class Run:
    """A launcher running in this thread's stead (its loop on a thread; signals are set as its handlers would)."""

    def __init__(self, tmp_path: Path, user_argv: list[str], notifier: Notifier | None = None) -> None:
        self.port = free_port()
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir(mode=0o700)
        self.said: list[str] = []
        self.starter = ScriptStarter()

        def server_argv(argv: Sequence[str]) -> list[str]:
            if "--bad" in argv:
                from wcache.errors import BadInputError

                raise BadInputError("vLLM's server has no option --bad.")
            return ["--port", str(self.port), *argv]

        self.spec = LaunchSpec(model="m", user_argv=user_argv, server_argv=server_argv, env=dict(os.environ),
                               url=f"http://127.0.0.1:{self.port}", run_dir=self.run_dir, log=tmp_path / "serve.log",
                               ready_timeout_s=60, stop_grace_s=2)
        self.launcher = Launcher(self.starter, self.spec, notifier or Notifier(None), self.said.append,
                                 Backoff(first_s=0.2, longest_s=0.8, healthy_s=60))
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.code = self.launcher.run()

    def record(self) -> dict[str, object] | None:
        records = [r.to_wire() for r in live_server_records(self.run_dir)]
        return records[0] if records else None

    def serving(self, restarts: int) -> dict[str, object]:
        def ready() -> dict[str, object] | None:
            record = self.record()
            return record if record and record["state"] == "serving" and record["restarts"] == restarts else None
        return wait_for(ready, timeout=60, interval=0.05, what=f"serving after {restarts} restart(s)")

    def stop(self) -> int | None:
        self.launcher.flags.stop_signal = signal.SIGTERM
        self.launcher.flags.wake.set()
        self.thread.join(timeout=60)
        return self.code


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    made = Run(tmp_path, ["--max-model-len", "512"])
    made.thread.start()
    try:
        yield made
    finally:
        made.stop()
        for process in made.starter.started:  # whatever a failed test left: its whole group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def _group(pid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def test_a_killed_server_is_restarted_its_group_stopped_and_the_record_kept(run: Run) -> None:
    first = run.serving(restarts=0)
    pid = first["pid"]
    assert isinstance(pid, int) and len(_group(pid)) == 2  # the server and its "engine core"
    os.kill(pid, signal.SIGKILL)
    again = run.serving(restarts=1)
    assert again["pid"] != pid and again["last_exit"] == f"the vLLM server (pid {pid}) was killed by SIGKILL"
    assert f"the vLLM server (pid {pid}) was killed by SIGKILL; restarting in 0.2 s." in run.said
    assert _group(pid) == []  # its child went with it
    assert isinstance(again["last_ready_s"], float)


def test_a_restart_request_applies_new_arguments_and_refuses_bad_ones(run: Run) -> None:
    run.serving(restarts=0)
    write_restart_request(run.run_dir, os.getpid(), RestartRequest(("--bad",)))
    run.launcher._on_restart(signal.SIGHUP, None)
    wait_for(lambda: any(line.startswith("restart refused, the server keeps running:") for line in run.said),
             what="the refusal")
    assert run.serving(restarts=0)["argv"] == ("--max-model-len", "512")
    write_restart_request(run.run_dir, os.getpid(), RestartRequest(("--max-model-len", "256")))
    run.launcher._on_restart(signal.SIGHUP, None)
    after = run.serving(restarts=1)
    assert after["argv"] == ("--max-model-len", "256")
    import urllib.request

    with urllib.request.urlopen(f"{run.spec.url}/health", timeout=5) as answer:
        assert answer.read().decode().endswith("--max-model-len 256")
    assert not RunPaths(run.run_dir).server_restart(os.getpid()).exists()


def test_stopping_leaves_no_process_and_no_record(run: Run) -> None:
    pid = run.serving(restarts=0)["pid"]
    assert isinstance(pid, int)
    assert run.stop() == signal.SIGTERM
    assert _group(pid) == [] and run.record() is None and run.starter.closed
    assert list(RunPaths(run.run_dir).servers.iterdir()) == []


def test_a_crashing_server_backs_off_and_says_why(tmp_path: Path) -> None:
    crashing = Run(tmp_path, ["--crash"])
    crashing.thread.start()
    try:
        wait_for(lambda: len([s for s in crashing.said if "restarting in" in s]) >= 4, timeout=60,
                 what="four failed starts")
    finally:
        assert crashing.stop() == signal.SIGTERM
    deaths = [s for s in crashing.said if "restarting in" in s][:4]
    assert [d.rsplit("restarting in ", 1)[1] for d in deaths] == ["0.2 s.", "0.4 s.", "0.8 s.", "0.8 s."]
    assert all("exited with status 1: ValueError: max_model_len 99 is too long" in d for d in deaths), deaths
    for process in crashing.starter.started:
        assert _group(process.pid) == []


def test_systemd_hears_ready_once_health_answers_then_reloading_and_stopping(tmp_path: Path) -> None:
    listening = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(listening))
        sock.settimeout(60)
        notified = Run(tmp_path, [], Notifier(str(listening)))
        notified.thread.start()
        try:
            ready = sock.recv(4096).decode().split("\n")
            assert ready[0] == "READY=1" and ready[1].startswith("STATUS=vLLM serves m at http://127.0.0.1:"), ready
            assert notified.record() is not None and notified.record()["state"] == "serving"  # type: ignore[index]
            notified.launcher._on_restart(signal.SIGHUP, None)
            assert sock.recv(4096).decode().startswith("RELOADING=1")
            assert sock.recv(4096).decode().startswith("READY=1")
        finally:
            notified.stop()
        assert sock.recv(4096).decode().startswith("STOPPING=1")


def test_another_process_on_the_port_is_not_taken_for_the_server(tmp_path: Path) -> None:
    """A port chosen free and taken meanwhile by another process: its /health answers, but the launcher waits for its
    own server, which fails to bind and is restarted until the port is free again."""
    squatting = Run(tmp_path, [])
    squatter = subprocess.Popen([sys.executable, "-c", SERVER, "--port", str(squatting.port)],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == b"serving\n"
        wait_for(lambda: _answers(squatting.spec.url), what="the other process to answer /health")
        squatting.thread.start()
        wait_for(lambda: len([s for s in squatting.said if "restarting in" in s]) >= 2, timeout=60,
                 what="two failed starts")
        assert all("Address already in use" in s for s in squatting.said if "restarting in" in s), squatting.said
        record = squatting.record()
        assert record is not None and record["state"] != "serving" and record["last_ready_s"] is None, record
    finally:
        os.killpg(squatter.pid, signal.SIGKILL)
        squatter.wait()
    try:
        served = wait_for(lambda: (r := squatting.record()) is not None and r["state"] == "serving" and r,
                          timeout=60, what="the server to serve once the port is free")
        assert served["pid"] == squatting.starter.started[-1].pid and served["restarts"] >= 2, served
    finally:
        squatting.stop()
        for process in squatting.starter.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        return http_status(f"{url}/health")[0] == 200
    return False


def test_the_shared_memory_a_server_leaves_behind_goes_with_it(tmp_path: Path) -> None:
    """A segment named as vLLM names its own goes once the server is gone, killed (noted when it served) or
    stopped; one of another name (an arena a user put in /dev/shm) stays."""
    run = Run(tmp_path, ["--shm"])
    run.thread.start()
    try:
        first = run.serving(restarts=0)["pid"]
        assert isinstance(first, int)
        killed = [Path(f"/dev/shm/{kind}-wcache-test-{first}") for kind in ("vllm_", "arena")]
        assert all(p.exists() for p in killed)
        os.kill(first, signal.SIGKILL)
        second = run.serving(restarts=1)["pid"]
        assert not killed[0].exists() and killed[1].exists()
        stopped = [Path(f"/dev/shm/{kind}-wcache-test-{second}") for kind in ("vllm_", "arena")]
        assert run.stop() == signal.SIGTERM
        assert not stopped[0].exists() and stopped[1].exists()
    finally:
        run.stop()
        for process in run.starter.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            for kind in ("vllm_", "arena"):
                Path(f"/dev/shm/{kind}-wcache-test-{process.pid}").unlink(missing_ok=True)
