"""Versions built in their parent's daemon process, and the version pool (wcache.daemon.version_host).

A real daemon preloaded with `--version-pool`, real `publish` calls from a training loop's process, real `wcache
stop`: every version must carry the cold key of its checkpoint, be served by the parent's process, and, once the
pool holds a retired ancestor, be written with only the elements the steps changed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives  # noqa: F401
from helpers import SAME_AS_DISK, wcache_process
from wcache.daemon.version_host import SPARE_GRACE_S, ArenaPool, VersionHost
from wcache.ipc.arenas.daemon_side import CpuArena
from wcache.ipc.wire.client import request_once
from wcache.ipc.wire.messages import BuildNext, BuiltNext, CheckArena
from wcache_dev.synth import write_training_step


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, tiny_template: Path) -> list[Path]:
    """N, N+1 and N+2 (each 2% of every tensor's elements moved from the one before)."""
    base = tmp_path_factory.mktemp("hosted")
    child = write_training_step(tiny_template, base / "n1", 0.02)
    return [tiny_template, child, write_training_step(child, base / "n2", 0.02, seed=2)]


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def _key_id(path: Path) -> str:
    result = wcache_process("key", str(path), "--json")
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout)["id"])


# Publishes N+1, N+2, then N+1 again (N+2's changes undone), stopping each parent once its child serves: the
# second and third builds find the retired grandparent's arena in the pool, brought forward to the parent.
_LOOP = """
import json
import subprocess
import sys
import time
from pathlib import Path
import torch
from wcache.daemon.publish import publish
from wcache_dev.synth import read_tensors
n, n1, n2 = (read_tensors(Path(p)) for p in sys.argv[2:5])
current, run_dir = sys.argv[5], Path(sys.argv[6])

def sparse(before, after):
    changes, changed = {}, 0
    for name, new in after.items():
        bits = {2: torch.int16, 4: torch.int32}[new.element_size()]
        where = (new.reshape(-1).view(bits) != before[name].reshape(-1).view(bits)).nonzero().reshape(-1)
        if where.numel():
            changes[name] = (where, new.reshape(-1)[where].clone())
            changed += where.numel() * new.element_size()
    return changes, changed

def brought_forward():
    return logged("a pooled arena brought forward to")

def logged(text):
    return sum(log.read_text().count(text) for log in (run_dir / "logs").glob("*rank0.log"))

deadline = time.monotonic() + 30  # the pool's spare, a copy of N's arena, made after READY
while not logged("the pool's spare holds a copy of") and time.monotonic() < deadline:
    time.sleep(0.02)
steps = []
for i, (before, after) in enumerate(((n, n1), (n1, n2), (n2, n1))):
    changes, changed = sparse(before, after)
    published = publish(current, changes, run_dir=run_dir)
    returned = time.monotonic()
    subprocess.run([sys.executable, "-m", "wcache_cli.main", "stop", current, "--run-dir", str(run_dir)], check=True,
                   capture_output=True)
    current = published.daemons[0]
    stopped_after = time.monotonic() - returned
    # The retired arena is brought forward to the version now served while the loop computes its next step.
    deadline = time.monotonic() + 30
    while brought_forward() < i + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    steps.append({"key_id": published.key.short_id, "name": current, "written": published.bytes_written,
                  "changed": changed, "brought_forward": brought_forward(),
                  "stopped_after": stopped_after})
print(json.dumps(steps))
"""


def test_a_training_loop_builds_each_version_in_the_parents_process_writing_only_what_changed(
        rig: DaemonRig, chain: list[Path]) -> None:
    [parent] = rig.preload(chain[0], "--version-pool", "64MiB")
    done = rig.python(_LOOP, *map(str, chain), parent.name, str(rig.run_dir))
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout)
    assert [s["key_id"] for s in steps] == [_key_id(chain[1]), _key_id(chain[2]), _key_id(chain[1])]
    total = parent.weights_bytes
    # No version had retired: N+1 was built in the pool's spare, which took a copy of N's arena after READY (its
    # bytes counted in N+1's), writing only the delta then.
    assert total <= steps[0]["written"] <= total + 3 * steps[0]["changed"]
    [log] = (rig.run_dir / "logs").glob("*rank0.log")
    built = [line for line in log.read_text().splitlines() if "built from daemon" in line]
    assert len(built) == 3 and all("(a pooled arena brought forward)" in line for line in built), built
    # Each retired version's arena went to the pool and was brought forward to its child, the version served,
    # before the next publish: that build wrote its own delta alone.
    assert [s["brought_forward"] for s in steps] == [1, 2, 3]
    # One spare, allocated at READY: each build took the pool's last arena, and a parent retired within the grace
    # the next spare waits for gives its arena instead, so the rank never holds three. The grace began before
    # publish returned and the retirement was over when stop returned.
    late = sum(s["stopped_after"] >= SPARE_GRACE_S for s in steps)
    assert 1 <= log.read_text().count("the version pool's spare arena allocated") <= 1 + late
    for step in steps[1:]:
        # The pool's arena held the grandparent: the step before was undone at its retirement and this one written,
        # nothing else (both counted in the step's bytes written).
        assert step["written"] <= 3 * step["changed"], step
        assert step["written"] < total / 10, step
    [last] = rig.descriptors()
    assert last.name == steps[-1]["name"]
    assert last.pid == parent.pid  # every version was built and is served by the process that loaded N
    # A stopped version's lock file goes with it (a loop makes a name per step); N+1's name was taken again.
    assert sorted(p.name for p in rig.run_dir.glob("cpu-*.lock")) == [f"{last.name}.lock"]
    assert last.parent is not None
    assert request_once(last.socket, CheckArena()).changed == ()  # its bytes are what its digests say
    checked = rig.python(SAME_AS_DISK, str(chain[1]), "1", "auto", "none", str(rig.run_dir))
    assert checked.returncode == 0, checked.stderr  # every engine tensor equals a disk load of N+1, byte for byte
    assert checked.stdout.split() == [last.name]
    assert {d["state"] for d in rig.status()["daemons"]} == {"ready"}
    stopped = rig.cli("stop", last.name, "--run-dir", str(rig.run_dir))
    assert stopped.returncode == 0, stopped.stderr
    assert _gone(parent.pid), "the daemon process outlived the last version it served"
    assert list(rig.run_dir.glob("cpu-*.lock")) == []


def _gone(pid: int, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_delta_that_does_not_make_what_it_names_builds_nothing_and_the_parent_serves_on(
        rig: DaemonRig, chain: list[Path], tmp_path: Path) -> None:
    from wcache.ipc.wire.client import DaemonError

    [parent] = rig.preload(chain[0], "--version-pool", "64MiB")
    delta = tmp_path / "step.safetensors"
    made = wcache_process("delta", str(chain[0]), str(chain[1]), "-o", str(delta))
    assert made.returncode == 0, made.stderr
    lying = tmp_path / "lying.safetensors"
    _rename_claim(delta, lying, "0" * 64)
    with pytest.raises(DaemonError, match=r"gives checkpoint [0-9a-f]{12}, not the 000000000000 the delta names"):
        _build_next(parent.socket, lying.read_bytes())
    with pytest.raises(DaemonError, match=r"the delta memfd:wcache-delta declares a \d+-byte header"):
        _build_next(parent.socket, (chain[0] / "config.json").read_bytes())
    with pytest.raises(DaemonError, match=r"is not a delta sealed against writes"):
        _build_next(parent.socket, delta.read_bytes(), sealed=False)  # its bytes could change under the build
    with pytest.raises(DaemonError, match=r"build_next needs its delta as one sealed memfd; 0 descriptors"):
        request_once(parent.socket, BuildNext())
    assert [d.name for d in rig.descriptors()] == [parent.name]
    assert {d["state"] for d in rig.status()["daemons"]} == {"ready"}
    assert _held_deltas(parent.pid) == []  # every refused delta's descriptor was closed, none kept
    # The arena the refused build wrote was kept for the pool (holding nothing): the next build still makes N+1.
    built = _build_next(parent.socket, delta.read_bytes())
    assert built.key_id == _key_id(chain[1])
    assert {d.key_id for d in rig.descriptors()} == {parent.key_id, built.key_id}
    # The built one's indices stay mapped while its step is remembered (an ancestor the pool holds is brought
    # forward along it): its one map, and the descriptor the map keeps.
    assert len(_held_deltas(parent.pid)) == 2


def _held_deltas(pid: int) -> list[str]:
    """The test's delta memfds daemon `pid` still holds open or mapped."""
    import os

    held = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
    held += [line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
    return [h for h in held if "test-delta" in h]


def _build_next(socket: Path, data: bytes, *, sealed: bool = True) -> BuiltNext:
    """Ask the daemon at `socket` to build the next version from the delta `data`, sent as a memfd."""
    import fcntl
    import os

    from wcache.delta.format import SEALED
    from wcache.ipc.wire.client import DaemonConnection

    fd = os.memfd_create("test-delta", os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
        with DaemonConnection(socket) as connection:
            return connection.request(BuildNext(), (fd,))
    finally:
        os.close(fd)


def _rename_claim(delta: Path, out: Path, checkpoint: str) -> None:
    """`delta` with its metadata claiming `checkpoint` as the one it makes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(delta), "pt") as opened:
        meta = dict(opened.metadata())
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    save_file(tensors, str(out), {**meta, "checkpoint": checkpoint})


def test_past_its_budget_the_pool_lets_a_blank_arena_go_before_a_version() -> None:
    """A retired version's arena can be brought forward by writing what changed since; a blank spare cannot."""
    def reusable() -> CpuArena:
        arena = CpuArena(4096)
        arena.seal(reusable=True)
        return arena

    pool = ArenaPool(2 * 4096)
    blank, older, newer = reusable(), reusable(), reusable()
    try:
        assert pool.offer(blank, None) and pool.offer(older, "aaaa")
        assert pool.offer(newer, "bbbb")
        assert blank.fd == -1 and sorted(pool.checkpoints()) == ["aaaa", "bbbb"]
        assert not pool.offer(reusable(), None)  # a blank offered to a pool of versions goes itself
        assert sorted(pool.checkpoints()) == ["aaaa", "bbbb"]
    finally:
        pool.close()


class _StandIn:
    """A version's server for the host's bookkeeping only: it serves until asked to stop, and retires as a daemon's
    server does on its way out."""

    def __init__(self, host: VersionHost, name: str) -> None:
        self.host, self.stop = host, threading.Event()
        hashed: Future[None] = Future()
        hashed.set_result(None)
        # No CPU arena: the host prepares no pool for it, and closes it as it retires.
        self.loaded = SimpleNamespace(arena=SimpleNamespace(close=lambda: None), outputs=hashed,
                                      key_file=SimpleNamespace(key=SimpleNamespace(checkpoint=name)))
        self.descriptor = SimpleNamespace(name=name)

    def serve_forever(self) -> None:
        self.stop.wait()
        self.host.retire(self, leases=1)  # type: ignore[arg-type]

    def request_stop(self) -> None:
        self.stop.set()


def test_the_process_serves_on_while_a_version_begun_from_its_last_one_starts(tmp_path: Path) -> None:
    """A build begun while its parent served is counted until its version's thread runs: the parent stopping
    meanwhile (the last version served) does not end the process's serving under the version starting. Stand-ins
    take the servers' place, and the test takes the places of build() and _start() in the host's bookkeeping."""
    host = VersionHost(tmp_path, 0.0, 0, make_server=None)  # type: ignore[arg-type]
    parent = _StandIn(host, "parent")
    serving = threading.Thread(target=host.serve, args=(parent,), daemon=True)
    serving.start()
    with host._lock:  # what build() holds from its parent check until its version's thread runs
        host._building += 1
    parent.request_stop()
    serving.join(0.5)
    assert serving.is_alive(), "serve() ended while a version was being started"
    child = _StandIn(host, "child")
    thread = threading.Thread(target=child.serve_forever, daemon=True)
    with host._lock:  # what _start does once the version's server is bound, then starts its thread
        host._servers.append(child)  # type: ignore[arg-type]
        host._threads.append(thread)
    thread.start()
    with host._lock:  # what build() does once _start returned
        host._building -= 1
    serving.join(0.5)
    assert serving.is_alive(), "serve() ended under the version built"
    host.request_stop_all()
    serving.join(10)
    assert not serving.is_alive()
