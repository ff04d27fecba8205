"""Several versions in one daemon process: the next version built where its parent is served, and a pool of
retired arenas to build it in.

A daemon process serves the version it loaded, and every version built from one it serves (`BuildNext`, what
`wcache.daemon.publish` sends): each has its own name, socket, lock and descriptor, and stops on its own
(`wcache stop NAME` retires that version only); the process exits once it serves none and starts none (a build
begun from the last version served runs to its version serving). SIGTERM stops them all, one still starting too.

A retired version whose arena no engine holds goes to the pool when the daemon has a budget for one
(`--version-pool`): arenas are then sealed reusable (the future-write seal: no process but this one can ever
write them, and this one only through the map it already has), and the next build takes one instead of a fresh
arena's pages. The host remembers what each version it built changed, so a pooled arena that holds an ancestor
of the parent is brought forward by those elements alone (`wcache.delta.hosted_build`): when it retires, to the
newest version served that descends from it, off the next publish's path.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from wcache.checkpoint.file_record import Verdict
from wcache.delta.format import Delta, DeltaError, read_sealed_delta
from wcache.delta.hosted_build import (
    HostedBuild,
    StepChanges,
    bring_forward,
    build_hosted,
    copy_whole,
    not_in_place,
)
from wcache.ipc.arenas.daemon_side import ArenaClosedError, CpuArena
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    DaemonExistsError,
    daemon_name,
    hold_daemon_lock,
    process_created,
    socket_path,
    write_descriptor,
)
from wcache.ipc.wire.messages import BuiltNext
from wcache.load.loader import LoadedRank
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event

log = logging.getLogger("wcache.daemon")

# What names a delta sent with `BuildNext` in messages, and a version built from one as its source.
DELTA_LABEL = Path("memfd:wcache-delta")
# The longest path of steps a pooled arena is brought forward along; an ancestor further back is copied whole.
_STEPS_KEPT = 8
# How long a spare wanted after a build waits for a retiring version to give the pool its arena instead: a loop
# that stops its parent once its engines follow (a reference engine within a second, vLLM's in-place reload within
# a few on CPU) never allocates one it drops again; one that keeps its parents gets it ten seconds on.
SPARE_GRACE_S = 10.0


def describe(run_dir: Path, loaded: LoadedRank, parent: DaemonDescriptor | None, provenance: Verdict | None = None,
             *, device: str, tp_size: int, tp_rank: int, health_url: str | None,
             supervisor_pid: int | None) -> DaemonDescriptor:
    """The descriptor of a version this process serves (`parent`: the version it was built from), on `device` as
    rank `tp_rank` of `tp_size`, its health at `health_url`, started by the supervisor `supervisor_pid`."""
    key_file = loaded.key_file
    name = daemon_name(device, key_file.key.short_id)
    return DaemonDescriptor(
        name=name, pid=os.getpid(), pid_created=process_created(os.getpid()) or 0.0, device=device,
        tp_size=tp_size, tp_rank=tp_rank, key_id=key_file.key.short_id,
        key=key_file.key, plan=key_file.plan, config=key_file.config, source=key_file.source,
        socket=str(socket_path(run_dir, name)), health_url=health_url,
        supervisor_pid=supervisor_pid, started=datetime.now(UTC).isoformat(timespec="seconds"),
        weights_bytes=loaded.arena.total_bytes, files=key_file.files, provenance=provenance,
        parent_key_id=parent.key_id if parent is not None else None,
        parent=parent.name if parent is not None else None,
        origin=parent.model_source if parent is not None else None,
    )


def describe_hosted(run_dir: Path, loaded: LoadedRank, parent: DaemonDescriptor) -> DaemonDescriptor:
    """The descriptor of a version built in this process from `parent`, a version it serves: the device, rank,
    health server and supervisor are the process's, so the parent's descriptor names them."""
    return describe(run_dir, loaded, parent, device=parent.device, tp_size=parent.tp_size, tp_rank=parent.tp_rank,
                    health_url=parent.health_url, supervisor_pid=parent.supervisor_pid)


class Served(Protocol):
    """What the host needs of a version's server (`wcache.daemon.server.DaemonServer`, which imports this module)."""

    loaded: LoadedRank
    descriptor: DaemonDescriptor

    def bind(self) -> None: ...

    def serve_forever(self) -> None: ...

    def request_stop(self) -> None: ...

    def discard(self) -> None: ...


class ServerFactory(Protocol):
    """How the host makes a new version's server: `DaemonServer` itself."""

    def __call__(self, loaded: LoadedRank, descriptor: DaemonDescriptor, run_dir: Path, scrub_interval_s: float = 0.0,
                 *, host: VersionHost | None = None, lock_fd: int | None = None) -> Served: ...


@dataclass
class _Pooled:
    arena: CpuArena
    checkpoint: str | None  # what it holds; None once a failed build left it half written
    written: int = 0  # bytes written into it since it last served (brought forward, a copy): the next build's


class ArenaPool:
    """Retired arenas kept for the next build, within `budget` bytes; the oldest goes first."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.closed = False  # the process is stopping: nothing is kept any more
        self._held: list[_Pooled] = []

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def offer(self, arena: CpuArena, checkpoint: str | None, written: int = 0) -> bool:
        """Keep `arena` (holding `checkpoint`, `written` bytes written into it since it last served) if it is
        reusable and fits the budget; False: the caller closes it.
        Past the budget, arenas holding nothing go first (a version's can be brought forward by writing only what
        changed since; a blank one must take the parent's bytes whole), then the oldest."""
        if self.closed or not (arena.reusable and arena.fd >= 0 and arena.total_bytes <= self.budget):
            return False  # stopping, sealed for good, already closed (released to a copy-mode engine), or too large
        self._held.append(_Pooled(arena, checkpoint, written))
        while sum(p.arena.total_bytes for p in self._held) > self.budget:
            victim = next((p for p in self._held if p.checkpoint is None), self._held[0])
            self._held.remove(victim)
            victim.arena.close()
        return any(p.arena is arena for p in self._held)  # False: it went itself (the caller's close is a no-op)

    @property
    def empty(self) -> bool:
        return not self._held

    def holding(self, arena: CpuArena) -> _Pooled | None:
        """`arena`'s place in the pool; None once a build took it or the budget closed it."""
        return next((p for p in self._held if p.arena is arena), None)

    def checkpoints(self) -> list[str]:
        """What the pooled arenas hold (those a failed build left half written hold nothing)."""
        return [p.checkpoint for p in self._held if p.checkpoint is not None]

    def take(self, total_bytes: int, wanted: set[str]) -> _Pooled | None:
        """An arena of `total_bytes`, one holding a checkpoint in `wanted` first; None when none fits."""
        fits = [p for p in self._held if p.arena.total_bytes == total_bytes]
        if not fits:
            return None
        chosen = next((p for p in reversed(fits) if p.checkpoint in wanted), fits[-1])
        self._held.remove(chosen)
        return chosen

    def close(self) -> None:
        self.closed = True
        for pooled in self._held:
            pooled.arena.close()
        self._held = []


class VersionHost:
    """The versions this process serves, the pool, and what each built version changed."""

    def __init__(self, run_dir: Path, scrub_interval: float, pool_bytes: int, make_server: ServerFactory) -> None:
        self.run_dir = run_dir
        self.scrub_interval = scrub_interval  # each version's, as the first one's
        self._make_server = make_server
        self.pool = ArenaPool(pool_bytes)
        self._servers: list[Served] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # builds one at a time; a retirement waits for a build reading its arena
        self._steps: dict[str, StepChanges] = {}  # by the checkpoint each step made
        self._spare_wanted = False  # the last build took the pool's last arena
        self._building = 0  # builds begun whose version's thread has not started yet (`serve` waits for them)
        self._stopping = False  # every version was asked to stop (SIGTERM)
        self._pooled = 0  # arenas retired into the pool so far
        self._pool_grew = threading.Condition(self._lock)
        self._workers = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="wcache-build")

    def serve(self, first: Served) -> None:
        """Serve `first` on this thread (its pool's spare prepared, a copy of its arena), then wait until every
        version built meanwhile has stopped too."""
        with self._lock:
            self._servers.append(first)
        if isinstance(first.loaded.arena, CpuArena):
            self.prepare_pool(first.loaded.arena.total_bytes, copy_of=first)
        first.serve_forever()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t.is_alive()]
                building = self._building
            if threads:
                threads[0].join(0.5)
            elif building:  # a build begun while a version it was built from still served: its version serves on
                time.sleep(0.05)
            else:
                break
        with self._lock:
            self.pool.close()
            self._pool_grew.notify_all()  # a spare waiting for a retirement is not wanted any more
        self._workers.shutdown()

    def prepare_pool(self, total_bytes: int, unless_retired_within: float = 0.0, copy_of: Served | None = None) -> None:
        """Give the pool one arena of `total_bytes`, its pages allocated, on a thread of its own: the first version
        a loop publishes then skips a fresh arena's page allocation too (the budget is the user's to spend). Not
        when a version retires into the pool within `unless_retired_within` seconds: its arena serves instead.
        With `copy_of` (the version a rank loaded, at READY), the spare takes a copy of its arena while it is
        served and the version's plan builds here: the first version published from it then writes only its
        delta, as later ones do into a retired arena brought forward."""
        if total_bytes > self.pool.budget:
            return

        def allocate() -> None:
            with self._lock:
                before = self._pooled
                if self._pool_grew.wait_for(lambda: self._pooled != before or self.pool.closed, unless_retired_within):
                    return
            try:
                arena = CpuArena(total_bytes, "wcache-arena-spare")
                arena.seal(reusable=True)
                if arena.reusable:
                    arena.rewrite()
                with self._lock:
                    if not self.pool.offer(arena, *self._copy_into_spare(arena, copy_of)):
                        arena.close()
                log.info("the version pool's spare arena allocated (%d bytes)", total_bytes)
            except Exception:  # the first build then takes a fresh arena, as without a pool
                log.exception("the version pool's first arena could not be allocated")

        threading.Thread(target=allocate, name="wcache-pool", daemon=True).start()

    def _copy_into_spare(self, arena: CpuArena, source: Served | None) -> tuple[str | None, int]:
        """`source`'s arena copied into spare `arena` where it serves still and its versions build here: the
        checkpoint the spare then holds and the bytes written (None, 0: it stays blank). Called with the lock
        held."""
        if (source is None or self.pool.closed or source not in self._servers or not arena.reusable
                or not isinstance(source.loaded.arena, CpuArena) or not_in_place(source.loaded, set()) is not None):
            return None, 0
        began = time.perf_counter()
        written = copy_whole(source.loaded.arena, arena, self._workers)
        log.info("the pool's spare holds a copy of %s's arena (%.3f s)", source.descriptor.name,
                 time.perf_counter() - began)
        return source.loaded.key_file.key.checkpoint, written

    def request_stop_all(self) -> None:
        with self._lock:
            self._stopping = True  # a version whose build is under way stops as it starts
            servers = list(self._servers)
        for server in servers:
            server.request_stop()

    def retire(self, server: Served, leases: int) -> None:
        """A stopped version's arena: to the pool when no engine holds it, else closed (engines' maps stay)."""
        with self._lock:
            if server in self._servers:
                self._servers.remove(server)
            arena = server.loaded.arena
            with contextlib.suppress(ArenaClosedError):
                server.loaded.outputs.result()  # its stacked outputs hashed: nothing reads the arena then
            pooled = (isinstance(arena, CpuArena) and leases == 0
                      and self.pool.offer(arena, server.loaded.key_file.key.checkpoint))
            if pooled:
                self._pooled += 1
                self._pool_grew.notify_all()
            else:
                arena.close()
            self._forget_unreachable()
        if pooled:
            assert isinstance(arena, CpuArena)
            threading.Thread(target=self._bring_forward, args=(arena,), name="wcache-forward", daemon=True).start()

    def _bring_forward(self, arena: CpuArena) -> None:
        """Bring pooled `arena` forward to the newest version served that descends from what it holds, while no
        publish waits (a training loop's next step comes seconds later): the next build then writes only its own
        delta. A build that takes the arena first brings it forward itself."""
        with self._lock:
            pooled = self.pool.holding(arena)
            if pooled is None or pooled.checkpoint is None:
                return
            for server in reversed(self._servers):
                path = self._path(pooled.checkpoint, server.loaded.key_file.key.checkpoint)
                if path:
                    break
            else:
                return
            began = time.perf_counter()
            try:
                written = bring_forward(server.loaded, arena, path, self._workers)
            except Exception:  # half written: it holds nothing now, and the next build copies a parent whole
                log.exception("a pooled arena could not be brought forward to %s", server.descriptor.name)
                pooled.checkpoint = None
                return
            pooled.written += written
            pooled.checkpoint = server.loaded.key_file.key.checkpoint
            self._forget_unreachable()
        log.info("a pooled arena brought forward to %s's version in %.3f s (%d step(s), %d bytes written)",
                 server.descriptor.name, time.perf_counter() - began, len(path), written)

    def build(self, parent: Served, delta_fd: int) -> BuiltNext:
        """The next version of `parent`'s with the delta in sealed memfd `delta_fd` (which this takes), served
        from this process; `elsewhere` says why it must be built by a process of its own instead (nothing else was
        done)."""
        began = time.perf_counter()
        loaded = parent.loaded
        manifest = {e.name: e for e in loaded.key_file.manifest}
        delta = read_sealed_delta(delta_fd, DELTA_LABEL, manifest)
        delta.check_parent(loaded.key_file.key.checkpoint, f"daemon {parent.descriptor.name}")
        reason = not_in_place(loaded, set(delta.changes))
        if reason is not None:
            return BuiltNext(elsewhere=f"daemon {parent.descriptor.name} cannot build it in place: {reason}")
        with self._lock:
            if parent not in self._servers:
                raise DeltaError(f"daemon {parent.descriptor.name} stopped; nothing was built from it.")
            built, name, lock_fd = self._build_locked(parent, delta, str(DELTA_LABEL))
            spare_wanted = self._spare_wanted
            # Counted before the lock goes: `serve` does not end, though the last version served before this one
            # stops meanwhile, until this version's thread runs (the process would exit under it).
            self._building += 1
        try:
            bytes_read = delta.file_bytes
            del delta  # its values (its indices live on in the step remembered)
            release_free_memory()  # a loop's every step would otherwise leave some of the delta's pages behind
            if lock_fd is None:
                key = built.loaded.key_file.key
                return BuiltNext(name=name, key_id=key.short_id, checkpoint=key.checkpoint, already_served=True)
            started = self._start(parent, built, lock_fd, bytes_read, time.perf_counter() - began)
        finally:
            with self._lock:
                self._building -= 1
        if spare_wanted:
            self.prepare_pool(loaded.arena.total_bytes, SPARE_GRACE_S)
        return started

    def _build_locked(self, parent: Served, delta: Delta, label: str) -> tuple[HostedBuild, str, int | None]:
        """The version built, its daemon name, and the lock on that name (None: the key is served already)."""
        loaded = parent.loaded
        total = loaded.arena.total_bytes
        pooled = self.pool.take(total, set(self._steps) | {loaded.key_file.key.checkpoint})
        path = None if pooled is None else self._path(pooled.checkpoint, loaded.key_file.key.checkpoint)
        arena = pooled.arena if pooled is not None else CpuArena(total, "wcache-arena-next")
        # The pool's last arena taken (a loop's first step takes the spare while its parent serves on): unless a
        # version retires soon, the next build would find the pool empty and fault in a fresh arena. Another spare
        # then, while the budget allows; versions that retire later are kept before it.
        self._spare_wanted = pooled is not None and self.pool.empty
        try:
            built = build_hosted(loaded, delta, arena, path, label, self.pool.enabled, self._workers)
        except BaseException:
            if not (pooled is not None and self.pool.offer(arena, None)):
                arena.close()
            raise
        if pooled is not None and pooled.written:
            built = dataclasses.replace(built, bytes_written=built.bytes_written + pooled.written)
        self._remember(built.step)
        device = parent.descriptor.device  # a version built here serves where its parent does
        name = daemon_name(device, built.loaded.key_file.key.short_id)
        try:
            lock_fd = hold_daemon_lock(self.run_dir, name, device)
        except DaemonExistsError:
            # The key is served already (here or by another process): this arena holds it too, for the pool.
            if not self.pool.offer(arena, built.step.checkpoint):
                arena.close()
            return built, name, None
        except BaseException:
            arena.close()
            raise
        return built, name, lock_fd

    def _start(self, parent: Served, built: HostedBuild, lock_fd: int, bytes_read: int,
               seconds: float) -> BuiltNext:
        descriptor = describe_hosted(self.run_dir, built.loaded, parent.descriptor)
        server = self._make_server(built.loaded, descriptor, self.run_dir, self.scrub_interval,
                                   host=self, lock_fd=lock_fd)
        try:
            server.bind()
            write_descriptor(self.run_dir, descriptor)
        except BaseException:
            server.discard()
            raise
        thread = threading.Thread(target=server.serve_forever, name=f"wcache-{descriptor.name}", daemon=True)
        with self._lock:
            self._servers.append(server)
            self._threads.append(thread)
            self._forget_unreachable()
            stopping = self._stopping
        thread.start()
        if stopping:
            server.request_stop()
        append_event(self.run_dir, ev.Ready(
            daemon=descriptor.name, key_id=descriptor.key_id, rank=descriptor.tp_rank, device=descriptor.device,
            source=descriptor.source, weights_bytes=descriptor.weights_bytes, load_s=round(seconds, 3),
            bytes_read=bytes_read, parent_key_id=parent.descriptor.key_id, parent=parent.descriptor.name))
        log.info("ready: daemon %s serves key %s, built from daemon %s in this process in %.3f s, %d bytes written "
                 "(%s)", descriptor.name, descriptor.key_id, parent.descriptor.name, seconds, built.bytes_written,
                 "a pooled arena brought forward" if built.forwarded else "the parent's arena copied")
        return BuiltNext(name=descriptor.name, key_id=descriptor.key_id, checkpoint=descriptor.key.checkpoint,
                         bytes_written=built.bytes_written, forwarded=built.forwarded)

    def _remember(self, step: StepChanges) -> None:
        self._steps[step.checkpoint] = step

    def _forget_unreachable(self) -> None:
        """Keep only the steps from a pooled or served version to a served one (a served one may be retired into
        the pool next): each holds its delta's indices, tens of MB a step for a training loop, and no other step
        can ever bring an arena forward. Called with the lock held."""
        served = [s.loaded.key_file.key.checkpoint for s in self._servers]
        needed: set[str] = set()
        for held in [*self.pool.checkpoints(), *served]:
            for checkpoint in served:
                needed.update(step.checkpoint for step in self._path(held, checkpoint) or ())
        for checkpoint in list(self._steps):
            if checkpoint not in needed:
                del self._steps[checkpoint]

    def _path(self, held: str | None, parent: str) -> list[StepChanges] | None:
        """The steps from checkpoint `held` to `parent`, oldest first, as far as this host remembers them."""
        if held is None:
            return None
        steps: list[StepChanges] = []
        at = parent
        while at != held:
            step = self._steps.get(at)
            if step is None or len(steps) >= _STEPS_KEPT:
                return None
            steps.append(step)
            at = step.parent
        return steps[::-1]


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's malloc_trim): freed blocks inside its heaps
    otherwise stay resident, and a build frees tens of MB of them."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim this way
        ctypes.CDLL(None).malloc_trim(0)
