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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from wcache.attach_options import AttachOptions
from wcache.daemon_choice import holding, nearest, on_device
from wcache.errors import BadInputError, UnavailableError
from wcache.ipc.client import DaemonConnection, DaemonError
from wcache.ipc.messages import Hello, HelloReply, Manifest, MapMode, MapRequest, Release, WantedKey
from wcache.ipc.remote_key import daemon_key_file
from wcache.ipc.rundir import DaemonDescriptor, default_run_dir, ensure_run_dir
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key, trusted_key
from wcache.key.diff import KeyDiff, diff_keys
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import HashProgress
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event
from wcache.plan.spec import PlanSpec, preload_command

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


@dataclass(frozen=True, slots=True)
class AttachReport:
    """What happened: hit, miss or fallback, why, against which daemon, and how long each step took.

    Built once, when the attach is over; only `daemon_lost` changes after (the lease's watcher sets `lost`).
    """

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
    lost: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    @property
    def daemon_lost(self) -> bool:
        """The daemon backing zero-copy tensors went away after the attach."""
        return self.lost.is_set()

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
        self.lost = report.lost

    def _hold_lease(self, connection: DaemonConnection, mapping: MappedArena | None) -> None:
        self._connection = connection
        self._mapping = mapping  # keeps the map (and so every tensor viewing it) alive as long as we are
        # The watcher gets only what it needs: a thread that held the tensors could end up freeing them
        # during interpreter shutdown, which torch does not survive.
        threading.Thread(
            target=_watch_lease, args=(connection.sock, self._closing, self.report, self._run_dir),
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


def _watch_lease(sock: socket.socket, closing: threading.Event, report: AttachReport, run_dir: Path) -> None:
    try:
        sock.settimeout(None)
        data = sock.recv(1)
    except OSError:
        data = b""  # closed under us, by close() or by the daemon going away
    if closing.is_set():
        return
    # The daemon never speaks unprompted: any wake-up here means the connection is gone.
    report.lost.set()
    append_event(run_dir, ev.DaemonLost(daemon=report.daemon, key_id=report.key_id, device=report.device,
                                        tensors_valid=report.device == "cpu", unexpected_data=bool(data)))


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
    # AttachOptions checks mode and wait_s, for this caller as for the integrations.
    options = AttachOptions(fallback=fallback, mode=mode, trust_daemon=trust_daemon, daemon=daemon,
                            run_dir=str(run_dir) if run_dir is not None else None, wait_s=wait_s)
    return attach_with(model, plan or PlanSpec(), options, device=device, store=store, progress=progress,
                       dp_size=dp_size, engine=engine, views=views)


def attach_with(
    model: Path, plan: PlanSpec, options: AttachOptions, *, device: str = "cpu", store: DigestStore | None = None,
    progress: HashProgress | None = None, dp_size: int = 1, engine: str = "wcache", views: bool = True,
) -> AttachedWeights:
    """`attach` with its options typed: choose a daemon, map, or explain the miss and fall back."""
    # Created (0700, owner-checked) even when no daemon runs: misses and fallbacks are logged there too.
    run_dir = ensure_run_dir(Path(options.run_dir) if options.run_dir else default_run_dir())
    began = time.perf_counter()
    deadline = time.monotonic() + options.wait_s
    timings: dict[str, float] = {}
    context = _AttachContext(model, plan, options, device, store, progress, run_dir, began, dp_size, engine, views)
    wanted, local, found = _key_while_connecting(context, timings)
    refusal: _Refusal | None = None
    try:
        while True:
            fitting = [d for d in holding(found.candidates, wanted)
                       if isinstance(found.connections[d.name], DaemonConnection)]
            if options.trust_daemon and options.daemon is None and len(fitting) > 1:
                raise BadInputError(
                    f"{len(fitting)} daemons on {device} match this config and plan; name one with --daemon."
                )
            for descriptor in fitting:
                connection = found.connections.pop(descriptor.name)
                assert isinstance(connection, DaemonConnection)
                with _collector_paused():
                    outcome = _try_map(connection, descriptor, wanted, local, context)
                if isinstance(outcome, _Mapped):
                    return _hit(outcome, descriptor, connection, local, context, timings)
                refusal = outcome
            if time.monotonic() >= deadline:
                break
            found.close()
            time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
            found = _Found.look(run_dir, device, options.daemon)
        if local is None:
            local = compute_key(model, plan, store=store, progress=progress)
        return _miss(local, found, refusal, context, timings)
    finally:
        found.close()


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
    """What every step of one attach shares."""

    model: Path
    plan: PlanSpec
    options: AttachOptions
    device: str
    store: DigestStore | None
    progress: HashProgress | None
    run_dir: Path
    began: float
    dp_size: int
    engine: str
    views: bool  # False: report only; nothing is mapped and no tensor made


@dataclass(slots=True)
class _Found:
    """The daemons that may serve this attach (live, on its device, named if one is), and a connection to each."""

    candidates: list[DaemonDescriptor]
    connections: dict[str, DaemonConnection | DaemonError]

    @classmethod
    def look(cls, run_dir: Path, device: str, daemon: str | None) -> _Found:
        candidates = on_device(run_dir, device, daemon)
        return cls(candidates, _connect_all(candidates))

    def close(self) -> None:
        for leftover in self.connections.values():
            if isinstance(leftover, DaemonConnection):
                leftover.close()
        self.connections.clear()


def _key_while_connecting(ctx: _AttachContext, timings: dict[str, float]) -> tuple[WantedKey, KeyFile | None, _Found]:
    """The key to ask for (and the local KeyFile, unless the daemon is trusted), found while connecting."""

    def full_key() -> KeyFile:
        t = time.perf_counter()
        result = compute_key(ctx.model, ctx.plan, store=ctx.store, progress=ctx.progress)
        timings["key"] = (time.perf_counter() - t) * 1000
        return result

    with _collector_paused(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-key") as pool:
        if ctx.options.trust_daemon:
            t = time.perf_counter()
            wanted = WantedKey(**trusted_key(ctx.model, ctx.plan))
            timings["key"] = (time.perf_counter() - t) * 1000
        else:
            key_future = pool.submit(full_key)
        t = time.perf_counter()
        found = _Found.look(ctx.run_dir, ctx.device, ctx.options.daemon)
        timings["connect"] = (time.perf_counter() - t) * 1000
        if ctx.options.trust_daemon:
            return wanted, None, found
        try:
            local = key_future.result()
        except BaseException:
            found.close()
            raise
        return WantedKey.of(local.key), local, found


@dataclass(frozen=True, slots=True)
class _Mapped:
    """A daemon's tensors in this process, and what they were made from."""

    tensors: dict[str, torch.Tensor]
    mapping: MappedArena | None
    key_file: KeyFile
    total_bytes: int
    num_tensors: int
    timings_ms: dict[str, float]


@dataclass(frozen=True, slots=True)
class _Refusal:
    """Why a daemon that holds our key did not serve it."""

    reason: str
    mismatched: tuple[str, ...] = ()


def _try_map(connection: DaemonConnection, descriptor: DaemonDescriptor, wanted: WantedKey,
             local: KeyFile | None, ctx: _AttachContext) -> _Mapped | _Refusal:
    """Hello, then map (or copy) this daemon's arena; a refusal closes the connection."""
    mode = cast(MapMode, ctx.options.mode)
    t = time.perf_counter()
    try:
        hello = connection.request(Hello.mine(wanted, ctx.dp_size))
        if hello.status != "hit":
            connection.close()
            return _Refusal(_refusal_reason(descriptor, hello), hello.mismatched)
        key_file = local if local is not None else daemon_key_file(descriptor, connection.request(Manifest()).tensors)
        reply = connection.request(MapRequest(mode))
    except DaemonError as exc:
        connection.close()
        return _Refusal(str(exc).rstrip("."))
    entries = reply.entries  # wire lists, viewed as they are: no object per tensor in between
    timings: dict[str, float] = {}
    mapping: MappedArena | None = None
    tensors: dict[str, torch.Tensor] = {}
    if reply.kind == "memfd":
        if len(reply.fds) != 1:
            connection.close()
            raise UnavailableError(f"daemon {descriptor.name} sent no arena descriptor.")
        if ctx.views:
            from wcache.ipc.arena import map_cpu_arena

            mapping = map_cpu_arena(reply.fds[0], reply.total_bytes, entries)
            tensors = mapping.tensors
        else:  # only a report: what mapping would check first, and nothing mapped
            from wcache.ipc.arena import check_arena_size

            try:
                check_arena_size(reply.fds[0], reply.total_bytes)
            finally:
                os.close(reply.fds[0])
    elif ctx.views:
        import torch

        from wcache.ipc.arena import open_cuda_handle
        from wcache.ipc.arena_views import views_from_wire

        if reply.cuda is None:
            connection.close()
            raise UnavailableError(f"daemon {descriptor.name} sent no CUDA handle.")
        block = open_cuda_handle(reply.cuda.to_wire(), torch.device(descriptor.device).index or 0)
        tensors = views_from_wire(block, entries)
    timings["map"] = (time.perf_counter() - t) * 1000
    if mode == "copy":
        t = time.perf_counter()
        if mapping is None:  # CUDA: the engine's own device memory
            tensors = {name: tensor.clone() for name, tensor in tensors.items()}
        # On CPU the map is already the engine's own copy without copying a byte: it is MAP_PRIVATE (a write
        # lands in a private page) and keeps the memfd's pages alive after the daemon lets go of them, so the
        # daemon can release and the weights stay in memory once, now the engine's.
        timings["copy"] = (time.perf_counter() - t) * 1000
        with contextlib.suppress(DaemonError):
            connection.request(Release())
        connection.close()
    return _Mapped(tensors, mapping, key_file, reply.total_bytes, len(entries), timings)


def _hit(mapped: _Mapped, descriptor: DaemonDescriptor, connection: DaemonConnection, local: KeyFile | None,
         ctx: _AttachContext, timings: dict[str, float]) -> AttachedWeights:
    """The report of a hit, its event, and the lease a zero-copy map keeps open."""
    timings = {**timings, **mapped.timings_ms, "total": (time.perf_counter() - ctx.began) * 1000}
    mode = ctx.options.mode
    report = AttachReport(
        outcome="hit", mode=mode, device=ctx.device, key_id=local.key.short_id if local is not None else None,
        daemon=descriptor.name, daemon_key_id=descriptor.key_id, timings_ms=timings,
        bytes_mapped=mapped.total_bytes, num_tensors=mapped.num_tensors,
    )
    # `verified`: the checkpoint's content key was compared with the daemon's (not so with --trust-daemon);
    # `source` is the engine's checkpoint, `daemon_source` what the daemon loaded (they differ for a copy).
    append_event(ctx.run_dir, ev.AttachHit(
        source=str(ctx.model.absolute()), daemon_source=descriptor.source, verified=local is not None,
        key_id=descriptor.key_id, daemon=descriptor.name, device=ctx.device, mode=mode, bytes=mapped.total_bytes,
        dp_size=ctx.dp_size, engine=ctx.engine, timings_ms={k: round(v, 3) for k, v in timings.items()}))
    weights = AttachedWeights(mapped.tensors, report, ctx.run_dir, mapped.key_file)
    if mode == "zero_copy" and ctx.views:
        weights._hold_lease(connection, mapped.mapping)
    elif mode == "zero_copy":
        connection.close()  # nothing was mapped, so there is nothing to lease
    return weights


def _miss(local: KeyFile, found: _Found, refusal: _Refusal | None, ctx: _AttachContext,
          timings: dict[str, float]) -> AttachedWeights:
    """Explain the miss against the nearest daemon, log it, then fall back to disk or refuse."""
    explained = _explain_miss(local, found, refusal, ctx.device, ctx.model)
    key_id = local.key.short_id
    report = AttachReport(outcome="miss", mode=ctx.options.mode, device=ctx.device, key_id=key_id,
                          daemon=explained.daemon, daemon_key_id=explained.daemon_key_id, reason=explained.reason,
                          mismatched=list(explained.mismatched), diff=explained.diff, timings_ms=timings)
    append_event(ctx.run_dir, ev.AttachMiss(
        source=str(ctx.model), key_id=key_id, device=ctx.device, reason=explained.reason, daemon=explained.daemon,
        mismatched=list(report.mismatched), diff=diff_summary(explained.diff) if explained.diff else None,
        dp_size=ctx.dp_size, engine=ctx.engine))
    if not ctx.options.fallback:
        raise AttachMissError(f"{explained.reason}; not falling back to disk (fallback disabled).", report)
    t = time.perf_counter()
    from wcache.load.loader import load_from_disk

    tensors = load_from_disk(local, ctx.model)
    disk_ms = (time.perf_counter() - t) * 1000
    timings = {**timings, "disk_load": disk_ms, "total": (time.perf_counter() - ctx.began) * 1000}
    append_event(ctx.run_dir, ev.Fallback(source=str(ctx.model), key_id=key_id, device=ctx.device,
                                          reason=explained.reason, seconds=round(disk_ms / 1000, 3),
                                          dp_size=ctx.dp_size, engine=ctx.engine))
    return AttachedWeights(tensors, replace(report, outcome="fallback", timings_ms=timings,
                                            num_tensors=len(tensors)), ctx.run_dir, local)


def _refusal_reason(descriptor: DaemonDescriptor, hello: HelloReply) -> str:
    """Why a daemon with our key answered hello with something other than a hit."""
    released = hello.daemon.released
    if hello.status == "corrupt":
        found = "; ".join(hello.corrupt or ())
        return f"the daemon {descriptor.name} found its weights changed in memory ({found}) and refuses new attaches"
    if hello.status == "released" and released is not None:
        return (f"the daemon {descriptor.name} released its weights to a copy-mode engine "
                f"(pid {released.client_pid}) at {released.at}")
    return f"the daemon {descriptor.name} answered {hello.status}"


@dataclass(frozen=True, slots=True)
class _Explained:
    """A miss: why, against which daemon, and what differs."""

    reason: str
    daemon: str | None = None
    daemon_key_id: str | None = None
    mismatched: tuple[str, ...] = ()
    diff: KeyDiff | None = None


def _explain_miss(local: KeyFile, found: _Found, refusal: _Refusal | None, device: str, model: Path) -> _Explained:
    if not found.candidates:
        return _Explained(f"no daemon runs on {device}", mismatched=refusal.mismatched if refusal else ())
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
        return _Explained(reason, closest.name, closest.key_id, mismatched)
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
    return _Explained(reason, closest.name, closest.key_id, mismatched, diff)
