"""Daemon and engine in different pid namespaces, sharing only the run dir (a sidecar or Compose recipe).

Neither side sees the other's pids (or sees other processes under them), so liveness must come from the lock
each daemon and loading rank holds in the run dir: `attach` hits, `status` lists, and nobody removes a live
daemon's socket, descriptor or loading record. The other namespace is made with `unshare --pid --fork
--mount-proc`, which needs root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
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
from wcache.ipc.loading import LOADING_DIR
from wcache.ipc.rundir import descriptor_path
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
    record = wait_for(lambda: next((rig.run_dir / LOADING_DIR).glob("*.json"), None), timeout=60, interval=0.002,
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
