"""The engine side: compute the local key while connecting, compare, then map, copy or fall back to disk.

Every outcome is an event in the run dir's log: a hit, a miss with its reason and key diff, a fallback, and
the loss of a daemon a zero-copy engine depends on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import threading
import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.attach_options import MODES
from wcache.errors import BadInputError, UnavailableError
from wcache.ipc.client import DaemonConnection, DaemonError
from wcache.ipc.rundir import DaemonDescriptor, census, default_run_dir, ensure_run_dir, matches
from wcache.key.cache_key import KEY_FIELDS, KeyFile, compute_key, trusted_key
from wcache.key.diff import KeyDiff, diff_keys
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import HashProgress
from wcache.key.remote import daemon_key_file
from wcache.monitor.events import append_event
from wcache.plan.spec import PlanSpec

if TYPE_CHECKING:
    # torch, and the modules that make tensors, are imported where tensors are made: an attach that only
    # reports (`wcache attach` without --prompt/--serve) never loads torch.
    import torch

    from wcache.ipc.arena import MappedArena

MAX_DIFF_TENSORS_IN_EVENT = 50
WAIT_POLL_S = 0.25


class AttachMissError(UnavailableError):
    """No daemon could serve this key and falling back to disk was not allowed."""

    def __init__(self, message: str, report: AttachReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class AttachReport:
    """What happened: hit, miss or fallback, why, against which daemon, and how long each step took."""

    outcome: str
    mode: str
    device: str
    key_id: str | None
    daemon: str | None = None
    daemon_key_id: str | None = None
    reason: str | None = None
    mismatched: list[str] = field(default_factory=list)
    diff: KeyDiff | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    bytes_mapped: int = 0
    num_tensors: int = 0
    daemon_lost: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome, "mode": self.mode, "device": self.device, "key_id": self.key_id,
            "daemon": self.daemon, "daemon_key_id": self.daemon_key_id, "reason": self.reason,
            "mismatched": self.mismatched, "diff": diff_summary(self.diff) if self.diff else None,
            "timings_ms": self.timings_ms, "bytes_mapped": self.bytes_mapped, "num_tensors": self.num_tensors,
            "daemon_lost": self.daemon_lost,
        }


def diff_summary(diff: KeyDiff) -> dict[str, Any]:
    """A compact, JSON-ready diff for events and reports."""
    return {
        "fields": [c.name for c in diff.fields],
        "plan": {c.name: [c.a, c.b] for c in diff.plan},
        "config": [c.name for c in diff.config],
        "changed": [c.name for c in diff.changed[:MAX_DIFF_TENSORS_IN_EVENT]],
        "added": [e.name for e in diff.added[:MAX_DIFF_TENSORS_IN_EVENT]],
        "removed": [e.name for e in diff.removed[:MAX_DIFF_TENSORS_IN_EVENT]],
        "num_changed": len(diff.changed), "num_added": len(diff.added), "num_removed": len(diff.removed),
    }


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
    fields = ", ".join(c.name for c in diff.fields)
    return f"differs in {fields}" + (f" ({'; '.join(parts)})" if parts else "")


class AttachedWeights:
    """Processed tensors for one rank, and the lease that keeps zero-copy tensors backed."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], report: AttachReport, run_dir: Path, key_file: KeyFile
    ) -> None:
        self.tensors = tensors
        self.report = report
        self.key_file = key_file  # what the tensors were made from: this checkpoint's key, or a trusted daemon's
        self._run_dir = run_dir
        self._connection: DaemonConnection | None = None
        self._mapping: MappedArena | None = None
        self._closing = threading.Event()
        self.lost = threading.Event()

    def _hold_lease(self, connection: DaemonConnection, mapping: MappedArena | None) -> None:
        self._connection = connection
        self._mapping = mapping  # keeps the map (and so every tensor viewing it) alive as long as we are
        # The watcher gets only what it needs: a thread that held the tensors could end up freeing them
        # during interpreter shutdown, which torch does not survive.
        threading.Thread(
            target=_watch_lease, args=(connection.sock, self._closing, self.lost, self.report, self._run_dir),
            name="wcache-lease-watch", daemon=True,
        ).start()

    def checkpoint_tensors(self, outputs: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors under checkpoint (Hugging Face) names, as views wherever a processed tensor holds one.

        Complete for TP 1 plans that do not quantize; for a TP shard only the replicated tensors appear.
        `outputs` (engine names) limits them to the sources of those tensors.
        """
        from wcache.plan.processing import build_plan

        plan = build_plan(self.key_file.plan, self.key_file.config, self.key_file.manifest)
        return plan.checkpoint_views(self.tensors, outputs)

    def close(self) -> None:
        """End the lease; CPU tensors stay readable while referenced (the memfd outlives the lease)."""
        self._closing.set()
        if self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.sock.shutdown(socket.SHUT_RDWR)
            self._connection.close()
            self._connection = None

    def __enter__(self) -> AttachedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _watch_lease(
    sock: socket.socket, closing: threading.Event, lost: threading.Event, report: AttachReport, run_dir: Path
) -> None:
    try:
        sock.settimeout(None)
        data = sock.recv(1)
    except OSError:
        data = b""  # closed under us, by close() or by the daemon going away
    if closing.is_set():
        return
    # The daemon never speaks unprompted: any wake-up here means the connection is gone.
    report.daemon_lost = True
    lost.set()
    append_event(run_dir, "daemon_lost", daemon=report.daemon, key_id=report.key_id, device=report.device,
                 tensors_valid=report.device == "cpu", unexpected_data=bool(data))


def _connect_all(descriptors: list[DaemonDescriptor]) -> dict[str, DaemonConnection | DaemonError]:
    results: dict[str, DaemonConnection | DaemonError] = {}
    for d in descriptors:
        try:
            results[d.name] = DaemonConnection(d.socket)
        except DaemonError as exc:
            results[d.name] = exc
    return results


def attach(
    model: Path,
    plan: PlanSpec | None = None,
    *,
    device: str = "cpu",
    mode: str = "zero_copy",
    fallback: bool = True,
    trust_daemon: bool = False,
    daemon: str | None = None,
    run_dir: Path | None = None,
    store: DigestStore | None = None,
    progress: HashProgress | None = None,
    dp_size: int = 1,
    wait_s: float = 0.0,
    engine: str = "wcache",
    views: bool = True,
) -> AttachedWeights:
    """Get one rank's processed tensors from a daemon holding this checkpoint's key, or from disk.

    `daemon` names a daemon (its name or key id prefix) to use; `trust_daemon` skips the checkpoint stat
    pass for it and compares only config, plan and format. `wait_s` keeps looking for a daemon with this
    key that long (one still loading) before missing. `engine` names the attaching engine in the events.
    DP size is recorded, never compared. `views=False` only reports: a hit maps nothing and makes no tensor
    (torch is not imported); a fallback still loads from disk.
    """
    if mode not in MODES:
        raise BadInputError(f"--mode must be {' or '.join(MODES)}, not {mode!r}.")
    if wait_s < 0:
        raise BadInputError(f"the wait must be zero or more seconds, not {wait_s}.")
    plan = plan or PlanSpec()
    # Created (0700, owner-checked) even when no daemon runs: misses and fallbacks are logged there too.
    run_dir = ensure_run_dir(run_dir or default_run_dir())
    began = time.perf_counter()
    deadline = time.monotonic() + wait_s
    timings: dict[str, float] = {}

    def full_key() -> KeyFile:
        t = time.perf_counter()
        result = compute_key(model, plan, store=store, progress=progress)
        timings["key"] = (time.perf_counter() - t) * 1000
        return result

    local: KeyFile | None = None
    with _collector_paused(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-key") as pool:
        if trust_daemon:
            t = time.perf_counter()
            wanted = trusted_key(model, plan)
            timings["key"] = (time.perf_counter() - t) * 1000
        else:
            key_future = pool.submit(full_key)
        t = time.perf_counter()
        candidates, connections = _find_daemons(run_dir, device, daemon)
        timings["connect"] = (time.perf_counter() - t) * 1000
        if not trust_daemon:
            local = key_future.result()
            wanted = local.key.to_json()

    key_id = local.key.short_id if local is not None else None
    report = AttachReport(outcome="miss", mode=mode, device=device, key_id=key_id, timings_ms=timings)
    context = _AttachContext(model, wanted, local, mode, report, run_dir, began, dp_size, engine, views)
    try:
        while True:
            matches = [
                d for d in candidates
                if all(d.key[f] == wanted[f] for f in wanted) and isinstance(connections[d.name], DaemonConnection)
            ]
            if trust_daemon and daemon is None and len(matches) > 1:
                raise BadInputError(
                    f"{len(matches)} daemons on {device} match this config and plan; name one with --daemon."
                )
            for descriptor in matches:
                connection = connections.pop(descriptor.name)
                assert isinstance(connection, DaemonConnection)
                with _collector_paused():
                    weights = _try_map(connection, descriptor, context)
                if weights is not None:
                    return weights
            if time.monotonic() >= deadline:
                break
            _close_all(connections)
            time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
            candidates, connections = _find_daemons(run_dir, device, daemon)
        # A miss: explain it against the nearest daemon, then fall back or refuse.
        if local is None:
            local = compute_key(model, plan, store=store, progress=progress)
            report.key_id = local.key.short_id
        _explain_miss(report, local, candidates, connections, device)
        append_event(run_dir, "attach_miss", source=str(model), key_id=report.key_id, device=device,
                     reason=report.reason, daemon=report.daemon, mismatched=report.mismatched,
                     diff=diff_summary(report.diff) if report.diff else None, dp_size=dp_size, engine=engine)
        if not fallback:
            raise AttachMissError(f"{report.reason}; not falling back to disk (fallback disabled).", report)
        t = time.perf_counter()
        from wcache.load.loader import load_from_disk

        tensors = load_from_disk(local, model)
        timings["disk_load"] = (time.perf_counter() - t) * 1000
        timings["total"] = (time.perf_counter() - began) * 1000
        report.outcome = "fallback"
        report.num_tensors = len(tensors)
        append_event(run_dir, "fallback", source=str(model), key_id=report.key_id, device=device,
                     reason=report.reason, seconds=round(timings["disk_load"] / 1000, 3), dp_size=dp_size,
                     engine=engine)
        return AttachedWeights(tensors, report, run_dir, local)
    finally:
        _close_all(connections)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a key or a map builds its objects, as it was again after.

    Both build several objects per tensor (receipts, manifest entries, reply lists, views), none of them in a
    cycle, so reference counting frees what is dropped. Left on, the collector runs a full collection whenever
    enough of them outlive two young ones: ~100 ms over the ~170k objects a process holds once torch is
    imported, in about every second attach of 11k tensors.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True, slots=True)
class _AttachContext:
    """What every mapping attempt of one attach shares."""

    model: Path
    wanted: dict[str, Any]
    local: KeyFile | None  # None with --trust-daemon: the daemon's own manifest stands in for it
    mode: str
    report: AttachReport
    run_dir: Path
    began: float
    dp_size: int
    engine: str
    views: bool  # False: report only; nothing is mapped and no tensor made


def _find_daemons(
    run_dir: Path, device: str, daemon: str | None
) -> tuple[list[DaemonDescriptor], dict[str, DaemonConnection | DaemonError]]:
    live = census(run_dir).live
    candidates = [d for d in live if d.device == device and _named(d, daemon)]
    return candidates, _connect_all(candidates)


def _close_all(connections: dict[str, DaemonConnection | DaemonError]) -> None:
    for leftover in connections.values():
        if isinstance(leftover, DaemonConnection):
            leftover.close()
    connections.clear()


def _named(descriptor: DaemonDescriptor, daemon: str | None) -> bool:
    return daemon is None or matches(descriptor, daemon)


def _try_map(connection: DaemonConnection, descriptor: DaemonDescriptor, ctx: _AttachContext) -> AttachedWeights | None:
    report = ctx.report
    t = time.perf_counter()
    try:
        hello = connection.request("hello", key=ctx.wanted, pid=os.getpid(), dp_size=ctx.dp_size)
        if hello.fields.get("status") != "hit":
            report.mismatched = list(hello.fields.get("mismatched", []))
            report.reason = _refusal_reason(descriptor, hello.fields)
            connection.close()
            return None
        key_file = ctx.local
        if key_file is None:
            key_file = daemon_key_file(descriptor, connection.request("manifest").fields["tensors"])
        reply = connection.request("map", mode=ctx.mode)
    except DaemonError as exc:
        report.reason = str(exc).rstrip(".")
        connection.close()
        return None
    entries = reply.fields["entries"]  # wire lists, viewed as they are: no object per tensor in between
    total = int(reply.fields["total_bytes"])
    mapping: MappedArena | None = None
    tensors: dict[str, torch.Tensor] = {}
    if reply.fields.get("kind") == "memfd":
        if len(reply.fds) != 1:
            connection.close()
            raise UnavailableError(f"daemon {descriptor.name} sent no arena descriptor.")
        if ctx.views:
            from wcache.ipc.arena import map_cpu_arena

            mapping = map_cpu_arena(reply.fds[0], total, entries)
            tensors = mapping.tensors
        else:
            _check_arena_size(reply.fds[0], total)
    elif ctx.views:
        import torch

        from wcache.ipc.arena import open_cuda_handle, views_from_wire

        block = open_cuda_handle(reply.fields["cuda"], torch.device(descriptor.device).index or 0)
        tensors = views_from_wire(block, entries)
    report.timings_ms["map"] = (time.perf_counter() - t) * 1000
    if ctx.mode == "copy":
        t = time.perf_counter()
        if mapping is None:  # CUDA: the engine's own device memory
            tensors = {name: tensor.clone() for name, tensor in tensors.items()}
        # On CPU the map is already the engine's own copy without copying a byte: it is MAP_PRIVATE (a write
        # lands in a private page) and keeps the memfd's pages alive after the daemon lets go of them, so the
        # daemon can release and the weights stay in memory once, now the engine's.
        report.timings_ms["copy"] = (time.perf_counter() - t) * 1000
        with contextlib.suppress(DaemonError):
            connection.request("release")
        connection.close()
    report.timings_ms["total"] = (time.perf_counter() - ctx.began) * 1000
    report.outcome = "hit"
    report.reason = None
    report.daemon = descriptor.name
    report.daemon_key_id = descriptor.key_id
    report.bytes_mapped = total
    report.num_tensors = len(entries)
    # `verified`: the checkpoint's content key was compared with the daemon's (not so with --trust-daemon);
    # `source` is the engine's checkpoint, `daemon_source` what the daemon loaded (they differ for a copy).
    append_event(ctx.run_dir, "attach_hit", source=str(ctx.model.absolute()), daemon_source=descriptor.source,
                 verified=ctx.local is not None, key_id=descriptor.key_id,
                 daemon=descriptor.name, device=report.device, mode=ctx.mode, bytes=total, dp_size=ctx.dp_size,
                 engine=ctx.engine, timings_ms={k: round(v, 3) for k, v in report.timings_ms.items()})
    weights = AttachedWeights(tensors, report, ctx.run_dir, key_file)
    if ctx.mode == "zero_copy" and ctx.views:
        weights._hold_lease(connection, mapping)
    elif ctx.mode == "zero_copy":
        connection.close()  # nothing was mapped, so there is nothing to lease
    return weights


def _check_arena_size(fd: int, total_bytes: int) -> None:
    """What mapping would check first, for an attach that only reports: the memfd holds what was announced."""
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size < total_bytes:
        raise UnavailableError(f"the daemon's arena holds {size} bytes, fewer than the {total_bytes} it announced.")


def _refusal_reason(descriptor: DaemonDescriptor, hello: dict[str, Any]) -> str:
    """Why a daemon with our key answered hello with something other than a hit."""
    status = hello.get("status")
    summary = hello.get("daemon")
    released = summary.get("released") if isinstance(summary, dict) else None
    if status == "released" and isinstance(released, dict):
        return (f"the daemon {descriptor.name} released its weights to a copy-mode engine "
                f"(pid {released.get('client_pid')}) at {released.get('at')}")
    return f"the daemon {descriptor.name} answered {status}"


def _explain_miss(
    report: AttachReport, local: KeyFile, candidates: list[DaemonDescriptor],
    connections: dict[str, DaemonConnection | DaemonError], device: str,
) -> None:
    serve_failure = report.reason  # set when a daemon with our key could not serve (released, gone)
    if not candidates:
        report.reason = f"no daemon runs on {device}"
        return
    # The nearest daemon is the one with the fewest differing key fields.
    def distance(d: DaemonDescriptor) -> int:
        return sum(d.key[f] != getattr(local.key, f) for f in KEY_FIELDS)

    nearest = min(candidates, key=distance)
    report.daemon = nearest.name
    report.daemon_key_id = nearest.key_id
    report.mismatched = [f for f in KEY_FIELDS if nearest.key[f] != getattr(local.key, f)]
    others = len(candidates) - 1
    also = f" (and {others} other daemon(s) on {device})" if others else ""
    connection = connections.get(nearest.name)
    if not report.mismatched:
        # The nearest daemon holds this very key: say why it did not serve, never "holds key X, not X".
        if serve_failure is None and isinstance(connection, DaemonError):
            serve_failure = str(connection).rstrip(".")
        report.reason = (serve_failure or f"the daemon {nearest.name} holds this key but did not serve it") + also
        return
    if isinstance(connection, DaemonConnection):
        with contextlib.suppress(DaemonError):
            # Saying hello lets the daemon count the miss and its reason in its own metrics.
            connection.request("hello", key=local.key.to_json(), pid=os.getpid())
            manifest = connection.request("manifest")
            report.diff = diff_keys(daemon_key_file(nearest, manifest.fields["tensors"]), local)
    what = describe_diff(report.diff) if report.diff is not None else "differs in " + ", ".join(report.mismatched)
    report.reason = (f"the daemon on {device} holds key {nearest.key_id}, not {local.key.short_id}: it {what}"
                     f"{also}")
