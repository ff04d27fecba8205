"""Helpers for the daemon end-to-end tests: private run dirs, real preloads, raw frames, and cleanup that always runs.

Every `DaemonRig` lives in its own `/tmp/wc-XXXXXXXX` directory (mode 0700; AF_UNIX paths must stay under
108 bytes). Everything a test starts carries that path on its command line (`--run-dir`, `--model`, or an
argument given for the purpose), so teardown can find and kill whatever is left, and the modules can check
at the end that nothing survived.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import psutil
import pytest
from helpers import CLI_TIMEOUT_S, cmdline, kill_and_wait, processes_mentioning, run_python, wcache_process
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    daemon_name,
    lock_held,
    lock_path,
    process_created,
    read_descriptors,
    socket_path,
    write_descriptor,
)
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.wire.client import request_once
from wcache.ipc.wire.framing import HEADER, PROTOCOL_VERSION
from wcache.ipc.wire.messages import Stats
from wcache.key.cache_key import WeightCacheKey
from wcache.monitor.events import read_events
from wcache.plan.spec import PlanSpec

# Every base directory a rig made in this interpreter, for the end-of-module survivor check.
CREATED_BASES: list[Path] = []

# Publish, from tensors in memory, every tensor of checkpoint argv[4] that differs from the parent daemon argv[2]'s
# checkpoint argv[3] (argv[1]: the rig's base path, argv[5] its run dir); prints the new version's key id and daemon.
_PUBLISH_STEP = """
import sys
from pathlib import Path
import torch
from wcache.checkpoint.files import locate
from safetensors.torch import load_file
from wcache.daemon.publish import publish

def tensors(path):
    found = {}
    for shard in locate(Path(path)).shards:
        found.update(load_file(str(shard)))
    return found

parent, child = tensors(sys.argv[3]), tensors(sys.argv[4])
changes = {n: t for n, t in child.items() if not torch.equal(t, parent[n])}
published = publish(sys.argv[2], changes, run_dir=Path(sys.argv[5]))
print(published.key.short_id, published.daemons[0])
"""


def survivors() -> list[str]:
    """`pid cmdline` of every live process that mentions a rig directory made in this interpreter."""
    found = []
    for base in CREATED_BASES:
        for process in processes_mentioning(str(base)):
            found.append(f"{process.pid} {cmdline(process)}")
    return found


@pytest.fixture(scope="module", autouse=True)
def nothing_survives() -> Iterator[None]:
    """After the last test of a module: no process mentioning a rig directory is still alive.

    Autouse, but a fixture in a helper module is only seen where it is imported by name, so each daemon test
    module imports it (`from daemon_fixtures import nothing_survives  # noqa: F401`); module scope there
    means one check per module, after every rig of that module has been torn down.
    """
    yield
    left = survivors()
    assert not left, f"processes outlived the tests: {left}"


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; fail the test with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def http_status(url: str, timeout: float = 5.0) -> tuple[int, dict[str, Any] | str]:
    """GET `url`; the status code and the body (parsed when it is JSON), whether 2xx or not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            code, body, kind = response.status, response.read(), response.headers.get_content_type()
    except urllib.error.HTTPError as exc:
        code, body, kind = exc.code, exc.read(), exc.headers.get_content_type()
    text = body.decode()
    return code, (json.loads(text) if kind == "application/json" else text)


@dataclass
class DaemonRig:
    """One private run dir, its own digest store, and every daemon preloaded into it."""

    base: Path
    run_dir: Path
    cache_dir: Path
    env: dict[str, str]
    supervisor_pids: set[int] = field(default_factory=set)
    extra_paths: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls) -> DaemonRig:
        base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
        CREATED_BASES.append(base)
        run_dir = base / "r"
        run_dir.mkdir(mode=0o700)
        cache_dir = base / "cache"
        cache_dir.mkdir(mode=0o700)
        env = {"WCACHE_RUN_DIR": str(run_dir), "WCACHE_CACHE_DIR": str(cache_dir), "NO_COLOR": "1",
               "COLUMNS": "200"}
        return cls(base, run_dir, cache_dir, env)

    # -- running things ----------------------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S, as_json: bool = False,
            env: dict[str, str] | None = None) -> Any:
        """Run `wcache ARGS` with this rig's environment (and `env`); with `as_json`, insist on exit 0 and parse
        stdout."""
        result = wcache_process(*args, env={**self.env, **(env or {})}, timeout=timeout)
        if as_json:
            assert result.returncode == 0, f"wcache {' '.join(args)} exited {result.returncode}: {result.stderr}"
            return json.loads(result.stdout)
        return result

    def python(self, code: str, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run a Python snippet in a fresh interpreter with this rig's environment; the base path rides along
        in argv so a leftover process is found by the sweep."""
        return run_python(code, str(self.base), *args, env=self.env, timeout=timeout)

    def preload(self, model: Path, *options: str) -> list[DaemonDescriptor]:
        """`wcache preload MODEL --detach` into this run dir; the new daemons' descriptors, by rank."""
        result = self.cli("preload", str(model), "--detach", "--json", "--run-dir", str(self.run_dir), *options)
        self._remember_supervisors()
        assert result.returncode == 0, f"preload of {model} failed ({result.returncode}): {result.stderr}"
        ready = json.loads(result.stdout)
        names = [r["name"] for r in sorted(ready["ranks"], key=lambda r: r["rank"])]
        by_name = {d.name: d for d in self.descriptors()}
        assert set(names) <= set(by_name), f"preload reported {names} but the run dir holds {sorted(by_name)}"
        found = [by_name[n] for n in names]
        self.supervisor_pids.update(d.supervisor_pid for d in found if d.supervisor_pid)
        return found

    def publish_step(self, parent: str, parent_path: Path, child_path: Path) -> tuple[str, str]:
        """Publish from daemon `parent` (holding `parent_path`) what a training step changed to reach `child_path`,
        as a trainer does (`publish`, from tensors in memory, in a process of its own); the new key id and daemon."""
        done = self.python(_PUBLISH_STEP, parent, str(parent_path), str(child_path), str(self.run_dir))
        self._remember_supervisors()
        assert done.returncode == 0, done.stderr
        key_id, daemon = done.stdout.split()[-2:]
        return key_id, daemon

    def publish_stand_in(self, device: str = "cpu", key_id: str = "3fa9c0de12ab") -> DaemonDescriptor:
        """A descriptor published as a ready daemon publishes it (`write_descriptor`), for a process that sleeps.

        The process holds the daemon's lock as a daemon does, so `census` counts it live; nothing listens on its
        socket. The process carries the base path, so cleanup kills it.
        """
        name = daemon_name(device, key_id)
        lock = lock_path(self.run_dir, name)
        # As a daemon takes its lock: a file its last holder removed meanwhile is let go and the new one locked.
        hold = ("import fcntl, os, sys, time\n"
                "while True:\n"
                "    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
                "    fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "    try:\n"
                "        if os.stat(sys.argv[1]).st_ino == os.fstat(fd).st_ino:\n"
                "            break\n"
                "    except FileNotFoundError:\n"
                "        pass\n"
                "    os.close(fd)\n"
                "time.sleep(600)")
        process = subprocess.Popen([sys.executable, "-c", hold, str(lock), str(self.base)], stdin=subprocess.DEVNULL)
        created = wait_for(lambda: process_created(process.pid), what="the stand-in to start")
        wait_for(lambda: lock_held(lock), what="the stand-in to hold its lock")
        descriptor = DaemonDescriptor(
            name=name, pid=process.pid, pid_created=created, device=device, tp_size=1, tp_rank=0, key_id=key_id,
            key=WeightCacheKey(checkpoint=key_id, config=key_id, tokenizer=key_id, plan=key_id,
                               format=1), plan=PlanSpec(), config=None,
            source=str(self.base / "tiny"), socket=str(socket_path(self.run_dir, name)), health_url=None,
            supervisor_pid=None, started="2025-01-01T00:00:00+00:00", weights_bytes=0,
        )
        write_descriptor(self.run_dir, descriptor)
        return descriptor

    def _remember_supervisors(self) -> None:
        marker = f"--run-dir {self.run_dir}"
        for process in processes_mentioning(marker):
            if "wcache.daemon.supervisor" in cmdline(process):
                self.supervisor_pids.add(process.pid)

    # -- looking -----------------------------------------------------------------------------------------

    def descriptors(self) -> list[DaemonDescriptor]:
        return read_descriptors(self.run_dir)

    def settled(self, descriptors: list[DaemonDescriptor] | None = None) -> list[DaemonDescriptor]:
        """`descriptors` (the run dir's, by default) without `files` and `provenance`, which a cold preload's daemon
        publishes once more when its SHA-256s are done after READY: what nothing else may change."""
        return [msgspec.structs.replace(d, files=(), provenance=None)
                for d in (self.descriptors() if descriptors is None else descriptors)]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_events(self.run_dir) if kind is None or e["kind"] == kind]

    @staticmethod
    def stats(descriptor: DaemonDescriptor) -> dict[str, Any]:
        return request_once(descriptor.socket, Stats()).to_wire()

    def status(self) -> dict[str, Any]:
        return self.cli("status", "--json", "--run-dir", str(self.run_dir), as_json=True)

    # -- cleaning up -------------------------------------------------------------------------------------

    def cleanup(self) -> list[str]:
        """Stop, then kill, everything this rig started, and remove its files; returns what survived."""
        # Undo anything a test loosened or tightened, so the CLI and rmtree can work.
        with contextlib.suppress(OSError):
            if not self.run_dir.is_symlink():
                os.chmod(self.run_dir, 0o700)
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self.cli("stop", "--all", "--force", "--run-dir", str(self.run_dir), timeout=60)
        listed: set[int] = set(self.supervisor_pids)
        for path in RunPaths(self.run_dir).descriptors():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                data = json.loads(path.read_text())
                listed.update(p for p in (data.get("pid"), data.get("supervisor_pid")) if isinstance(p, int))
        targets: dict[int, psutil.Process] = {}
        for pid in listed:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                # Only ours: a recycled pid belongs to someone else and is left alone.
                if str(self.base) in cmdline(process):
                    targets[pid] = process
        for process in processes_mentioning(str(self.base)):
            targets.setdefault(process.pid, process)
        # Daemons first, so a live supervisor reaps them; then the supervisors.
        ordered = sorted(targets.values(), key=lambda p: p.pid in self.supervisor_pids)
        left = kill_and_wait(ordered)
        for path in [self.base, *self.extra_paths]:
            _remove_tree(path)
        return [f"{p.pid} {cmdline(p)}" for p in left]


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    if not path.exists():
        return
    for root, dirs, _files in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                if not os.path.islink(os.path.join(root, name)):
                    os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def daemon_rig() -> Iterator[DaemonRig]:
    """A rig that is torn down however the test ends; teardown fails loudly if anything survived."""
    rig = DaemonRig.create()
    try:
        yield rig
    finally:
        left = rig.cleanup()
        assert not left, f"processes survived the cleanup of {rig.base}: {left}"
        assert not rig.base.exists(), f"{rig.base} was not removed"


def copy_checkpoint(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


@contextlib.contextmanager
def preloaded_tiny(template: Path) -> Iterator[tuple[DaemonRig, Path, DaemonDescriptor]]:
    """A rig of its own holding a copy of the `tiny` checkpoint `template`, preloaded (TP 1) as one daemon."""
    with daemon_rig() as rig:
        model = copy_checkpoint(template, rig.base / "tiny")
        (daemon,) = rig.preload(model)
        yield rig, model, daemon


# -- raw protocol --------------------------------------------------------------------------------------------

def raw_frame(body: bytes, version: int = PROTOCOL_VERSION) -> bytes:
    """`body` behind a frame header of protocol `version`."""
    return HEADER.pack(version, len(body)) + body


def msg(message: Any, version: int = PROTOCOL_VERSION) -> bytes:
    """A frame of any msgpack value (valid or not as a request)."""
    return raw_frame(msgpack.packb(message, use_bin_type=True), version)


def request_frame(message_type: str, **fields: Any) -> bytes:
    return msg({"type": message_type, **fields})


def raw_connect(path: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 10.0, *, stop_at_data: bool = False) -> bytes:
    """Everything the peer sends until it closes (or its first bytes, with `stop_at_data`); fails if it
    neither closes nor sends within `timeout`."""
    sock.settimeout(timeout)
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            raise AssertionError(f"the peer kept the connection open for {timeout} s") from None
        if not data:
            break
        chunks.append(data)
        if stop_at_data:
            break
    return b"".join(chunks)


def read_reply(sock: socket.socket, timeout: float = 10.0) -> dict[str, Any]:
    """One reply frame, decoded to its map with the header's version as "v" (fds are not expected here)."""
    sock.settimeout(timeout)
    version, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
    return {**msgpack.unpackb(_recv_exact(sock, length), raw=False), "v": version}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AssertionError(f"the daemon closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return data


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)
