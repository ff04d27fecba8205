"""Real vLLM OpenAI servers (the CPU build) started warm by `WarmStarter`, on a daemon's weights.

One module-wide rig: the `small` checkpoint, its daemon, one `WarmStarter` (its zygote imported vLLM once, its
forkserver what the engine core and workers import) and, started beside the first warm server, one cold
server (`python -m vllm.entrypoints.openai.api_server`, vLLM's default loader) whose greedy tokens the warm
ones must give. The warm server is then killed with SIGKILL and started again; its engine core and worker are
forked by the forkserver (never spawned), in the server's process group, writing to the server's log. The
last test closes the starter: no zygote, forkserver, resource tracker, socket or shared-memory segment of
the servers is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives, wait_for  # noqa: F401
from wcache.integrations.vllm.warm import WarmServer, WarmStarter
from wcache_dev.synth import write_checkpoint

PROMPT = "the weights cache keeps"
MAX_NEW_TOKENS = 8
SERVER_START_S = 300.0
EXIT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _complete(url: str) -> list[int] | None:
    """Greedy tokens of one completion; None while the server is not answering yet."""
    body = json.dumps({"model": "small", "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return list(json.loads(response.read())["choices"][0]["token_ids"])
    except (urllib.error.URLError, ConnectionError):
        return None


def _group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group `pgid`."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
    return members


def _shared_memory(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm files `processes` map (vLLM's message queues, multiprocessing's named semaphores)."""
    found = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            found.update(m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/"))
    return found


@dataclass
class WarmRig:
    rig: DaemonRig
    model: Path
    starter: WarmStarter
    env: dict[str, str]
    # Every warm server's pid, and the shared memory its processes mapped, for the last test's checks.
    server_pids: list[int] = field(default_factory=list)
    shared_memory: set[str] = field(default_factory=set)

    def argv(self, port: int, load_format: str = "wcache") -> list[str]:
        argv = ["--model", str(self.model), "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
                "--max-model-len", "512", "--served-model-name", "small", "--load-format", load_format]
        if load_format == "wcache":
            argv += ["--model-loader-extra-config", json.dumps({"run_dir": str(self.rig.run_dir), "fallback": False})]
        return argv

    def start_warm(self, name: str) -> tuple[WarmServer, str, Path]:
        port = _free_port()
        log = self.rig.base / f"{name}.log"
        server = self.starter.start(self.argv(port), self.env, log)
        self.server_pids.append(server.pid)
        return server, f"http://127.0.0.1:{port}", log

    def wait_for_tokens(self, url: str, server: WarmServer | subprocess.Popen[bytes], log: Path) -> list[int]:
        tokens = wait_for(lambda: server.poll() is not None or _complete(url), timeout=SERVER_START_S,
                          interval=0.5, what=f"a completion from {url}")
        assert server.poll() is None, log.read_text()[-3000:]
        return list(tokens)

    def kill(self, server: WarmServer) -> int:
        """SIGKILL the server's process group, as the launcher does; its exit status once none of it is left."""
        self.shared_memory |= _shared_memory(_group(server.pid))
        os.killpg(server.pid, signal.SIGKILL)
        status = server.wait(timeout=EXIT_S)
        wait_for(lambda: not _group(server.pid), timeout=EXIT_S, what="the killed server's processes to go")
        return status


@pytest.fixture(scope="module")
def warm_rig() -> Iterator[WarmRig]:
    with daemon_rig() as rig:
        model = write_checkpoint("small", rig.base / "small")
        rig.preload(model)
        env = {**os.environ, **rig.env, "VLLM_CPU_KVCACHE_SPACE": "1"}
        starter = WarmStarter(env=env, base_dir=rig.base, zygote_log=rig.base / "zygote.log")
        try:
            yield WarmRig(rig, model, starter, env)
        finally:
            starter.close()


@dataclass
class Served:
    server: WarmServer
    url: str
    log: Path
    cold_tokens: list[int]


@pytest.fixture(scope="module")
def served(warm_rig: WarmRig) -> Iterator[Served]:
    """A warm server on the daemon, and the greedy tokens of a cold server (vLLM's own loader) started beside it."""
    cold_port = _free_port()
    cold_log = warm_rig.rig.base / "cold.log"
    with cold_log.open("ab") as log:
        cold = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *warm_rig.argv(cold_port, "auto")],
            env=warm_rig.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = None
    try:
        warm_rig.starter.prepare()
        server, url, warm_log = warm_rig.start_warm("warm")
        cold_tokens = warm_rig.wait_for_tokens(f"http://127.0.0.1:{cold_port}", cold, cold_log)
        _stop_cold(cold)
        yield Served(server, url, warm_log, cold_tokens)
    finally:
        _stop_cold(cold)
        if server is not None and server.poll() is None:
            warm_rig.kill(server)


def _stop_cold(cold: subprocess.Popen[bytes]) -> None:
    """SIGTERM: vLLM's own shutdown removes its shared memory (a SIGKILL leaves that to the resource tracker)."""
    if cold.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cold.pid, signal.SIGTERM)
        try:
            cold.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(cold.pid, signal.SIGKILL)
            cold.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(cold.pid, signal.SIGKILL)


def _forked_warm(warm_rig: WarmRig, server: WarmServer, log: Path) -> None:
    """The server's front is the zygote's child; its engine core and worker the forkserver's, in its group."""
    status = warm_rig.starter.status()
    front = psutil.Process(server.pid)
    assert front.ppid() == status["pid"], "the server's front must be forked by the zygote"
    others = [p for p in _group(server.pid) if p.pid != server.pid]
    assert len(others) >= 2, f"an engine core and a worker in the server's group: {others}"
    assert {p.ppid() for p in others} == {status["forkserver_pid"]}, "engine core and worker must be forked warm"
    text = log.read_text()
    assert "(EngineCore pid=" in text and "(Worker pid=" in text, "their output belongs in the server's log"


def test_warm_server_answers_like_a_cold_one(warm_rig: WarmRig, served: Served) -> None:
    tokens = warm_rig.wait_for_tokens(served.url, served.server, served.log)
    assert tokens == served.cold_tokens, "a warm server must give a cold server's greedy tokens"
    assert "wcache: weight cache hit from daemon" in served.log.read_text()
    _forked_warm(warm_rig, served.server, served.log)


def test_killed_server_comes_back_warm_with_the_same_tokens(warm_rig: WarmRig, served: Served) -> None:
    assert warm_rig.wait_for_tokens(served.url, served.server, served.log) == served.cold_tokens
    assert warm_rig.kill(served.server) == -signal.SIGKILL
    assert served.server.poll() == -signal.SIGKILL
    server, url, log = warm_rig.start_warm("warm-restarted")
    try:
        assert warm_rig.wait_for_tokens(url, server, log) == served.cold_tokens
        _forked_warm(warm_rig, server, log)
    finally:
        warm_rig.kill(server)


def test_a_typo_in_the_arguments_is_vllms_one_error(warm_rig: WarmRig) -> None:
    warm_rig.starter.prepare()
    log = warm_rig.rig.base / "typo.log"
    server = warm_rig.starter.start(["--model", str(warm_rig.model), "--max-model-lenn", "512"], warm_rig.env, log)
    assert server.wait(timeout=EXIT_S) == 2, log.read_text()[-3000:]
    assert "--max-model-lenn" in log.read_text()
    server.send_signal(signal.SIGTERM)  # once exited: nothing to signal, no error


def test_zygote_and_forkserver_are_single_threaded_without_cuda(warm_rig: WarmRig) -> None:
    warm_rig.starter.prepare()
    status = warm_rig.starter.status()
    assert status["cuda_initialized"] is False and status["threads"] == 1, status
    # torch's and vLLM's objects are frozen before any fork, so a forked server's full collection skips them
    assert status["frozen_objects"] > 100_000, status
    assert psutil.Process(status["forkserver_pid"]).num_threads() == 1


def test_close_leaves_no_process_socket_or_shared_memory(warm_rig: WarmRig, served: Served) -> None:
    """Last: with every server stopped, `close` ends the zygote, the forkserver and the resource tracker, which
    unlinks the shared memory of the servers that were killed."""
    assert served.server.poll() is not None, "the restart test stopped the first server"
    warm_rig.starter.prepare()
    status = warm_rig.starter.status()
    helpers = psutil.Process(status["pid"]).children(recursive=True)  # the forkserver, the resource tracker
    assert status["forkserver_pid"] in {p.pid for p in helpers}
    socket_dir = warm_rig.starter.socket_path.parent
    assert warm_rig.shared_memory, "the servers' shared memory was recorded"
    warm_rig.starter.close()
    assert not psutil.pid_exists(status["pid"]), "the zygote is reaped by close"
    _gone, alive = psutil.wait_procs(helpers, timeout=EXIT_S)
    assert not alive, f"left behind: {alive}"
    assert not socket_dir.exists()
    assert not any(_group(pid) for pid in warm_rig.server_pids)
    assert not {path for path in warm_rig.shared_memory if Path(path).exists()}, "shared memory left behind"
