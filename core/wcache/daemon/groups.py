"""Which daemons belong together: the ranks one preload started (a TP group only serves, and stops, whole), and
which running daemons a name or key id prefix names.
"""

from __future__ import annotations

from pathlib import Path

from wcache.errors import (
    BadInputError,
    UnavailableError,
    option,
)
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    census,
    group_of,
    matches,
)


def parent_group(run_dir: Path, ident: str) -> list[DaemonDescriptor]:
    """The whole TP group of the one running daemon `ident` names, by rank, each holding its weights."""
    live = census(run_dir).live if run_dir.exists() else ()
    found = [d for d in live if matches(d, ident)]
    if not found:
        raise UnavailableError(f"no running daemon is named {ident!r}; `wcache status` lists them.")
    groups = {tuple(d.name for d in group_of(d, live)) for d in found}
    if len(groups) > 1:
        raise BadInputError(f"{ident!r} names {len(found)} daemons ({', '.join(d.name for d in found)}); give more "
                            "of the id.")
    group = group_of(found[0], live)
    if len(group) != group[0].tp_size:
        raise UnavailableError(f"daemon {found[0].name}'s tensor-parallel group has {len(group)} of its "
                               f"{group[0].tp_size} ranks running; it cannot be the parent of a new version.")
    return group


def stop_targets(run_dir: Path, ident: str | None, *, group: bool = False) -> list[DaemonDescriptor]:
    """The running daemons `ident` (a name or key id prefix; None: every one) names, with their whole TP groups.

    One rank of a group is never stopped alone (the rest could not serve): unless `group`, naming part of a
    group is a BadInputError. An empty list when nothing matches.
    """
    live = census(run_dir).live if run_dir.exists() else ()
    if ident is None:
        return list(live)
    targets = [d for d in live if matches(d, ident)]
    chosen = {d.name for d in targets}
    for descriptor in list(targets):
        members = group_of(descriptor, live)
        missing = [d.name for d in members if d.name not in chosen]
        if missing and not group:
            raise BadInputError(
                f"daemon {descriptor.name} is rank {descriptor.tp_rank} of a tensor-parallel group of "
                f"{descriptor.tp_size} ({', '.join(d.name for d in members)}); stop the whole group with "
                f"{option('group', True)}."
            )
        targets += [d for d in members if d.name not in chosen]
        chosen.update(d.name for d in members)
    return targets
