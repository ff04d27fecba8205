"""The daemon's lease and release rules as decisions: given what the daemon holds and a request, what it does.

No sockets, clocks or I/O here: `daemon.server` keeps the state behind its lock, asks these functions, and
carries out the answer (the reply, the event, closing the arena).

A zero-copy map takes a lease: the engine's tensors view the daemon's arena for as long as its connection
lives. A copy-mode engine that has its copy asks the daemon to release its weights. The release waits until no
other attach is in flight (a connection that has not sent its first request yet, or said hello with our key
and not yet mapped or released) and no zero-copy lease is held, so engines that started together all get the
weights; only an engine that arrives after the weights are really gone is told so. A shutdown waits for no
lease but the asker's own unless forced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wcache.ipc.wire import counters as counter_names
from wcache.ipc.wire.messages import HelloStatus


@dataclass(frozen=True, slots=True)
class Holders:
    """What a release depends on: the daemon's state and who may still use its weights."""

    state: str  # "ready", "released" or "stopped"
    attaching: int  # connections that may yet map
    leases: int  # zero-copy leases held
    release_queued: bool  # a copy-mode engine asked for a release not yet carried out


@dataclass(frozen=True, slots=True)
class HelloDecision:
    status: HelloStatus
    counters: tuple[str, ...]  # the daemon's counters this hello adds one to (besides `hellos`)


@dataclass(frozen=True, slots=True)
class ReleaseDecision:
    """A release request: queue the weights' release (copy mode), or end the asker's lease (zero-copy)."""

    queue: bool = False
    end_lease: bool = False
    kept_for_attaches: int = 0  # what a queued release waits for
    kept_for_leases: int = 0

    @property
    def kept(self) -> bool:
        """Queued, and not due at once: others still attach or hold leases."""
        return self.queue and bool(self.kept_for_attaches or self.kept_for_leases)


def hello(mismatched: Sequence[str], ready: bool, corrupt: bool, trusted: bool) -> HelloDecision:
    """A hello's answer. `trusted`: the engine sent no checkpoint digest (--trust-daemon), so a hit is unverified.

    Weights found changed in memory refuse even the matching key; weights released refuse every key."""
    if corrupt and not mismatched:
        return HelloDecision("corrupt", (counter_names.miss("corrupt"),))
    if not ready:
        return HelloDecision("released", (counter_names.miss("released"),))
    if mismatched:
        return HelloDecision("miss", (counter_names.miss(mismatched),))
    return HelloDecision("hit", ("hits", "hits_unverified") if trusted else ("hits",))


def takes_lease(mode: str) -> bool:
    """A map in this mode keeps the daemon's weights in use until the connection ends."""
    return mode == "zero_copy"


def still_attaching(matched: bool, mode: str | None) -> bool:
    """A connection that said hello with our key and has neither taken a lease nor released may yet map."""
    return matched and not (mode is not None and takes_lease(mode))


def release(mode: str | None, others: Holders) -> ReleaseDecision:
    """A release request from a connection mapped in `mode`; `others` leaves the asker out of `attaching`.

    Copy mode hands ownership to the engine: one release is queued at most, and only while the weights are
    held. Anything else ends the asker's lease, if it holds one."""
    if mode != "copy":
        return ReleaseDecision(end_lease=True)
    if others.state != "ready" or others.release_queued:
        return ReleaseDecision()
    return ReleaseDecision(queue=True, kept_for_attaches=others.attaching, kept_for_leases=others.leases)


def release_due(holders: Holders) -> bool:
    """A queued release is carried out once no attach is in flight and no lease is held."""
    return holders.release_queued and holders.state == "ready" and not holders.attaching and not holders.leases


def shutdown_stops(other_leases: int, force: bool) -> bool:
    """A shutdown request stops the daemon unless engines other than the asker hold leases (and it is not forced)."""
    return force or not other_leases
