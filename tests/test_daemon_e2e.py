"""End to end on CPU: real `wcache preload` daemons, real sockets and memfds, real HTTP, real CLI runs.

Each rig is a private run dir under /tmp that is stopped, swept (SIGKILL) and removed however a test ends;
the module checks at the end that no process mentioning any rig's path survived.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from as_nobody import NOBODY
from daemon_fixtures import (
    DaemonRig,
    copy_checkpoint,
    daemon_rig,
    http_status,
    mode_of,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    request_frame,
    wait_for,
)
from helpers import WCACHE, one_sentence, processes_mentioning, wait_past_racy_window
from wcache.attach import AttachedWeights, attach
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.wire.client import request_once
from wcache.ipc.wire.messages import CheckArena, Stats
from wcache.key.compute import compute_key
from wcache.load.loader import load_from_disk, processed_digest
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import overwrite_tensor_bytes, write_checkpoint, write_tensors

# Which checkpoint bytes each zeroed copy overwrites, and the processed tensor that must differ on rank 0.
ZEROED = {
    "norm": ("model.norm.weight", 0, 256),
    # Rows 4..7 of the vocab-parallel embedding: past the first KiB, inside rank 0's half of the vocab.
    "embed": ("model.embed_tokens.weight", 1024, 1024),
}


@pytest.fixture(scope="module")
def shared(tiny_template: Path) -> Iterator[tuple[DaemonRig, Path, list[DaemonDescriptor]]]:
    """`tiny` preloaded with --tp 2 on cpu; tests on it only attach, read and compare."""
    with daemon_rig() as rig:
        model = copy_checkpoint(tiny_template, rig.base / "tiny")
        yield rig, model, rig.preload(model, "--tp", "2")


@pytest.fixture(scope="module")
def zeroed(shared: tuple[DaemonRig, Path, list[DaemonDescriptor]]) -> dict[str, Path]:
    """Copies of the shared checkpoint with part of one tensor zeroed."""
    rig, model, _ = shared
    copies = {}
    for label, (tensor, start, size) in ZEROED.items():
        copy = copy_checkpoint(model, rig.base / f"zeroed-{label}")
        overwrite_tensor_bytes(copy, tensor, start, bytes(size))
        copies[label] = copy
    return copies


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_byte_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert tuple(got[name].shape) == tuple(want[name].shape), name
        assert torch.equal(as_bytes(got[name]), as_bytes(want[name])), f"{name} differs"


def disk_tensors(model: Path, spec: PlanSpec) -> dict[str, torch.Tensor]:
    return load_from_disk(compute_key(model, spec), model)


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """BLAKE3 of every tensor's bytes: reads (touches) every byte without copying it."""
    return {name: processed_digest(t) for name, t in tensors.items()}


def assert_arena_sealed(daemon_pid: int) -> None:
    """The daemon's arena, reopened through /proc as a same-uid attacker would, refuses every kind of write."""
    fd_dir = Path(f"/proc/{daemon_pid}/fd")
    arenas = []
    for name in os.listdir(fd_dir):
        with contextlib.suppress(FileNotFoundError):  # a descriptor the daemon closed while we listed
            if "memfd:wcache-arena" in os.readlink(fd_dir / name):
                arenas.append(fd_dir / name)
    assert arenas, f"daemon {daemon_pid} holds no arena memfd"
    for path in arenas:
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)


def memfd_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if "memfd:wcache-arena" in line]


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- 1. TP=2 zero-copy attach equals the disk path; a second engine adds no private copy ---------------------


def test_tp2_zero_copy_attach_is_byte_equal_to_disk(shared: tuple[DaemonRig, Path, list[DaemonDescriptor]]) -> None:
    rig, model, daemons = shared
    assert [d.tp_rank for d in daemons] == [0, 1]
    assert len({d.key_id for d in daemons}) == 2, "each rank's processed bytes have their own key"
    maps_before = set(memfd_maps())
    for descriptor in daemons:
        spec = PlanSpec(tp_size=2, tp_rank=descriptor.tp_rank)
        with attach(model, spec, run_dir=rig.run_dir) as weights:
            report = weights.report
            assert (report.outcome, report.mode, report.daemon) == ("hit", "zero_copy", descriptor.name)
            assert report.bytes_mapped == descriptor.weights_bytes
            assert_byte_equal(weights.tensors, disk_tensors(model, spec))
            # The engine's map of the arena is private (copy-on-write), never a shared writable one.
            new_maps = [m for m in memfd_maps() if m not in maps_before]
            assert new_maps and all(m.split()[1] == "rw-p" for m in new_maps), new_maps
            assert rig.stats(descriptor)["leases"] == 1
            # An engine that post-processes a weight in place gets its own page; nobody else sees the write.
            name, victim = next((n, t) for n, t in weights.tensors.items() if t.numel() > 0)
            victim.add_(1)
            with attach(model, spec, run_dir=rig.run_dir) as other:
                assert torch.equal(other.tensors[name], disk_tensors(model, spec)[name])
                assert not torch.equal(other.tensors[name], victim)
            assert_arena_sealed(descriptor.pid)
        wait_for(lambda d=descriptor: rig.stats(d)["leases"] == 0, what="the lease to end after close()")
    hits = [e for e in rig.events("attach_hit") if e["source"] == str(model)]
    assert {e["daemon"] for e in hits} >= {d.name for d in daemons}


def test_health_metrics_and_stats_while_ready(shared: tuple[DaemonRig, Path, list[DaemonDescriptor]]) -> None:
    _, _, daemons = shared
    url = daemons[0].health_url
    assert url and url.startswith("http://127.0.0.1:")
    assert all(d.health_url == url for d in daemons), "one supervisor serves health for every rank"
    code, body = http_status(f"{url}/health")
    assert code == 200 and isinstance(body, dict) and body["status"] == "ok"
    assert sorted(r["tp_rank"] for r in body["ranks"]) == [0, 1]
    code, metrics = http_status(f"{url}/metrics")
    assert code == 200 and isinstance(metrics, str)
    ready_lines = [line for line in metrics.splitlines() if line.startswith("wcache_daemon_ready{")]
    assert len(ready_lines) == 2 and all(line.endswith(" 1.0") for line in ready_lines), ready_lines
    assert "wcache_attaches_total" in metrics and "wcache_bad_frames_total" in metrics
    code, stats = http_status(f"{url}/stats")
    assert code == 200 and isinstance(stats, dict)
    assert {r["name"] for r in stats["ranks"]} == {d.name for d in daemons}


def test_a_daemon_serving_checkpoint_bytes_unchanged_never_loads_torch(rig: DaemonRig, tiny_template: Path) -> None:
    # TP 1 fused without a cast: every output is a tensor or tensors stacked whole (qkv, gate_up), so the daemon
    # fills its arena with no `import torch` (seconds of start-up); an int8 plan computes, and loads it.
    model = copy_checkpoint(tiny_template, rig.base / "tiny")
    for spec, options, loads_torch in ((PlanSpec(), (), False),
                                       (PlanSpec(quantization="int8"), ("--quantization", "int8"), True)):
        (daemon,) = rig.preload(model, *options)
        maps = Path(f"/proc/{daemon.pid}/maps").read_text()
        assert ("libtorch" in maps) == loads_torch, f"daemon for {spec} mapped libtorch: {'libtorch' in maps}"
        with attach(model, spec, run_dir=rig.run_dir) as weights:
            assert weights.report.outcome == "hit"
            assert_byte_equal(weights.tensors, disk_tensors(model, spec))
        assert request_once(daemon.socket, CheckArena()).changed == ()


def test_second_engine_zero_copy_adds_no_private_copy(rig: DaemonRig) -> None:
    # 64 MiB of weights, so that a private copy (or its absence) stands far above interpreter noise (~1 MiB).
    generator = torch.Generator().manual_seed(7)
    big = {f"w{i}.weight": torch.randn(2048, 4096, generator=generator) for i in range(2)}
    weights_bytes = sum(t.numel() * t.element_size() for t in big.values())
    model = write_tensors(big, None, rig.base / "big", 1)
    del big
    # Past the racy window before the daemon hashes, so its receipts are trusted and no attach below re-hashes
    # the shard: a hash pass leaves its read buffers in a thread's malloc arena, megabytes that are not the attach's.
    wait_past_racy_window()
    spec = PlanSpec(layout="identity")
    (daemon,) = rig.preload(model, "--plan", "identity")
    assert daemon.weights_bytes >= weights_bytes

    engine = r"""
import gc, json, sys
from pathlib import Path
import psutil
import torch  # an engine has torch loaded before it attaches; its own memory is not the attach's
from wcache.attach import attach
from wcache.key.digest_store import DigestStore
from wcache.load.loader import processed_digest
from wcache.plan.spec import PlanSpec

base = Path(sys.argv[1])
me = psutil.Process()
def uss():
    gc.collect()
    return me.memory_full_info().uss
def touch(tensors):
    return {name: processed_digest(t) for name, t in tensors.items()}
result = {}
with DigestStore.open() as store:
    for mode in ("zero_copy", "copy", "clone"):
        before = uss()
        weights = attach(base / "big", PlanSpec(layout="identity"), mode="zero_copy" if mode == "clone" else mode,
                         run_dir=base / "r", store=store)
        tensors = {n: t.clone() for n, t in weights.tensors.items()} if mode == "clone" else weights.tensors
        touched = touch(tensors)
        result[mode] = {"outcome": weights.report.outcome, "uss_increase": uss() - before, "digests": touched}
        weights.close()
        del weights, tensors
print(json.dumps(result))
"""
    # This process is the first engine and keeps its lease while the second one attaches.
    with attach(model, spec, run_dir=rig.run_dir) as first:
        assert first.report.outcome == "hit"
        expected = digests(first.tensors)
        assert expected == digests(disk_tensors(model, spec))
        result = rig.python(engine)
        assert result.returncode == 0, result.stderr
        measured = json.loads(result.stdout)
        zero_copy, copy, clone = measured["zero_copy"], measured["copy"], measured["clone"]
        assert zero_copy["outcome"] == "hit" and copy["outcome"] == "hit"
        assert zero_copy["digests"] == expected == copy["digests"] == clone["digests"]
        for mode in (zero_copy, copy):  # copy mode on CPU is a private copy-on-write map: no byte copied
            assert mode["uss_increase"] < 0.10 * weights_bytes, (
                f"attach added {mode['uss_increase']} private bytes for {weights_bytes} of weights"
            )
        # The control: a real private copy of (about) every byte shows up in this measurement.
        assert clone["uss_increase"] > 0.90 * weights_bytes, clone
        # Our lease kept the daemon's weights: the copy engine's release did not pull them from under us.
        assert request_once(daemon.socket, Stats()).state == "ready"
        assert digests(first.tensors) == expected


# -- 2. A zeroed-tensor copy against a daemon holding the original ----------------------------------------------


@pytest.mark.parametrize("label", sorted(ZEROED))
def test_zeroed_copy_misses_and_falls_back_to_its_own_bytes(
    shared: tuple[DaemonRig, Path, list[DaemonDescriptor]], zeroed: dict[str, Path], label: str
) -> None:
    rig, model, daemons = shared
    copy, (tensor, _, _) = zeroed[label], ZEROED[label]
    spec = PlanSpec(tp_size=2, tp_rank=0)
    with attach(copy, spec, run_dir=rig.run_dir) as weights:
        report = weights.report
        assert report.outcome == "fallback"
        assert report.daemon == daemons[0].name, "the miss is explained against the daemon of the same rank"
        assert report.mismatched == ["checkpoint"]
        assert report.diff is not None
        assert [c.name for c in report.diff.changed] == [tensor]
        assert not report.diff.added and not report.diff.removed
        assert tensor in (report.reason or "")
        # The fallback holds the copy's own processed bytes, not the daemon's.
        assert_byte_equal(weights.tensors, disk_tensors(copy, spec))
        original = disk_tensors(model, spec)
        differing = [n for n in original if not torch.equal(as_bytes(original[n]), as_bytes(weights.tensors[n]))]
        assert differing == [tensor]
    misses = [e for e in rig.events("attach_miss") if e["source"] == str(copy)]
    assert misses, "no attach_miss event"
    assert misses[-1]["diff"]["changed"] == [tensor] and misses[-1]["mismatched"] == ["checkpoint"]
    assert misses[-1]["daemon"] == daemons[0].name
    fallbacks = [e for e in rig.events("fallback") if e["source"] == str(copy)]
    assert fallbacks and fallbacks[-1]["key_id"] == misses[-1]["key_id"]


def test_cli_attach_no_fallback_exits_3_naming_the_tensor(
    shared: tuple[DaemonRig, Path, list[DaemonDescriptor]], zeroed: dict[str, Path]
) -> None:
    rig, _, _ = shared
    result = rig.cli("attach", str(zeroed["norm"]), "--tp", "2", "--rank", "0", "--no-fallback",
                     "--run-dir", str(rig.run_dir))
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "model.norm.weight" in one_sentence(result.stderr)
    assert not [e for e in rig.events("fallback") if e["source"] == str(zeroed["norm"]) and e["pid"] != os.getpid()]


# -- 9. `wcache key` and `wcache diff` accept a running daemon ----------------------------------------------


def test_key_and_diff_take_a_daemon_operand(
    shared: tuple[DaemonRig, Path, list[DaemonDescriptor]], zeroed: dict[str, Path]
) -> None:
    rig, _, daemons = shared
    rank0 = daemons[0]
    key = rig.cli("key", rank0.name, "--json", "--run-dir", str(rig.run_dir), as_json=True)
    assert key["id"] == rank0.key_id
    assert key["key"] == rank0.key.to_json()
    assert (key["plan"]["tp_size"], key["plan"]["tp_rank"]) == (2, 0)

    diff = rig.cli("diff", rank0.name, str(zeroed["norm"]), "--tp", "2", "--rank", "0", "--json",
                   "--run-dir", str(rig.run_dir))
    assert diff.returncode == 1, diff.stderr
    document = json.loads(diff.stdout)
    assert document["identical"] is False
    assert document["a"]["id"] == rank0.key_id
    assert [f["name"] for f in document["fields"]] == ["checkpoint"]
    assert [c["name"] for c in document["tensors"]["changed"]] == ["model.norm.weight"]

    human = rig.cli("diff", rank0.name, str(zeroed["norm"]), "--tp", "2", "--rank", "0",
                    "--run-dir", str(rig.run_dir))
    assert human.returncode == 1 and "model.norm.weight" in human.stdout


# -- 5. Permissions, peer credentials, and the run dir check ---------------------------------------------------


def test_run_dir_is_0700_and_files_0600(shared: tuple[DaemonRig, Path, list[DaemonDescriptor]]) -> None:
    rig, _, daemons = shared
    assert mode_of(rig.run_dir) == 0o700
    for d in daemons:
        assert stat.S_ISSOCK(os.lstat(d.socket).st_mode)
        assert mode_of(Path(d.socket)) == 0o600, d.socket
        assert mode_of(rig.run_dir / f"{d.name}.json") == 0o600
    assert mode_of(rig.run_dir / "events.jsonl") == 0o600


# The peer starts as root (this interpreter may not be runnable by another uid, see tests/as_nobody.py) and
# drops to NOBODY itself before it touches the socket; 65534 below is as_nobody.NOBODY.
PEER = r"""
import json, os, socket, sys
path = sys.argv[2]
frame = bytes.fromhex(sys.argv[3])
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
result = {"uid": os.getuid()}
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
try:
    sock.connect(path)
except PermissionError:
    result["connect"] = "EACCES"
else:
    result["connect"] = "ok"
    received = b""
    try:
        sock.sendall(frame)
        while chunk := sock.recv(65536):
            received += chunk
        result["ending"] = "eof"
    except (ConnectionResetError, BrokenPipeError) as exc:
        result["ending"] = type(exc).__name__
    except TimeoutError:
        result["ending"] = "timeout"
    result["received"] = len(received)
print(json.dumps(result))
"""


def test_a_client_of_another_uid_is_refused(shared: tuple[DaemonRig, Path, list[DaemonDescriptor]]) -> None:
    if os.getuid() != 0:
        pytest.skip("dropping to another uid needs root")
    rig, _, daemons = shared
    target = daemons[0]
    frame = request_frame("stats").hex()
    refused_before = rig.stats(target)["counters"].get("refused_peers", 0)

    # The 0700 run dir alone keeps another user from reaching the socket.
    through_run_dir = rig.python(PEER, target.socket, frame)
    assert through_run_dir.returncode == 0, through_run_dir.stderr
    assert json.loads(through_run_dir.stdout) == {"uid": NOBODY, "connect": "EACCES"}

    # SO_PEERCRED itself: a hard link of the socket in a traversable dir, the socket opened up for a moment.
    outside = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    rig.extra_paths.append(outside)
    outside.chmod(0o711)
    link = outside / "s.sock"
    os.link(target.socket, link)
    try:
        os.chmod(target.socket, 0o666)
        through_link = rig.python(PEER, str(link), frame)
    finally:
        os.chmod(target.socket, 0o600)
        link.unlink()
        outside.rmdir()
    assert through_link.returncode == 0, through_link.stderr
    seen = json.loads(through_link.stdout)
    assert seen["connect"] == "ok"
    assert seen["ending"] in ("eof", "ConnectionResetError", "BrokenPipeError"), seen
    assert seen["received"] == 0, "the daemon must not answer another uid at all"
    wait_for(lambda: rig.stats(target)["counters"].get("refused_peers", 0) == refused_before + 1,
             what="refused_peers to count the refusal")
    assert psutil.Process(target.pid).is_running()


@pytest.mark.parametrize("kind", ["open-0755", "symlink", "other-uid"])
def test_status_refuses_an_unsafe_run_dir(
    shared: tuple[DaemonRig, Path, list[DaemonDescriptor]], kind: str
) -> None:
    rig, _, _ = shared
    bad = rig.base / f"bad-{kind}"
    if kind == "open-0755":
        bad.mkdir()
        bad.chmod(0o755)
        expected = "accessible to group or others"
    elif kind == "symlink":
        bad.symlink_to(rig.run_dir)  # points at a perfectly good run dir: the link itself is refused
        expected = "symlink"
    else:
        if os.getuid() != 0:
            pytest.skip("chown to another uid needs root")
        bad.mkdir(mode=0o700)
        os.chown(bad, NOBODY, NOBODY)
        expected = f"uid {NOBODY}"
    result = rig.cli("status", "--run-dir", str(bad))
    assert result.returncode == 2, (result.stdout, result.stderr)
    sentence = one_sentence(result.stderr)
    assert str(bad) in sentence and expected in sentence, sentence


# -- 3. Copy mode: the engine owns its tensors, the daemon releases, /health turns 503 -------------------------


def test_copy_mode_owns_its_tensors_and_the_daemon_releases(rig: DaemonRig, tiny_template: Path) -> None:
    model = copy_checkpoint(tiny_template, rig.base / "tiny")
    daemons = rig.preload(model, "--tp", "2")
    url = daemons[0].health_url
    assert http_status(f"{url}/health")[0] == 200

    spec = PlanSpec(tp_size=2, tp_rank=0)
    maps_before = set(memfd_maps())
    weights = attach(model, spec, mode="copy", run_dir=rig.run_dir)
    assert (weights.report.outcome, weights.report.mode) == ("hit", "copy")
    # The engine's copy is a private (copy-on-write) map of the arena: never a shared one the daemon could
    # change, and it outlives the daemon (checked at the end).
    added = set(memfd_maps()) - maps_before
    assert added and all(line.split()[1].endswith("p") for line in added), added
    expected = disk_tensors(model, spec)
    assert_byte_equal(weights.tensors, expected)

    stats = rig.stats(daemons[0])
    assert (stats["state"], stats["holds_weights"], stats["weights_bytes"], stats["leases"]) == (
        "released", False, 0, 0)
    code, body = http_status(f"{url}/health")
    assert code == 503 and isinstance(body, dict) and body["status"] == "unavailable"

    # From the shell, a copy attach that only reports takes no weights: rank 1's daemon keeps its own.
    cli = rig.cli("attach", str(model), "--tp", "2", "--rank", "1", "--mode", "copy", "--json",
                  "--run-dir", str(rig.run_dir), as_json=True)
    assert (cli["outcome"], cli["mode"], cli["daemon"]) == ("hit", "copy", daemons[1].name)
    status = rig.status()
    assert {d["name"]: d["state"] for d in status["daemons"]} == {daemons[0].name: "released",
                                                                    daemons[1].name: "ready"}
    assert [d["health_status"] for d in status["daemons"] if d["name"] == daemons[0].name] == [503]
    releases = [e for e in rig.events("release") if e["mode"] == "copy"]
    assert {e["daemon"] for e in releases} == {daemons[0].name}

    # A released daemon serves nobody: the next engine falls back to disk.
    with attach(model, spec, run_dir=rig.run_dir) as later:
        assert later.report.outcome == "fallback"
        assert "released" in (later.report.reason or "")

    for d in daemons:
        os.kill(d.pid, signal.SIGTERM)
    for d in daemons:
        wait_for(lambda d=d: pid_gone(d.pid), what=f"daemon {d.name} to exit")
    # Nothing of the daemon backs them: the engine's tensors outlive it unchanged.
    assert_byte_equal(weights.tensors, expected)


# -- 4. Two checkpoints on one device; DP size never causes a miss ----------------------------------------------


@pytest.fixture(scope="module")
def seed1(shared: tuple[DaemonRig, Path, list[DaemonDescriptor]]) -> tuple[Path, DaemonDescriptor]:
    """A different checkpoint (seed 1) preloaded into the shared run dir, next to `tiny` --tp 2."""
    rig, _, _ = shared
    model = write_checkpoint("tiny", rig.base / "tiny-seed1", seed=1)
    (daemon,) = rig.preload(model)
    return model, daemon


def test_two_checkpoints_do_not_collide_and_dp_size_hits_the_same_daemon(
    shared: tuple[DaemonRig, Path, list[DaemonDescriptor]], seed1: tuple[Path, DaemonDescriptor]
) -> None:
    rig, first, daemons = shared
    second, b = seed1
    a = daemons[0]
    assert b.name not in {d.name for d in daemons} and b.socket not in {d.socket for d in daemons}
    assert a.device == b.device == "cpu"
    assert "checkpoint" in b.key.mismatched_fields(a.key)
    assert b.supervisor_pid != a.supervisor_pid, "each preload has its own supervisor"
    assert {d.name for d in rig.descriptors()} >= {a.name, daemons[1].name, b.name}
    for d in (*daemons, b):
        assert Path(d.socket).exists() and psutil.Process(d.pid).is_running()
    states = {d["name"]: d["state"] for d in rig.status()["daemons"]}
    assert all(states[d.name] == "ready" for d in (*daemons, b)), states

    for model, spec, daemon in ((first, PlanSpec(tp_size=2, tp_rank=0), a), (second, PlanSpec(), b)):
        with attach(model, spec, run_dir=rig.run_dir) as weights:
            assert (weights.report.outcome, weights.report.daemon) == ("hit", daemon.name)
            assert_byte_equal(weights.tensors, disk_tensors(model, spec))

    # DP size is not part of the key: engines with DP 1 and DP 4 share one dense daemon.
    engines: list[AttachedWeights] = []
    try:
        for dp_size in (1, 4):
            engines.append(attach(first, PlanSpec(tp_size=2, tp_rank=0), run_dir=rig.run_dir, dp_size=dp_size))
        assert [(w.report.outcome, w.report.daemon) for w in engines] == [("hit", a.name)] * 2
        # Earlier engines' leases end when the daemon notices their close, a moment later.
        wait_for(lambda: rig.stats(a)["leases"] == 2, what="two leases on the dense daemon")
        assert rig.stats(b)["leases"] == 0
    finally:
        for w in engines:
            w.close()
    hits = [e for e in rig.events("attach_hit") if e["daemon"] == a.name]
    assert {1, 4} <= {e["dp_size"] for e in hits}


# -- 7. kill -9 under an attached engine ------------------------------------------------------------------------


def test_kill_9_under_an_attached_engine(rig: DaemonRig, tiny_template: Path) -> None:
    model = copy_checkpoint(tiny_template, rig.base / "tiny")
    (daemon,) = rig.preload(model)
    spec = PlanSpec()
    with attach(model, spec, run_dir=rig.run_dir) as weights:
        assert weights.report.outcome == "hit"
        snapshot = {name: t.clone() for name, t in weights.tensors.items()}
        os.kill(daemon.pid, signal.SIGKILL)
        wait_for(lambda: pid_gone(daemon.pid), what="the killed daemon to exit")
        assert weights.lost.wait(5), "the engine did not notice its daemon was gone"
        assert weights.report.daemon_lost
        # The memfd outlives its daemon: the mapped tensors still read the same bytes.
        assert_byte_equal(weights.tensors, snapshot)
        assert_byte_equal(weights.tensors, disk_tensors(model, spec))
        assert all(torch.isfinite(t).all() for t in weights.tensors.values())
    lost = wait_for(lambda: [e for e in rig.events("daemon_lost") if e["daemon"] == daemon.name],
                    what="a daemon_lost event")
    assert lost[-1]["tensors_valid"] is True and lost[-1]["pid"] == os.getpid()

    files = (Path(daemon.socket), rig.run_dir / f"{daemon.name}.json")
    assert all(f.exists() for f in files), "a killed daemon cannot remove its own files"
    status = rig.status()
    assert [s["name"] for s in status["stale_removed"]] == [daemon.name]
    assert status["daemons"] == []
    assert not any(f.exists() for f in files)
    assert rig.status()["stale_removed"] == [], "a stale daemon is reported once, then it is gone"


# -- 8. stop refuses while leased, --force stops; SIGTERM cleans up --------------------------------------------


@pytest.fixture(scope="module")
def stoppable(tiny_template: Path) -> Iterator[tuple[DaemonRig, Path, list[DaemonDescriptor]]]:
    """Two daemons of one checkpoint (fused and identity layouts): one is stopped by `wcache stop`, the other
    by SIGTERM. (Not two ranks of one TP group: a group stops whole.)"""
    with daemon_rig() as made:
        model = copy_checkpoint(tiny_template, made.base / "tiny")
        yield made, model, [*made.preload(model), *made.preload(model, "--plan", "identity")]


def test_stop_refuses_while_a_lease_is_held_and_force_stops(
    stoppable: tuple[DaemonRig, Path, list[DaemonDescriptor]]
) -> None:
    rig, model, daemons = stoppable
    target = daemons[0]
    spec = PlanSpec()
    with attach(model, spec, run_dir=rig.run_dir) as weights:
        assert weights.report.outcome == "hit"
        refused = rig.cli("stop", target.name, "--run-dir", str(rig.run_dir))
        assert refused.returncode == 2, (refused.stdout, refused.stderr)
        assert "lease" in one_sentence(refused.stderr)
        assert psutil.Process(target.pid).is_running()
        assert rig.stats(target)["leases"] == 1

        forced = rig.cli("stop", target.name, "--force", "--run-dir", str(rig.run_dir))
        assert forced.returncode == 0, forced.stderr
        assert f"stopped {target.name}" in forced.stdout
        assert pid_gone(target.pid)
        assert not Path(target.socket).exists()
        assert not (rig.run_dir / f"{target.name}.json").exists()
        assert weights.lost.wait(5)
        assert_byte_equal(weights.tensors, disk_tensors(model, spec))
    stops = [e for e in rig.events("stop") if e["daemon"] == target.name]
    assert len(stops) == 1 and stops[0]["leases"] == 1


def test_sigterm_removes_socket_and_descriptor(stoppable: tuple[DaemonRig, Path, list[DaemonDescriptor]]) -> None:
    rig, _, daemons = stoppable
    target = daemons[1]
    files = (Path(target.socket), rig.run_dir / f"{target.name}.json")
    assert all(f.exists() for f in files)
    os.kill(target.pid, signal.SIGTERM)
    wait_for(lambda: pid_gone(target.pid), what="the daemon to exit on SIGTERM")
    assert not any(f.exists() for f in files)
    assert [e["leases"] for e in rig.events("stop") if e["daemon"] == target.name] == [0]
    assert target.name not in {d["name"] for d in rig.status()["daemons"]}


def test_one_daemon_per_key_even_when_two_preloads_race(rig: DaemonRig) -> None:
    model = write_checkpoint("tiny", rig.base / "race")
    command = [*WCACHE, "preload", str(model), "--detach", "--json",
               "--run-dir", str(rig.run_dir)]
    racers = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **rig.env}, stdin=subprocess.DEVNULL) for _ in range(2)]
    outputs = [racer.communicate(timeout=120) for racer in racers]
    rig._remember_supervisors()
    assert [racer.returncode for racer in racers] == [0, 0], outputs
    documents = [json.loads(stdout) for stdout, _ in outputs]
    assert sorted(d["event"] for d in documents) == ["exists", "ready"], documents
    [winner] = [d for d in documents if d["event"] == "ready"]
    [loser] = [d for d in documents if d["event"] == "exists"]
    name = winner["ranks"][0]["name"]
    assert name in loser["reason"] and "nothing more was started" in loser["reason"]
    served = [d for d in rig.descriptors() if d.source == str(model)]
    assert [d.name for d in served] == [name]
    # Once it is ready, a third preload says so in one sentence and exits 0, starting nothing that stays.
    again = rig.cli("preload", str(model), "--detach", "--run-dir", str(rig.run_dir))
    assert again.returncode == 0 and again.stdout.strip().endswith("nothing more was started."), again
    assert f"daemon {name} (pid {served[0].pid}) already serves this key on cpu" in again.stdout
    wait_for(lambda: len(processes_mentioning(str(model))) == 2, timeout=15,
             what="only the winner's daemon and supervisor to remain")


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGHUP, -signal.SIGHUP),
                                                 (signal.SIGINT, 130)], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_to_a_foreground_preload_stops_every_rank(rig: DaemonRig, signum: int, status: int) -> None:
    model = write_checkpoint("tiny", rig.base / f"fg-{signum}")
    # As a shell starts a foreground job: with Ctrl-C's default action, even where this test runs from a
    # background job (whose children inherit SIGINT ignored, and rightly keep ignoring it).
    preload = subprocess.Popen(
        [*WCACHE, "preload", str(model), "--tp", "2", "--run-dir", str(rig.run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **rig.env},
        stdin=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert preload.stdout is not None
        ready = preload.stdout.readline()
        assert ready.startswith("READY"), ready + preload.stderr.read()
        rig._remember_supervisors()
        ranks = [d for d in rig.descriptors() if d.source == str(model)]
        assert len(ranks) == 2
        preload.send_signal(signum)
        assert preload.wait(timeout=60) == status
        for d in ranks:
            wait_for(lambda d=d: pid_gone(d.pid), timeout=30, what=f"rank {d.tp_rank} to exit")
        assert not [d for d in rig.descriptors() if d.source == str(model)], "descriptors were left behind"
        assert not list(rig.run_dir.glob(f"{ranks[0].name}.sock")) and not processes_mentioning(str(model))
    finally:
        if preload.poll() is None:
            preload.kill()
            preload.wait()


def test_the_library_stops_a_tp_group_it_started(rig: DaemonRig) -> None:
    """`start_daemons(...).stop()` on a TP group: the first rank's stop makes the supervisor stop the others,
    and that is no error; every rank, its files and the supervisor are gone."""
    from wcache.daemon.launch import start_daemons

    model = write_checkpoint("tiny", rig.base / "lib-tp2")
    group = start_daemons(model, tp=2, run_dir=rig.run_dir, env=rig.env)
    try:
        ranks = group.descriptors()
        assert sorted(d.tp_rank for d in ranks) == [0, 1]
        group.stop()
        assert group.supervisor.poll() is not None
        assert all(pid_gone(d.pid) for d in ranks)
        assert not [d for d in rig.descriptors() if d.source == str(model)]
    finally:
        if group.supervisor.poll() is None:
            group.terminate()
