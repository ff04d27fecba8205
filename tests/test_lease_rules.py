"""The daemon's lease and release rules (`wcache.daemon.lease_rules`), decision by decision: pure functions,
so every case is one call (the live daemon's behaviour is tests/test_copy_release.py and test_daemon_e2e.py)."""

from __future__ import annotations

import pytest
from wcache.daemon.lease_rules import (
    HelloDecision,
    Holders,
    ReleaseDecision,
    hello,
    release,
    release_due,
    shutdown_stops,
    still_attaching,
    takes_lease,
)


def test_a_matching_hello_hits_and_counts_an_unverified_hit_when_trusted() -> None:
    assert hello((), ready=True, corrupt=False, trusted=False) == HelloDecision("hit", ("hits",))
    assert hello((), ready=True, corrupt=False, trusted=True) == HelloDecision("hit", ("hits", "hits_unverified"))


def test_a_hello_with_other_fields_misses_naming_them_in_its_counter() -> None:
    assert hello(("checkpoint", "plan"), ready=True, corrupt=False, trusted=False) == HelloDecision(
        "miss", ("misses_checkpoint_plan",))


def test_released_weights_refuse_every_key() -> None:
    for mismatched in ((), ("plan",)):
        assert hello(mismatched, ready=False, corrupt=False, trusted=False) == HelloDecision(
            "released", ("misses_released",))


def test_weights_changed_in_memory_refuse_the_matching_key_only() -> None:
    assert hello((), ready=True, corrupt=True, trusted=False) == HelloDecision("corrupt", ("misses_corrupt",))
    # Corrupt before released: an engine with our key learns why our weights are unusable.
    assert hello((), ready=False, corrupt=True, trusted=False).status == "corrupt"
    # Another key is a miss as it would be anyway.
    assert hello(("checkpoint",), ready=True, corrupt=True, trusted=False).status == "miss"


def test_only_a_zero_copy_map_takes_a_lease() -> None:
    assert takes_lease("zero_copy")
    assert not takes_lease("copy")


@pytest.mark.parametrize(("matched", "mode", "attaching"), [
    (False, None, False),  # no hello with our key yet: the connection set keeps it until its first request
    (True, None, True),  # hit, not mapped yet
    (True, "copy", True),  # copying: may still ask for the release
    (True, "zero_copy", False),  # holds a lease instead
])
def test_a_connection_is_attaching_between_its_hit_and_its_lease_or_release(
    matched: bool, mode: str | None, attaching: bool,
) -> None:
    assert still_attaching(matched, mode) is attaching


def test_a_copy_release_is_queued_once_while_the_weights_are_held() -> None:
    alone = Holders("ready", attaching=0, leases=0, release_queued=False)
    assert release("copy", alone) == ReleaseDecision(queue=True)
    assert not release("copy", alone).kept
    assert release("copy", Holders("ready", 0, 0, release_queued=True)) == ReleaseDecision()
    assert release("copy", Holders("released", 0, 0, release_queued=False)) == ReleaseDecision()
    assert release("copy", Holders("stopped", 0, 0, release_queued=False)) == ReleaseDecision()


def test_a_queued_release_says_what_keeps_the_weights() -> None:
    decision = release("copy", Holders("ready", attaching=2, leases=1, release_queued=False))
    assert (decision.queue, decision.kept, decision.kept_for_attaches, decision.kept_for_leases) == (True, True, 2, 1)


@pytest.mark.parametrize("mode", ["zero_copy", None])
def test_a_release_from_anything_but_a_copy_ends_the_askers_lease(mode: str | None) -> None:
    assert release(mode, Holders("ready", 3, 2, False)) == ReleaseDecision(end_lease=True)


@pytest.mark.parametrize(("holders", "due"), [
    (Holders("ready", 0, 0, True), True),
    (Holders("ready", 0, 0, False), False),  # nothing asked for
    (Holders("ready", 1, 0, True), False),  # an attach in flight
    (Holders("ready", 0, 1, True), False),  # a lease held
    (Holders("released", 0, 0, True), False),
    (Holders("stopped", 0, 0, True), False),
])
def test_a_queued_release_is_due_once_nothing_attaches_or_leases(holders: Holders, due: bool) -> None:
    assert release_due(holders) is due


def test_a_shutdown_waits_for_other_leases_unless_forced() -> None:
    assert shutdown_stops(0, force=False)
    assert not shutdown_stops(2, force=False)
    assert shutdown_stops(2, force=True)
