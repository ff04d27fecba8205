"""Which daemon an engine uses: the live daemons on its device (or the one it names) that hold its key.

The one home of that choice, for `attach`, `verify --content` and the vLLM loader's memory accounting.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from wcache.errors import UnavailableError, option
from wcache.ipc.run_dir.directory import DaemonDescriptor, census, group_of, matches
from wcache.ipc.wire.messages import WantedKey
from wcache.plan.spec import PlanSpec


def on_device(run_dir: Path, device: str, daemon: str | None) -> list[DaemonDescriptor]:
    """Live daemons on `device`; only those `daemon` names (a name or key id prefix) when it is given. A daemon
    of a tensor-parallel group names the whole group, so that each rank's engine finds its own rank's daemon."""
    live = census(run_dir).live if run_dir.exists() else ()
    if daemon is None:
        return [d for d in live if d.device == device]
    named = {m.name for d in live if matches(d, daemon) for m in group_of(d, live)}
    return [d for d in live if d.device == device and d.name in named]


def holding(candidates: Iterable[DaemonDescriptor], wanted: WantedKey) -> list[DaemonDescriptor]:
    """The candidates whose key is `wanted` (in every field it names)."""
    return [d for d in candidates if not wanted.mismatched_fields(d.key)]


def nearest(candidates: list[DaemonDescriptor], wanted: WantedKey) -> DaemonDescriptor:
    """The candidate with the fewest differing key fields, to explain a miss against; of those, one that holds
    this very checkpoint (under another plan or config: the miss then says what to change), else the first."""

    def distance(d: DaemonDescriptor) -> tuple[int, bool]:
        mismatched = wanted.mismatched_fields(d.key)
        return len(mismatched), "checkpoint" in mismatched

    return min(candidates, key=distance)


def pick_daemon(model: Path, plan: PlanSpec, run_dir: Path, device: str, daemon: str | None) -> DaemonDescriptor:
    """The daemon an engine for `model` under `plan` would use, judged by config, tokenizer, plan and format alone."""
    from wcache.key.compute import trusted_key

    wanted = WantedKey(**trusted_key(model, plan))  # what `attach --trust-daemon` compares
    if daemon is not None:
        live = census(run_dir).live if run_dir.exists() else ()
        named = [d for d in live if matches(d, daemon)]
        if len(named) != 1:
            raise UnavailableError(f"{len(named)} running daemons match {daemon!r} in {run_dir}; name exactly one.")
        # A daemon of a tensor-parallel group names the group: each rank takes the daemon of its own rank.
        own = [d for d in group_of(named[0], live) if d.tp_rank == plan.tp_rank]
        return own[0] if own else named[0]
    fitting = holding(on_device(run_dir, device, None), wanted)
    if not fitting:
        raise UnavailableError(f"no daemon on {device} in {run_dir} holds {model} under this plan.")
    if len(fitting) > 1:
        raise UnavailableError(f"{len(fitting)} daemons on {device} fit this plan; name one with {option('daemon')}.")
    return fitting[0]


def lineage_checkpoint(live: Iterable[DaemonDescriptor], descriptor: DaemonDescriptor) -> Path | None:
    """The checkpoint a daemon's weights share config, tokenizer and tensor headers with: its own source, or for
    a version built from a delta (whose source is that delta file) the source of the first ancestor loaded from
    a checkpoint; None when an ancestor no longer runs (a delta never changes what the key's config and plan
    digests cover, so any checkpoint with those digests serves as well)."""
    by_name = {d.name: d for d in live}
    seen = {descriptor.name}
    while descriptor.parent is not None:
        parent = by_name.get(descriptor.parent)
        if parent is None or parent.name in seen:
            return None
        seen.add(parent.name)
        descriptor = parent
    return Path(descriptor.source)
