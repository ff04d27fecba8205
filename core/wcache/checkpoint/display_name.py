"""The name a person knows a checkpoint by, wherever wcache names a model (status, top, the READY line, events).

A snapshot in the Hugging Face cache (`…/models--Org--Name/snapshots/<commit>[/file]`) is `Org/Name`, not its
40-hex commit directory; where two snapshots of one repo are shown together each gets its short revision
(`Org/Name@1a2b3c4`). Any other path is its last component, as before; a repo id as typed stays itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import PurePath

HUB_REPO_PREFIX = "models--"
HUB_REPO_SEPARATOR = "--"
SHORT_REVISION = 7  # as git abbreviates a commit


def hub_snapshot(source: str) -> tuple[str, str] | None:
    """(`Org/Name`, commit) of a path inside a Hugging Face cache snapshot, or None for any other path."""
    parts = PurePath(os.path.normpath(source)).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(HUB_REPO_PREFIX):
            repo = parts[i - 1].removeprefix(HUB_REPO_PREFIX).replace(HUB_REPO_SEPARATOR, "/", 1)
            return repo, parts[i + 1]
    return None


def display_name(source: str) -> str:
    """`Org/Name` for a Hugging Face snapshot; the last path component of anything else."""
    hub = hub_snapshot(source)
    if hub is not None:
        return hub[0]
    if not source.startswith(("/", ".")) and source.count("/") == 1:
        return source  # a repo id as the user typed it
    return PurePath(source).name or source


def described(source: str) -> str:
    """A line's longer form (the READY line): `Org/Name@<short revision>` for a Hub snapshot, whose path is a
    40-hex directory nobody reads; any other path as it is, since where it lies is what a person checks."""
    hub = hub_snapshot(source)
    return f"{hub[0]}@{hub[1][:SHORT_REVISION]}" if hub is not None else source


def display_names(sources: Iterable[str]) -> dict[str, str]:
    """Each source's display name, with a short revision where two snapshots of one repo are shown together."""
    unique = list(dict.fromkeys(sources))
    revisions: dict[str, set[str]] = {}
    for source in unique:
        if (hub := hub_snapshot(source)) is not None:
            revisions.setdefault(hub[0], set()).add(hub[1])
    names = {}
    for source in unique:
        hub = hub_snapshot(source)
        if hub is not None and len(revisions[hub[0]]) > 1:
            names[source] = f"{hub[0]}@{hub[1][:SHORT_REVISION]}"
        else:
            names[source] = display_name(source)
    return names
