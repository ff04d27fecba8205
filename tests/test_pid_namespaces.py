"""Daemon and engine in different pid namespaces, sharing only the run dir (a sidecar or Compose recipe).

Neither side sees the other's pids (or sees other processes under them), so liveness must come from the lock
each daemon and loading rank holds in the run dir: `attach` hits, `status` lists, and nobody removes a live
daemon's socket, descriptor or loading record. The other namespace is made with `unshare --pid --fork
--mount-proc`, which needs root.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest
from daemon_fixtures import (
    DaemonRig,
    daemon_rig,
    nothing_survives,  # noqa: F401
    wait_for,
)
from helpers import CLI_TIMEOUT_S, WCACHE, environment
from wcache.ipc.run_dir.directory import descriptor_path
from wcache.ipc.run_dir.paths import RunPaths
from wcache_dev.synth import write_checkpoint

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a new pid namespace needs root and unshare(1)")


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def _in_new_namespace(rig: DaemonRig, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UNSHARE, *WCACHE, *args], capture_output=True, text=True, env=environment(rig.env),
                          timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)


def _here(rig: DaemonRig, *args: str) -> subprocess.CompletedProcess[str]:
    return rig.cli(*args, "--run-dir", str(rig.run_dir))


def _files(rig: DaemonRig, name: str) -> list[bool]:
    return [descriptor_path(rig.run_dir, name).exists(), (rig.run_dir / f"{name}.sock").exists()]


def test_a_daemon_in_another_pid_namespace_is_found_listed_and_stopped(rig: DaemonRig) -> None:
    tiny = write_checkpoint("tiny", rig.base / "tiny")
    # In the foreground: the namespace ends (and every process in it) when its first process exits.
    preload = subprocess.Popen([*UNSHARE, *WCACHE, "preload", str(tiny), "--json", "--run-dir", str(rig.run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                               text=True, env=environment(rig.env))
    try:
        assert preload.stdout is not None
        ready = json.loads("".join(iter(preload.stdout.readline, "}\n")) + "}")  # one indented object
        [rank] = ready["ranks"]
        hit = _here(rig, "attach", str(tiny), "--no-fallback", "--json")
        assert hit.returncode == 0, hit.stderr
        assert json.loads(hit.stdout)["outcome"] == "hit"
        listed = json.loads(_here(rig, "status", "--json").stdout)
        assert [d["name"] for d in listed["daemons"]] == [rank["name"]] and listed["stale_removed"] == []
        assert _files(rig, rank["name"]) == [True, True]
        stopped = _here(rig, "stop", "--all")
        assert stopped.returncode == 0 and f"stopped {rank['name']}" in stopped.stdout, stopped.stderr
        assert preload.wait(timeout=60) == 0
        assert _files(rig, rank["name"]) == [False, False]
    finally:
        if preload.poll() is None:
            # unshare passes no signal on: stop the namespace's first process, which stops its daemons.
            for child in psutil.Process(preload.pid).children():
                child.send_signal(signal.SIGTERM)
            preload.wait(timeout=60)


def test_an_engine_in_another_pid_namespace_hits_and_lists_the_daemon(rig: DaemonRig) -> None:
    tiny = write_checkpoint("tiny", rig.base / "tiny")
    [daemon] = rig.preload(tiny)
    hit = _in_new_namespace(rig, "attach", str(tiny), "--no-fallback", "--json", "--run-dir", str(rig.run_dir))
    assert hit.returncode == 0, hit.stderr
    assert json.loads(hit.stdout)["outcome"] == "hit"
    listed = _in_new_namespace(rig, "status", "--json", "--run-dir", str(rig.run_dir))
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [d["name"] for d in rows["daemons"]] == [daemon.name] and rows["stale_removed"] == []
    assert _files(rig, daemon.name) == [True, True]
    assert [d.name for d in rig.descriptors()] == [daemon.name]


def test_a_rank_loading_in_another_namespace_is_listed_and_not_signalled(rig: DaemonRig) -> None:
    tiny = write_checkpoint("tiny", rig.base / "tiny")
    preload = subprocess.Popen([*WCACHE, "preload", str(tiny), "--detach", "--run-dir", str(rig.run_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                               env=environment(rig.env))
    record = wait_for(lambda: next((rig.run_dir / RunPaths.LOADING).glob("*.json"), None), timeout=60, interval=0.002,
                      what="a loading record")
    pid = int(record.stem)
    os.kill(pid, signal.SIGSTOP)
    try:
        listed = _in_new_namespace(rig, "status", "--json", "--run-dir", str(rig.run_dir))
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)["daemons"]
        assert row["state"] == "loading" and row["pid"] == pid
        assert record.exists()
        stop = _in_new_namespace(rig, "stop", "--all", "--run-dir", str(rig.run_dir))
        assert stop.returncode == 3, stop.stderr
        [line] = stop.stderr.strip().splitlines()
        assert line.endswith(f"is loading in another pid namespace (pid {pid} there), so it cannot be signalled "
                             "from here; stop it where it runs, or here once it is ready."), line
        assert record.exists()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert preload.wait(timeout=60) == 0


def _serving_url(engine: subprocess.Popen[str], timeout: float = 120.0) -> str:
    """The base URL from the engine's SERVING line; fails if it exits or stays silent for `timeout`."""
    assert engine.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([engine.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = engine.stdout.readline() if ready else ""
        if ready and not line:
            raise AssertionError(f"the engine exited ({engine.wait()}) before serving: {seen}")
        seen.append(line)
        if line.startswith("SERVING "):
            return line.split()[1].removesuffix("/v1/completions")
    raise AssertionError(f"no SERVING line within {timeout} s: {seen}")


def test_top_shows_an_engine_served_from_another_pid_namespace(rig: DaemonRig) -> None:
    """`top` in a third namespace, where the engine's pid is no process at all (once it was taken as dead)."""
    tiny = write_checkpoint("tiny", rig.base / "tiny")
    [daemon] = rig.preload(tiny)
    # A shell as the namespace's first process runs 60 others first, so the engine's pid there is past any
    # pid (or thread id) the namespace `top` runs in will have.
    serve = " ".join(shlex.quote(a) for a in [*WCACHE, "attach", str(tiny), "--serve", "--port", "0", "--run-dir",
                                              str(rig.run_dir)])
    engine = subprocess.Popen([*UNSHARE, "sh", "-c", f"for i in $(seq 60); do /bin/true; done; {serve}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                              env=environment(rig.env))
    try:
        url = _serving_url(engine)
        top = _in_new_namespace(rig, "top", "--json", "--once", "--run-dir", str(rig.run_dir), "--interval", "0.3")
        assert top.returncode == 0, top.stderr
        [served] = [e for e in json.loads(top.stdout)["engines"] if e["url"] == url]
        assert served["up"] and served["weights"] == "hit" and served["daemon"] == daemon.name
    finally:
        # The shell is its namespace's init and ignores SIGTERM from here: stop the engine itself.
        for child in psutil.Process(engine.pid).children(recursive=True):
            if "wcache_cli.main" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGTERM)
        engine.wait(timeout=60)
