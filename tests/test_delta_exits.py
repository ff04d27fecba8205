"""Honest exits for versions built from a delta: exit 0 means the key asked for is served.

A delta whose metadata names its parent's own checkpoint is refused, not taken for "already served"; a good build
of a key another process is still loading (a damaged delta claiming the same key) waits for that load's outcome
and builds the key itself when it fails, instead of exiting 0 with nothing serving it; a delta claiming a key
another daemon serves exits 0 only when its changes make that key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives, wait_for  # noqa: F401
from helpers import assert_one_error_sentence, environment
from test_delta_versions import _bad, _entries, _key_id, _preload_damaged_delta, versions  # noqa: F401
from wcache.ipc.run_dir.directory import daemon_name


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def test_a_delta_claiming_its_parents_own_checkpoint_is_refused(
    rig: DaemonRig, versions: dict[str, Path], tmp_path: Path,  # noqa: F811  (test_delta_versions' fixture)
) -> None:
    parent = rig.preload(versions["parent"])[0]
    tensors, metadata = _entries(versions)
    metadata["checkpoint"] = metadata["parent"]  # its changes make another checkpoint
    lying = _bad(tensors, metadata, tmp_path)
    result = rig.cli("preload", "--from", parent.name, "--delta", str(lying), "--detach", "--run-dir",
                     str(rig.run_dir))
    rig._remember_supervisors()
    assert "names its parent's checkpoint" in assert_one_error_sentence(result, str(lying))
    assert rig.settled() == rig.settled([parent])


# Stands for a damaged build of the same key: it holds that key's lock while "loading", publishes nothing, and
# fails (exit 1) when its stdin closes.
_HOLDER = """
import sys
from pathlib import Path
from wcache.ipc.run_dir.directory import hold_daemon_lock
hold_daemon_lock(Path(sys.argv[1]), sys.argv[2], "cpu")
print("held", flush=True)
sys.stdin.readline()
sys.exit(1)
"""


def test_a_good_build_waits_out_a_failing_holder_and_serves_the_key(
    rig: DaemonRig, versions: dict[str, Path],  # noqa: F811  (test_delta_versions' fixture)
) -> None:
    parent = rig.preload(versions["parent"])[0]
    name = daemon_name("cpu", _key_id(versions["materialized"]))
    env = environment(rig.env)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(rig.run_dir), name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    good = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        good = subprocess.Popen([sys.executable, "-m", "wcache_cli.main", "preload", "--from", parent.name,
                                 "--delta", str(versions["delta"]), "--detach", "--json", "--run-dir",
                                 str(rig.run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, stdin=subprocess.DEVNULL)
        # Once its rank meets the holder's lock, the good build neither exits 0 ("already loading") nor gives up.
        def met_the_lock() -> bool:
            logs = (rig.run_dir / "logs").glob("preload-*-rank0.log")
            return good.poll() is not None or any("waiting for its outcome" in p.read_text() for p in logs)

        wait_for(met_the_lock, timeout=60, what="the good build's rank to meet the holder's lock")
        assert good.poll() is None, good.communicate()
        assert holder.stdin is not None
        holder.stdin.close()  # the damaged build fails, publishing nothing
        assert holder.wait(timeout=30) == 1
        stdout, stderr = good.communicate(timeout=120)
        rig._remember_supervisors()
        assert good.returncode == 0, stderr
        assert json.loads(stdout)["event"] == "ready"
        assert name in {d.name for d in rig.descriptors()}  # the key asked for is served
        assert rig.stats(next(d for d in rig.descriptors() if d.name == name))["state"] == "ready"
    finally:
        for process in (holder, good):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        rig._remember_supervisors()
        assert os.path.isdir(rig.run_dir)


@pytest.mark.parametrize("options", [(), ("--tp", "2")], ids=["tp1", "tp2"])  # tp2: tensors read from disk
def test_a_delta_claiming_a_served_key_it_does_not_make_is_refused(
    rig: DaemonRig, versions: dict[str, Path], tmp_path: Path, options: tuple[str, ...],  # noqa: F811
) -> None:
    parents = rig.preload(versions["parent"], *options)
    parent = parents[0]
    served = rig.preload(versions["materialized"], *options)  # the key the delta names, already served
    # The honest delta builds that key: "already serves" is the truth, and exit 0.
    honest = rig.cli("preload", "--from", parent.name, "--delta", str(versions["delta"]), "--detach", "--run-dir",
                     str(rig.run_dir))
    rig._remember_supervisors()
    assert honest.returncode == 0 and "already serves this key" in honest.stdout, honest.stderr
    # Changes that make another checkpoint under the same claim: refused, never "already serves".
    result, damaged = _preload_damaged_delta(rig, versions, parent, tmp_path)
    assert result.returncode == 2 and "the delta is damaged" in assert_one_error_sentence(result, str(damaged))
    assert sorted(d.name for d in rig.descriptors()) == sorted(d.name for d in parents + served)
    assert all(rig.stats(p)["leases"] == 0 for p in parents)
