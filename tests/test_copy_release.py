"""Copy-mode release against a live daemon: a copy engine's release waits for every other attach in flight and
every lease, and an engine that comes after the weights are gone is told they went to a copy-mode engine."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_fixtures import (
    DaemonRig,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    preloaded_tiny,
    wait_for,
)
from wcache.attach import AttachedWeights, attach
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.wire.client import DaemonConnection
from wcache.ipc.wire.messages import Hello, MapRequest, Release, ReleaseReply, WantedKey

RELEASED = "released its weights to a copy-mode engine"


@pytest.fixture
def served(tiny_template: Path) -> Iterator[tuple[DaemonRig, Path, DaemonDescriptor]]:
    """A daemon of its own for each test: a release is the end of its weights."""
    with preloaded_tiny(tiny_template) as preloaded:
        yield preloaded


def map_and_close_fds(connection: DaemonConnection, mode: str) -> None:
    reply = connection.request(MapRequest(mode))
    assert reply.total_bytes > 0
    for fd in reply.fds:
        os.close(fd)


def assert_says_released(reason: str | None, copy_pid: int) -> None:
    assert reason is not None and f"{RELEASED} (pid {copy_pid}) at " in reason, reason
    assert "holds key" not in reason, f"a released daemon is not a key mismatch: {reason}"


def test_a_copy_release_waits_for_attaches_in_flight_and_leases(
    served: tuple[DaemonRig, Path, DaemonDescriptor],
) -> None:
    rig, model, daemon = served
    lease = attach(model, run_dir=rig.run_dir)  # a zero-copy engine serving
    silent = DaemonConnection(daemon.socket)  # an engine that connected and is still computing its key
    greeted = DaemonConnection(daemon.socket)  # an engine that said hello and has not mapped yet
    try:
        assert greeted.request(Hello.mine(WantedKey.of(daemon.key))).status == "hit"
        with attach(model, mode="copy", run_dir=rig.run_dir) as copied:
            assert copied.report.outcome == "hit"
            for name, tensor in copied.tensors.items():
                assert torch.equal(tensor, lease.tensors[name]), name
        stats = rig.stats(daemon)
        assert (stats["state"], stats["holds_weights"]) == ("ready", True), (
            "the first copy engine's release dropped the weights under engines still attaching")
        assert stats["release_queued"]

        # Every engine in flight still gets its map, in either mode.
        map_and_close_fds(greeted, "copy")
        assert greeted.request(Release()) == ReleaseReply(state="ready", release_queued=True)
        assert silent.request(Hello.mine(WantedKey.of(daemon.key))).status == "hit"
        map_and_close_fds(silent, "zero_copy")
        silent.close()
        greeted.close()
        # The lease and this stats request are all that is left.
        wait_for(lambda: rig.stats(daemon)["connections"] == 2, what="the in-flight connections to end")
        # Only the lease holds the release back now.
        stats = rig.stats(daemon)
        assert (stats["state"], stats["leases"], stats["release_queued"]) == ("ready", 1, True)
    finally:
        silent.close()
        greeted.close()
        lease.close()
    wait_for(lambda: rig.stats(daemon)["state"] == "released", what="the queued release once the lease ended")
    stats = rig.stats(daemon)
    assert (stats["holds_weights"], stats["release_queued"], stats["released"]["client_pid"]) == (
        False, False, os.getpid())
    # The daemon appends the release's event just after its state reads "released".
    def copy_releases_logged() -> list[dict[str, object]]:
        return [e for e in rig.events("release") if e["mode"] == "copy"]

    wait_for(lambda: len(copy_releases_logged()) == 2, what="the queued release's event")
    copy_releases = copy_releases_logged()
    assert [e["weights_dropped"] for e in copy_releases] == [False, True], copy_releases
    assert copy_releases[0]["kept_for_leases"] == 1 and copy_releases[0]["kept_for_attaches"] == 2

    # An engine that comes now is told where the weights went, and falls back to disk.
    with attach(model, run_dir=rig.run_dir) as later:
        assert later.report.outcome == "fallback"
        assert_says_released(later.report.reason, os.getpid())
        assert stats["released"]["at"] in (later.report.reason or "")
    (miss,) = rig.events("attach_miss")
    assert_says_released(miss["reason"], os.getpid())


ENGINES = 32


def test_32_engines_half_in_copy_mode_attach_at_once(served: tuple[DaemonRig, Path, DaemonDescriptor]) -> None:
    rig, model, daemon = served
    start = threading.Barrier(ENGINES)
    results: list[AttachedWeights | BaseException] = [RuntimeError("never ran")] * ENGINES

    def engine(i: int) -> None:
        start.wait()
        try:
            results[i] = attach(model, mode="copy" if i % 2 else "zero_copy", run_dir=rig.run_dir)
        except BaseException as exc:  # reported below with the others
            results[i] = exc

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(ENGINES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    try:
        failures = [r for r in results if not isinstance(r, AttachedWeights)]
        assert not failures, failures
        weights = [r for r in results if isinstance(r, AttachedWeights)]
        outcomes = [(w.report.outcome, w.report.mode) for w in weights]
        # Engines that started together all get the daemon's weights; one that could not says why.
        for w in weights:
            if w.report.outcome != "hit":
                assert_says_released(w.report.reason, os.getpid())
        hits = sum(outcome == "hit" for outcome, _ in outcomes)
        assert hits == ENGINES, f"{ENGINES - hits} of {ENGINES} engines fell back: {outcomes}"
        reference = weights[0].tensors
        for w in weights[1:]:
            assert w.tensors.keys() == reference.keys()
            assert all(torch.equal(w.tensors[n], reference[n]) for n in reference)
    finally:
        for r in results:
            if isinstance(r, AttachedWeights):
                r.close()
    wait_for(lambda: rig.stats(daemon)["state"] == "released", what="the release once every lease ended")


def test_a_copy_attach_that_only_reports_leaves_the_daemon_its_weights(
    served: tuple[DaemonRig, Path, DaemonDescriptor],
) -> None:
    """`wcache attach MODEL --mode copy` from the shell maps nothing and keeps nothing: releasing the daemon for
    it emptied the daemon for good, every later attach falling back."""
    rig, model, daemon = served
    for _ in range(2):
        reported = rig.cli("attach", str(model), "--mode", "copy", "--json", "--run-dir", str(rig.run_dir),
                           as_json=True)
        assert reported["outcome"] == "hit", reported
    stats = rig.stats(daemon)
    assert (stats["state"], stats["holds_weights"]) == ("ready", True), stats
    with attach(model, run_dir=rig.run_dir) as weights:
        assert weights.report.outcome == "hit", weights.report
