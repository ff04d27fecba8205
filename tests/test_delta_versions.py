"""Weight versions: sparse deltas on disk, and the next daemon built from the one holding the parent.

Real checkpoints, real delta files, real daemon processes: the new version's key must equal a cold key of the
checkpoint the delta materializes, and its processed tensors must equal a disk load of that checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives  # noqa: F401
from helpers import SAME_AS_DISK, assert_one_error_sentence, one_sentence, wcache_process
from safetensors.torch import load_file, save_file
from wcache.delta.format import FORMAT, read_delta
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.key.compute import compute_key
from wcache_dev.synth import write_training_step


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory, tiny_template: Path) -> dict[str, Path]:
    """N (the tiny checkpoint), N+1 (2% of every tensor's elements moved), the delta, N+1 materialized, and N+2
    (N+1 after another such step)."""
    base = tmp_path_factory.mktemp("versions")
    parent = tiny_template
    child = write_training_step(parent, base / "n1", 0.02)
    grandchild = write_training_step(child, base / "n2", 0.02, seed=2)
    delta = base / "step.safetensors"
    made = wcache_process("delta", str(parent), str(child), "-o", str(delta), "--json")
    assert made.returncode == 0, made.stderr
    materialized = base / "materialized"
    applied = wcache_process("delta", "--apply", str(parent), str(delta), "-o", str(materialized), "--json")
    assert applied.returncode == 0, applied.stderr
    return {"parent": parent, "child": child, "grandchild": grandchild, "delta": delta, "materialized": materialized}


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def _key_id(path: Path, *options: str) -> str:
    result = wcache_process("key", str(path), "--json", *options)
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout)["id"])


def test_delta_materializes_the_new_checkpoint(versions: dict[str, Path]) -> None:
    assert _key_id(versions["materialized"]) == _key_id(versions["child"])
    assert (versions["materialized"] / "config.json").read_bytes() == (versions["parent"] / "config.json").read_bytes()
    parent = compute_key(versions["parent"])
    delta = read_delta(versions["delta"], {e.name: e for e in parent.manifest})
    assert delta.parent == parent.key.checkpoint
    assert delta.checkpoint == compute_key(versions["child"]).key.checkpoint
    # Every tensor moved by 2%: every one is in the delta, sparsely, and the file is a small part of the checkpoint.
    assert set(delta.changes) == {e.name for e in parent.manifest}
    assert all(c.indices is not None for c in delta.changes.values())
    assert versions["delta"].stat().st_size < 0.15 * parent.total_bytes


def _entries(versions: dict[str, Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(versions["delta"]), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118


def _bad(tensors: dict[str, torch.Tensor], metadata: dict[str, str], tmp_path: Path) -> Path:
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


LAYER = "model.layers.0.mlp.down_proj.weight"


def _preload_damaged_delta(rig: DaemonRig, versions: dict[str, Path], parent: DaemonDescriptor,
                           tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`preload --from PARENT --delta D` with a delta whose values no longer make the checkpoint it names (the
    build notices only after applying them); the CLI's result and the delta's path."""
    tensors, metadata = _entries(versions)
    tensors[f"{LAYER}:values"] = (tensors[f"{LAYER}:values"] * 2).contiguous()
    damaged = _bad(tensors, metadata, tmp_path)
    result = rig.cli("preload", "--from", parent.name, "--delta", str(damaged), "--detach", "--run-dir",
                     str(rig.run_dir))
    rig._remember_supervisors()
    return result, damaged


def _unsorted(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    t[f"{LAYER}:indices"] = t[f"{LAYER}:indices"].flip(0).contiguous()


def _repeated(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    idx = t[f"{LAYER}:indices"].clone()
    idx[1] = idx[0]
    t[f"{LAYER}:indices"] = idx


def _out_of_range(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    idx = t[f"{LAYER}:indices"].clone()
    idx[-1] = 10**9
    t[f"{LAYER}:indices"] = idx


def _wrong_dtype(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    t[f"{LAYER}:values"] = t[f"{LAYER}:values"].to(torch.float16)


def _unknown_tensor(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    t["model.nothing.weight:tensor"] = torch.zeros(2)


def _no_values(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    del t[f"{LAYER}:values"]


def _no_parent(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    del m["parent"]


def _wrong_format(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    m["format"] = "pt"


@pytest.mark.parametrize(("break_it", "words"), [
    (_unsorted, "not sorted"), (_repeated, "repeated"), (_out_of_range, "outside"), (_wrong_dtype, "F16"),
    (_unknown_tensor, "does not hold"), (_no_values, ":values"), (_no_parent, "parent"), (_wrong_format, FORMAT),
])
def test_a_delta_that_breaks_the_format_is_one_sentence(versions: dict[str, Path], tmp_path: Path, break_it: object,
                                                        words: str) -> None:
    tensors, metadata = _entries(versions)
    break_it(tensors, metadata)  # type: ignore[operator]
    bad = _bad(tensors, metadata, tmp_path)
    result = wcache_process("delta", "--apply", str(versions["parent"]), str(bad), "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert words in assert_one_error_sentence(result)
    assert not (tmp_path / "out").exists()


def test_a_delta_applied_to_another_checkpoint_is_refused(versions: dict[str, Path], tmp_path: Path) -> None:
    result = wcache_process("delta", "--apply", str(versions["child"]), str(versions["delta"]), "-o",
                            str(tmp_path / "out"))
    assert result.returncode == 2 and "apply it to its own parent" in assert_one_error_sentence(result)
    assert not (tmp_path / "out").exists()


def _preload_from(rig: DaemonRig, parent: str, delta: Path) -> dict[str, object]:
    result = rig.cli("preload", "--from", parent, "--delta", str(delta), "--detach", "--json", "--run-dir",
                     str(rig.run_dir))
    rig._remember_supervisors()
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


@pytest.mark.parametrize("options", [(), ("--dtype", "bfloat16"), ("--tp", "2"), ("--quantization", "int8")],
                         ids=["fused", "cast", "tp2", "int8"])
def test_next_version_from_the_daemon_holding_the_parent(rig: DaemonRig, versions: dict[str, Path],
                                                         options: tuple[str, ...]) -> None:
    parents = rig.preload(versions["parent"], *options)
    ready = _preload_from(rig, parents[0].name, versions["delta"])
    child_ids = sorted(r["key_id"] for r in ready["ranks"])  # type: ignore[union-attr]
    tp = len(parents)
    expected = sorted(_key_id(versions["materialized"], *options, "--tp", str(tp), "--rank", str(r))
                      for r in range(tp))
    assert child_ids == expected  # the content key of the materialized checkpoint, rank by rank
    by_name = {d.name: d for d in rig.descriptors()}
    children = [d for d in by_name.values() if d.parent_key_id is not None]
    assert sorted(d.parent for d in children) == sorted(p.name for p in parents)  # type: ignore[type-var]
    # The parent still serves, next to its successor, and status shows the lineage.
    status = rig.status()
    assert {d["state"] for d in status["daemons"]} == {"ready"} and len(status["daemons"]) == 2 * tp
    table = rig.cli("status", "--run-dir", str(rig.run_dir)).stdout
    assert f"{parents[0].key_id} → " in table
    # A version is named by its lineage's checkpoint, never by the delta file it was built from.
    assert {d["model"] for d in status["daemons"]} == {versions["parent"].name}, status["daemons"]
    assert versions["delta"].name not in table
    ready_events = [e for e in rig.events("ready") if e.get("parent_key_id")]
    assert len(ready_events) == tp and all(e["bytes_read"] >= versions["delta"].stat().st_size for e in ready_events)
    if not options:
        # The default plan holds every tensor whole: nothing but the delta is read.
        assert all(e["bytes_read"] == versions["delta"].stat().st_size for e in ready_events)
    dtype = dict(zip(options[::2], options[1::2], strict=True)).get("--dtype", "auto")
    quantization = dict(zip(options[::2], options[1::2], strict=True)).get("--quantization", "none")
    checked = rig.python(SAME_AS_DISK, str(versions["materialized"]), str(tp), dtype, quantization, str(rig.run_dir))
    assert checked.returncode == 0, checked.stderr
    assert set(checked.stdout.split()) == {d.name for d in children}


def test_a_delta_for_another_parent_starts_nothing(rig: DaemonRig, versions: dict[str, Path]) -> None:
    rig.preload(versions["child"])
    before = rig.descriptors()
    result = rig.cli("preload", "--from", before[0].name, "--delta", str(versions["delta"]), "--detach",
                     "--run-dir", str(rig.run_dir))
    assert result.returncode == 2 and "apply it to its own parent" in assert_one_error_sentence(result)
    assert rig.settled() == rig.settled(before)


def test_a_damaged_delta_publishes_nothing_and_the_parent_serves_on(rig: DaemonRig, versions: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    parent = rig.preload(versions["parent"])[0]
    result, _ = _preload_damaged_delta(rig, versions, parent, tmp_path)
    assert result.returncode == 2 and "the delta is damaged" in assert_one_error_sentence(result)
    assert rig.settled() == rig.settled([parent])
    assert not [p for p in rig.run_dir.glob("*.sock") if p.name != Path(parent.socket).name]
    assert rig.stats(parent)["state"] == "ready" and rig.stats(parent)["leases"] == 0


def test_from_needs_delta_and_no_model(rig: DaemonRig, versions: dict[str, Path]) -> None:
    result = rig.cli("preload", "--from", "cpu-0", "--run-dir", str(rig.run_dir))
    assert result.returncode == 2 and "go together" in assert_one_error_sentence(result)
    result = rig.cli("preload", "--from", "nothing", "--delta", str(versions["delta"]), "--run-dir", str(rig.run_dir))
    assert result.returncode == 3 and "no running daemon" in one_sentence(result.stderr)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for shard in sorted(path.glob("*.safetensors")) for k, v in load_file(shard).items()}


def test_the_materialized_checkpoint_holds_the_new_tensors(versions: dict[str, Path]) -> None:
    made, want = _tensors(versions["materialized"]), _tensors(versions["child"])
    assert made.keys() == want.keys() and all(torch.equal(made[k], want[k]) for k in want)


# -- publishing from tensors in memory (wcache.daemon.publish) -------------------------------------------------

_PUBLISH = """
import sys
from pathlib import Path
from safetensors.torch import load_file
from wcache.daemon.publish import publish
from wcache.delta.format import DeltaError
entries = load_file(sys.argv[3])
changes = {}
for entry, tensor in entries.items():
    name, _, part = entry.rpartition(":")
    if part == "tensor":
        changes[name] = tensor
    elif part == "indices":
        changes[name] = (tensor, entries[name + ":values"])
bad = dict(changes)
name = sorted(bad)[0]
bad[name] = (bad[name][0].flip(0), bad[name][1]) if isinstance(bad[name], tuple) else bad[name].reshape(-1)
try:
    publish(sys.argv[2], bad, run_dir=Path(sys.argv[4]))
except DeltaError as exc:
    print("refused:", exc)
published = publish(sys.argv[2], changes, run_dir=Path(sys.argv[4]))
print(published.key.short_id)
"""


def test_a_training_loop_publishes_its_changed_tensors_and_gets_the_new_key(rig: DaemonRig,
                                                                            versions: dict[str, Path]) -> None:
    [parent] = rig.preload(versions["parent"])
    done = rig.python(_PUBLISH, parent.name, str(versions["delta"]), str(rig.run_dir))
    rig._remember_supervisors()
    assert done.returncode == 0, done.stderr
    refused, key_id = done.stdout.strip().splitlines()[-2:]
    assert refused.startswith("refused: the change to") and "refused" in refused
    assert key_id == _key_id(versions["materialized"])
    assert {d.key_id for d in rig.descriptors()} == {parent.key_id, key_id}
    assert {d["state"] for d in rig.status()["daemons"]} == {"ready"}


_PUBLISH_STEPS = """
import os
import subprocess
import sys
from pathlib import Path
from safetensors.torch import load_file
from wcache.checkpoint.files import locate
from wcache.daemon.publish import publish
tensors = {}
for shard in locate(Path(sys.argv[2])).shards:
    tensors.update(load_file(str(shard)))
name = next(n for n in sorted(tensors) if n.endswith("norm.weight"))
current, run_dir = sys.argv[3], Path(sys.argv[4])
for step in range(1, 4):
    published = publish(current, {name: tensors[name] * (1 + step)}, run_dir=run_dir)
    subprocess.run([sys.executable, "-m", "wcache_cli.main", "stop", current, "--run-dir", str(run_dir)], check=True,
                   capture_output=True)
    current = published.daemons[0]
memfds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
          if os.path.exists(f"/proc/self/fd/{fd}") and "memfd" in os.readlink(f"/proc/self/fd/{fd}")]
print(current, len(memfds))
"""


def test_publish_steps_leave_no_arena_behind(rig: DaemonRig, versions: dict[str, Path]) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    [parent] = rig.preload(versions["parent"])
    done = rig.python(_PUBLISH_STEPS, str(versions["parent"]), parent.name, str(rig.run_dir))
    rig._remember_supervisors()
    assert done.returncode == 0, done.stderr
    last, memfds = done.stdout.split()
    assert memfds == "0"  # the publishing process maps no arena
    [only] = rig.descriptors()  # every retired version stopped, its arena with it
    assert only.name == last
    assert not list(rig.run_dir.glob("publish-*"))  # no delta left behind
    daemons = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_rig_daemon(int(p), rig.run_dir)]
    arenas = set()
    for pid in daemons:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if "memfd:wcache-arena" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    arenas.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    assert len(arenas) == 1  # the newest version's, held by its one daemon
    # vLLM servers other tests start meanwhile (the suite runs in parallel) name theirs psm_* and vllm_*;
    # nothing this test starts imports vLLM
    made = {n for n in set(os.listdir("/dev/shm")) - shm_before if not n.startswith(("psm_", "vllm_"))}
    assert made == set()


_PUBLISH_CHAIN = """
import sys
from pathlib import Path
import torch
from wcache.daemon.publish import publish
from wcache.errors import UnavailableError
from wcache_dev.synth import read_tensors
n, n1, n2 = (read_tensors(Path(p)) for p in sys.argv[2:5])
current, run_dir, last = sys.argv[5], Path(sys.argv[6]), sys.argv[7]

def sparse(before, after):
    changes = {}
    for name, new in after.items():
        bits = {2: torch.int16, 4: torch.int32}[new.element_size()]
        where = (new.reshape(-1).view(bits) != before[name].reshape(-1).view(bits)).nonzero().reshape(-1)
        if where.numel():
            changes[name] = (where, new.reshape(-1)[where].clone())
    return changes

first = publish(current, sparse(n, n1), run_dir=run_dir)
print(first.key.short_id)
if last == "whole":
    try:
        publish(first.daemons[0], sparse(n1, n2), run_dir=run_dir)
    except UnavailableError as exc:
        print("unavailable:", exc)
    second = publish(first.daemons[0], n2, run_dir=run_dir)
else:
    second = publish(first.daemons[0], sparse(n1, n2), run_dir=run_dir)
print(second.key.short_id)
"""


def test_a_chain_of_sparse_publishes_reads_each_parent_from_its_arena(rig: DaemonRig,
                                                                      versions: dict[str, Path]) -> None:
    # N+1 is built from a delta file that publish deleted: N+2's sparse changes need N+1's tensors from its arena.
    [parent] = rig.preload(versions["parent"])
    done = rig.python(_PUBLISH_CHAIN, str(versions["parent"]), str(versions["child"]), str(versions["grandchild"]),
                      parent.name, str(rig.run_dir), "sparse")
    rig._remember_supervisors()
    assert done.returncode == 0, done.stderr
    n1_id, n2_id = done.stdout.split()
    assert n1_id == _key_id(versions["child"])
    assert n2_id == _key_id(versions["grandchild"])  # the cold key of the checkpoint with both steps applied
    assert {d.key_id for d in rig.descriptors()} == {parent.key_id, n1_id, n2_id}
    assert {d["state"] for d in rig.status()["daemons"]} == {"ready"}
    assert not list(rig.run_dir.glob("publish-*"))


def test_a_sparse_publish_from_a_casting_parent_without_its_checkpoint_is_one_sentence(
        rig: DaemonRig, versions: dict[str, Path]) -> None:
    # The plan casts float32 to bfloat16: the arena does not hold the checkpoint's bytes, so N+1's sparse changes
    # read N's from its checkpoint on disk; N+1's only file was a deleted delta, so N+2's cannot, but whole do.
    cast = ("--dtype", "bfloat16")
    [parent] = rig.preload(versions["parent"], *cast)
    done = rig.python(_PUBLISH_CHAIN, str(versions["parent"]), str(versions["child"]), str(versions["grandchild"]),
                      parent.name, str(rig.run_dir), "whole")
    rig._remember_supervisors()
    assert done.returncode == 0, done.stderr
    n1_id, refused, n2_id = done.stdout.strip().splitlines()
    assert n1_id == _key_id(versions["child"], *cast)
    assert refused.startswith("unavailable: tensor ") and refused.endswith("; whole new tensors work.")
    assert "publish of sparse changes needs the parent's tensors as the checkpoint held them" in refused
    assert n2_id == _key_id(versions["grandchild"], *cast)
    assert {d.key_id for d in rig.descriptors()} == {parent.key_id, n1_id, n2_id}


def _is_rig_daemon(pid: int, run_dir: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"wcache.daemon" in cmdline and str(run_dir).encode() in cmdline
