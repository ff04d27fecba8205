"""Why no daemon served: against the nearest daemon, the key comparison and what differs, in one sentence."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from wcache.attach.found import Found
from wcache.attach.mapping import Refusal
from wcache.daemon_choice import nearest
from wcache.ipc.run_dir.remote_key import daemon_key_file
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import Hello, Manifest, WantedKey
from wcache.key.cache_key import KeyFile
from wcache.key.diff import KeyDiff, diff_keys
from wcache.plan.spec import preload_command


def describe_diff(diff: KeyDiff) -> str:
    """One clause naming what differs, for the miss sentence."""
    parts = []
    if diff.changed:
        names = ", ".join(c.name for c in diff.changed[:3]) + (" …" if len(diff.changed) > 3 else "")
        parts.append(f"{len(diff.changed)} tensor(s) changed: {names}")
    if diff.added or diff.removed:
        parts.append(f"{len(diff.added)} tensor(s) added, {len(diff.removed)} removed")
    if diff.plan:
        parts.append("plan " + ", ".join(f"{c.name} {c.a}→{c.b}" for c in diff.plan))
    if diff.config:
        parts.append("config " + ", ".join(c.name for c in diff.config[:5]))
    if diff.tokenizer:
        parts.append("tokenizer file(s) " + ", ".join(c.name for c in diff.tokenizer[:5]))
    fields = ", ".join(c.name for c in diff.fields)
    return f"differs in {fields}" + (f" ({'; '.join(parts)})" if parts else "")


@dataclass(frozen=True, slots=True)
class Explained:
    """A miss: why, against which daemon, and what differs."""

    reason: str
    daemon: str | None = None
    daemon_key_id: str | None = None
    mismatched: tuple[str, ...] = ()
    diff: KeyDiff | None = None


def explain_miss(local: KeyFile, found: Found, refusal: Refusal | None, device: str, model: Path) -> Explained:
    if not found.candidates:
        return Explained(f"no daemon runs on {device}", mismatched=refusal.mismatched if refusal else ())
    wanted = WantedKey.of(local.key)
    closest = nearest(found.candidates, wanted)
    mismatched = tuple(wanted.mismatched_fields(closest.key))
    others = len(found.candidates) - 1
    also = f" (and {others} other daemon(s) on {device})" if others else ""
    connection = found.connections.get(closest.name)
    if not mismatched:
        # The nearest daemon holds this very key: say why it did not serve, never "holds key X, not X".
        serve_failure = refusal.reason if refusal else None
        if serve_failure is None and isinstance(connection, DaemonError):
            serve_failure = str(connection).rstrip(".")
        reason = (serve_failure or f"the daemon {closest.name} holds this key but did not serve it") + also
        return Explained(reason, closest.name, closest.key_id, mismatched)
    diff: KeyDiff | None = None
    if isinstance(connection, DaemonConnection):
        with contextlib.suppress(DaemonError):
            # Saying hello lets the daemon count the miss and its reason in its own metrics.
            connection.request(Hello.mine(wanted))
            diff = diff_keys(daemon_key_file(closest, connection.request(Manifest()).tensors), local)
    what = describe_diff(diff) if diff is not None else "differs in " + ", ".join(mismatched)
    reason = f"the daemon on {device} holds key {closest.key_id}, not {local.key.short_id}: it {what}{also}"
    if diff is not None and diff.plan:
        # A plan this engine needs and no daemon holds (dtype, TP size, layout): say what would hold it.
        reason += f"; `{preload_command(model, local.plan)}` starts daemons that serve this engine"
    return Explained(reason, closest.name, closest.key_id, mismatched, diff)
