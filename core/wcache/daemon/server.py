"""The daemon's serve loop: one thread per client, leases for zero-copy clients, any bad client dropped alone.

The lease and release rules are `lease_rules`' decisions; this module keeps the state they read and carries
them out. A silent connection holds a release back for CLIENT_TIMEOUT_S at most.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.daemon import lease_rules
from wcache.daemon.lease_rules import Holders
from wcache.daemon.scrub import Corruption, Scrubber, first_difference_from_checkpoint
from wcache.errors import WcacheError
from wcache.ipc.arenas.daemon_side import ArenaClosedError, ArenaEntry, CpuArena
from wcache.ipc.run_dir.directory import DaemonDescriptor, release_daemon_lock, remove_daemon_files, write_descriptor
from wcache.ipc.wire import counters as counter_names
from wcache.ipc.wire.framing import (
    NOTICE_LIMITS,
    REPLY_LIMITS,
    REQUEST_LIMITS,
    Frame,
    PeerClosedError,
    ProtocolError,
    peer_uid,
    receive,
    send_encoded,
)
from wcache.ipc.wire.messages import (
    ArenaReport,
    BadRequestError,
    BuildNext,
    BuiltNext,
    CheckArena,
    CorruptNotice,
    CudaHandle,
    DaemonSummary,
    ErrorReply,
    Hello,
    HelloReply,
    Manifest,
    ManifestReply,
    MapReply,
    MapRequest,
    Message,
    Release,
    ReleasedTo,
    ReleaseReply,
    Request,
    Shutdown,
    ShutdownReply,
    Stats,
    StatsReply,
    encode,
    read_request,
)
from wcache.load.loader import LoadedRank
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event

if TYPE_CHECKING:
    from wcache.daemon.version_host import VersionHost

log = logging.getLogger("wcache.daemon")

# A reply, and the descriptors that travel with it.
Reply = tuple[Message, tuple[int, ...]]
# A client that holds no map and says nothing for this long is dropped (a frame once begun has its
# own, shorter deadline: protocol.REQUEST_LIMITS).
CLIENT_TIMEOUT_S = 60.0
# Connections served at once, lease holders included: one thread each, so a flood cannot exhaust threads
# or memory; beyond it a connection gets one error frame and is closed.
MAX_CLIENTS = 512


@dataclass
class _Client:
    """Per-connection state: whether it said hello with our key, and whether it holds a lease."""

    ident: int
    conn: socket.socket | None = None
    pid: int | None = None
    matched: bool = False
    mode: str | None = None
    # Replies and the notice a lease holder may get unasked (CorruptNotice) never interleave on the connection.
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def attaching(self) -> bool:
        """Said hello with our key and has neither taken a lease nor released."""
        return lease_rules.still_attaching(self.matched, self.mode)


@dataclass(frozen=True, slots=True)
class _Release:
    """A copy-mode engine's request that the daemon let go of its weights."""

    client_pid: int | None
    asked: float  # time.time()


@dataclass
class DaemonState:
    """Everything the serve threads share, behind one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = "ready"
    leases: set[int] = field(default_factory=set)
    # Connections that may yet map: no request seen yet (an engine connects while it computes its key), or
    # a hello that hit and no lease or release since.
    attaching: set[int] = field(default_factory=set)
    clients: int = 0
    release: _Release | None = None  # asked for, not yet carried out
    released: ReleasedTo | None = None  # when and to whom, once carried out
    counters: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)
    lease_pids: dict[int, int | None] = field(default_factory=dict)  # lease holder → its engine's pid
    lease_clients: dict[int, _Client] = field(default_factory=dict)  # lease holder → its connection
    corrupt: list[str] = field(default_factory=list)  # what the scrubber found, one sentence per tensor


class DaemonServer:
    """Serves one loaded rank on a Unix socket: one version of the ones its process hosts (`host`), holding its
    name's lock (`lock_fd`, released once its files are removed) until it stops."""

    def __init__(self, loaded: LoadedRank, descriptor: DaemonDescriptor, run_dir: Path,
                 scrub_interval_s: float = 0.0, *, host: VersionHost | None = None,
                 lock_fd: int | None = None) -> None:
        self.loaded = loaded
        self.host = host
        self._lock_fd = lock_fd
        # The map reply's entries never change: built once, not per attach (one list per tensor).
        self._wire_entries = [e.to_wire() for e in loaded.entries]
        self.descriptor = descriptor
        # A descriptor rewritten after READY (the provenance verdict) must never outlive the daemon's removal.
        self._publishing = threading.Lock()
        self._unpublished = False
        self.run_dir = run_dir
        self.shared = DaemonState()
        self.started = time.time()
        self._listener: socket.socket | None = None
        self._next_ident = 0
        # Two content checks at once would take every core from the probes; a second waits for the first.
        self._checking = threading.Lock()
        self.scrubber: Scrubber | None = None
        if isinstance(loaded.arena, CpuArena):
            arena = loaded.arena
            source = Path(loaded.key_file.source)

            def locate(entry: ArenaEntry) -> int | None:
                return first_difference_from_checkpoint(loaded.plan, loaded.key_file.manifest, source, arena, entry)

            self.scrubber = Scrubber(arena, loaded.entries, loaded.outputs.result, scrub_interval_s,
                                     self._corrupted, locate=locate)

    # -- lifecycle -----------------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the socket 0600 (a stale socket of a dead daemon with our name is replaced)."""
        path = Path(self.descriptor.socket)
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        path.chmod(0o600)
        # Engines start in bursts (one per rank and DP replica); the kernel caps this at net.core.somaxconn.
        listener.listen(socket.SOMAXCONN)
        listener.settimeout(0.25)
        self._listener = listener

    def serve_forever(self) -> None:
        assert self._listener is not None
        if self.scrubber is not None:
            self.scrubber.start()
        while not self.shared.stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.shared.stop.is_set():
                    break
                # Out of descriptors or memory for a moment: keep serving the clients we have, retry soon.
                self._count("accept_errors")
                log.warning("accept() failed (%s); retrying.", exc)
                self.shared.stop.wait(0.1)
                continue
            self._start_client(conn)
        self._shutdown()

    def _start_client(self, conn: socket.socket) -> None:
        self._next_ident += 1
        ident = self._next_ident
        with self.shared.lock:
            busy = self.shared.clients >= MAX_CLIENTS
            if not busy:
                self.shared.clients += 1
                self.shared.attaching.add(ident)
        if busy:
            self._refuse_busy(conn)
            return
        try:
            threading.Thread(target=self._serve_client, args=(conn, ident), daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: this client goes, the daemon stays
            self._count("accept_errors")
            log.warning("Could not start a thread for client %d (%s).", ident, exc)
            conn.close()
            self._forget(_Client(ident))

    def _refuse_busy(self, conn: socket.socket) -> None:
        """One error frame and a close, from the accept loop itself: it must never block there."""
        with conn:
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                message = f"this daemon already serves {MAX_CLIENTS} connections; try again shortly"
                send_encoded(conn, encode(ErrorReply(message), REPLY_LIMITS))
        with self.shared.lock:
            self.shared.counters["refused_busy"] += 1
            refused = self.shared.counters["refused_busy"]
        if refused == 1 or refused % 1000 == 0:  # a flood would otherwise fill the log
            log.warning("Refused a connection beyond %d at once (%d so far).", MAX_CLIENTS, refused)

    def republish(self, descriptor: DaemonDescriptor) -> bool:
        """Publish `descriptor` in place of the current one (what became known after READY); False, and nothing
        written, once the daemon has removed its files."""
        with self._publishing:
            if self._unpublished:
                return False
            self.descriptor = descriptor
            write_descriptor(self.run_dir, descriptor)
            return True

    def request_stop(self) -> None:
        self.shared.stop.set()

    def _shutdown(self) -> None:
        if self.scrubber is not None:
            self.scrubber.stop()
        if self._listener is not None:
            self._listener.close()
        with self._publishing:
            self._unpublished = True
            remove_daemon_files(self.run_dir, self.descriptor.name)
        with self.shared.lock:
            leases = len(self.shared.leases)
            self.shared.state = "stopped"
        log.info("Stopping %s with %d lease(s) held.", self.descriptor.name, leases)
        append_event(self.run_dir, ev.Stop(daemon=self.descriptor.name, key_id=self.descriptor.key_id, leases=leases))
        self._retire(leases)

    def _retire(self, leases: int) -> None:
        """The arena to the host's pool (or closed), then the name's lock: only now is this version gone."""
        if self.host is not None:
            self.host.retire(self, leases)
        else:
            self.loaded.arena.close()
        if self._lock_fd is not None:
            release_daemon_lock(self.run_dir, self.descriptor.name, self._lock_fd)
            self._lock_fd = None

    def discard(self) -> None:
        """A version that never served (its socket or descriptor could not be published): undo what was."""
        if self._listener is not None:
            self._listener.close()
        with self._publishing:
            self._unpublished = True
            remove_daemon_files(self.run_dir, self.descriptor.name)
        self._retire(0)

    # -- one client ----------------------------------------------------------------------------------

    def _serve_client(self, conn: socket.socket, ident: int) -> None:
        client = _Client(ident, conn)
        try:
            with conn:
                conn.settimeout(CLIENT_TIMEOUT_S)
                uid = peer_uid(conn)
                if uid != os.getuid():
                    # Fail closed: a peer of another user gets nothing, not even our key.
                    self._count("refused_peers")
                    log.warning("Refused a connection from uid %d.", uid)
                    return
                while not self.shared.stop.is_set():
                    # A client holding a map (a lease, or a copy still being made) may stay silent for as
                    # long as it needs; only other clients time out.
                    conn.settimeout(None if client.mode is not None else CLIENT_TIMEOUT_S)
                    try:
                        frame = receive(conn, REQUEST_LIMITS)
                    except PeerClosedError:
                        return
                    reply, fds = self._dispatch(client, frame)
                    self._settle(client)
                    try:
                        with client.send_lock:
                            send_encoded(conn, self._encode_reply(reply), fds)
                    finally:
                        # The reply owns its descriptors (duplicates); the kernel copied them into the message.
                        _close_fds(fds)
        except ProtocolError as exc:
            self._count("bad_frames")
            log.warning("Dropped client %d: %s.", ident, exc)
        except OSError as exc:
            self._count("client_errors")
            log.warning("Client %d went away: %s.", ident, exc)
        finally:
            self._forget(client)

    def _encode_reply(self, reply: Message) -> bytes:
        try:
            return encode(reply, REPLY_LIMITS)
        except ProtocolError as exc:  # ours, not the client's: it gets the reason, the connection stays
            self._count("oversized_replies")
            return encode(ErrorReply(str(exc)), REPLY_LIMITS)

    def _dispatch(self, client: _Client, frame: Frame) -> Reply:
        sent = list(frame.fds)
        try:
            try:
                request: Request[Any] = read_request(frame)
            except BadRequestError as exc:
                self._count("unknown_requests" if exc.unknown else "bad_requests")
                return ErrorReply(str(exc)), ()
            if isinstance(request, BuildNext):  # its delta comes as the frame's one descriptor, which it takes
                if len(sent) != 1:
                    return ErrorReply(f"build_next needs its delta as one sealed memfd; {len(sent)} descriptors "
                                      "came with it."), ()
                return self._handle_build_next(client, sent.pop())
            handler = getattr(self, f"_handle_{request.TYPE}")
            result: Reply = handler(client, request)
            return result
        finally:
            _close_fds(tuple(sent))  # other requests carry none; do not leak what a bad client sends

    def _count(self, name: str, amount: int = 1) -> None:
        with self.shared.lock:
            self.shared.counters[name] += amount

    def _settle(self, client: _Client) -> None:
        """After a request: the client stays in flight only while it may still map; a queued release may be due."""
        with self.shared.lock:
            if client.attaching:
                self.shared.attaching.add(client.ident)
            else:
                self.shared.attaching.discard(client.ident)
        self._release_if_due()

    def _forget(self, client: _Client) -> None:
        """The connection is gone: its lease and any attach in flight end with it."""
        with self.shared.lock:
            self.shared.clients -= 1
            self.shared.attaching.discard(client.ident)
        self._end_lease(client)
        self._release_if_due()

    def _corrupted(self, found: Corruption) -> None:
        """The scrubber found a tensor changed in memory: refuse new attaches, and say so everywhere."""
        with self.shared.lock:
            self.shared.corrupt.append(found.sentence())
            holders = sorted(pid for pid in self.shared.lease_pids.values() if pid is not None)
        log.error("Weights changed in memory: %s; refusing new attaches (engines holding leases: %s).",
                  found.sentence(), holders or "none")
        append_event(self.run_dir, ev.ScrubFailed(
            daemon=self.descriptor.name, key_id=self.descriptor.key_id, tensor=found.tensor,
            arena_offset=found.arena_offset, block=list(found.block) if found.block else None, byte=found.byte,
            reason=found.sentence(), lease_pids=holders))
        self._tell_lease_holders(found)

    def _tell_lease_holders(self, found: Corruption) -> None:
        """Each engine holding a lease hears which tensor changed, at once: it maps these very pages.

        Never blocks the scrubber: a frame this small fits an idle lease's socket buffer; a holder whose buffer is
        full is not reading its lease, and one that took part of the frame has a broken stream, so its lease ends.
        """
        frame = encode(CorruptNotice(tensor=found.tensor, reason=found.sentence()), NOTICE_LIMITS)
        with self.shared.lock:
            holders = list(self.shared.lease_clients.values())
        for client in holders:
            with client.send_lock:
                try:
                    sent = client.conn.send(frame, socket.MSG_DONTWAIT) if client.conn is not None else 0
                except OSError as exc:
                    log.warning("Could not tell engine pid %s that its weights changed (%s).", client.pid, exc)
                    continue
                if sent < len(frame) and client.conn is not None:
                    log.warning("Engine pid %s took %d of the %d bytes telling it its weights changed; ending its "
                                "lease.", client.pid, sent, len(frame))
                    with contextlib.suppress(OSError):
                        client.conn.shutdown(socket.SHUT_RDWR)

    def _end_lease(self, client: _Client) -> None:
        with self.shared.lock:
            had = client.ident in self.shared.leases
            self.shared.leases.discard(client.ident)
            self.shared.lease_pids.pop(client.ident, None)
            self.shared.lease_clients.pop(client.ident, None)
        if had:
            log.info("Engine pid %s detached (zero_copy).", client.pid)
            append_event(self.run_dir, ev.Release(daemon=self.descriptor.name, key_id=self.descriptor.key_id,
                                                  mode="zero_copy", client_pid=client.pid))

    def _release_if_due(self) -> None:
        """Carry out a queued copy-mode release once no attach is in flight and no lease is held."""
        with self.shared.lock:
            asked = self.shared.release
            if asked is None or not lease_rules.release_due(self._holders()):
                return
            self.shared.release = None
            self.shared.state = "released"
            self.shared.released = ReleasedTo(at=datetime.now(UTC).isoformat(timespec="seconds"),
                                              client_pid=asked.client_pid)
            self.loaded.arena.close()
        log.info("Released the weights to the copy-mode engine %s.", asked.client_pid)
        append_event(self.run_dir, ev.Release(daemon=self.descriptor.name, key_id=self.descriptor.key_id,
                                              mode="copy", client_pid=asked.client_pid, weights_dropped=True,
                                              queued_s=round(time.time() - asked.asked, 3)))

    def _holders(self) -> Holders:
        """What the lease rules read (the caller holds the shared lock)."""
        return Holders(self.shared.state, len(self.shared.attaching), len(self.shared.leases),
                       self.shared.release is not None)

    # -- requests ------------------------------------------------------------------------------------

    def _summary(self) -> DaemonSummary:
        d = self.descriptor
        with self.shared.lock:
            state, released = self.shared.state, self.shared.released
        return DaemonSummary(name=d.name, key_id=d.key_id, key=d.key, plan=d.plan, config=d.config,
                             source=d.source, device=d.device, state=state, released=released)

    def _released_message(self) -> str:
        """Why this daemon holds no weights, for error replies (the caller holds no lock)."""
        with self.shared.lock:
            released = self.shared.released
        if released is None:
            return "this daemon holds no weights"
        return (f"this daemon released its weights to a copy-mode engine (pid {released.client_pid}) "
                f"at {released.at}")

    def _handle_hello(self, client: _Client, request: Hello) -> Reply:
        client.pid = request.pid
        # A client that trusts us may leave out `checkpoint`; every field it sends must match.
        mismatched = request.key.mismatched_fields(self.descriptor.key)
        with self.shared.lock:
            released = self.shared.state != "ready"
            self.shared.counters["hellos"] += 1
            corrupt = tuple(self.shared.corrupt)
        # --trust-daemon leaves out `checkpoint`: the engine never compared its checkpoint's content with ours.
        decision = lease_rules.hello(mismatched, not released, bool(corrupt), request.key.checkpoint is None)
        status = decision.status
        for counter in decision.counters:
            self._count(counter)
        if status != "hit":
            log.info("Engine pid %s missed (%s).", client.pid, status if released else ", ".join(mismatched))
        client.matched = status == "hit"
        return HelloReply(status=status, mismatched=tuple(mismatched), daemon=self._summary(),
                          corrupt=corrupt or None), ()

    def _handle_manifest(self, client: _Client, request: Manifest) -> Reply:
        return ManifestReply(tensors=self.loaded.key_file.manifest, daemon=self._summary()), ()

    def _handle_map(self, client: _Client, request: MapRequest) -> Reply:
        mode = request.mode
        if not client.matched:
            return ErrorReply("say hello with a matching key before asking for a map"), ()
        arena = self.loaded.arena
        fds: tuple[int, ...] = ()
        with self.shared.lock:
            ready = self.shared.state == "ready"
            corrupt = tuple(self.shared.corrupt)
            if ready and not corrupt:
                if lease_rules.takes_lease(mode):
                    self.shared.leases.add(client.ident)
                    self.shared.lease_pids[client.ident] = client.pid
                    self.shared.lease_clients[client.ident] = client
                self.shared.counters["attaches"] += 1
                self.shared.counters[counter_names.attaches(mode)] += 1
                self.shared.counters["bytes_served"] += arena.total_bytes
                # Duplicated under the lock so a concurrent release cannot close it mid-send.
                if isinstance(arena, CpuArena):
                    fds = (arena.engine_descriptor(),)
        if not ready:
            return ErrorReply(self._released_message()), ()
        if corrupt:  # found between this client's hello and its map: the hello's answer no longer holds
            return ErrorReply(f"the daemon {self.descriptor.name} found its weights changed in memory "
                              f"({'; '.join(corrupt)}) and refuses new attaches"), ()
        log.info("Engine pid %s attached (%s).", client.pid, mode)
        client.mode = mode
        if isinstance(arena, CpuArena):
            return MapReply(kind="memfd", total_bytes=arena.total_bytes, entries=self._wire_entries), fds
        cuda = CudaHandle(**arena.export_handle())
        return MapReply(kind="cuda", total_bytes=arena.total_bytes, entries=self._wire_entries, cuda=cuda), fds

    def _handle_release(self, client: _Client, request: Release) -> Reply:
        # Copy mode hands ownership to the engine: the daemon lets go of its weights once no other engine is
        # attaching or holds a lease (their memory stays in use anyway).
        with self.shared.lock:
            if client.mode == "copy":
                self.shared.attaching.discard(client.ident)
            decision = lease_rules.release(client.mode, self._holders())
            if decision.queue:
                self.shared.release = _Release(client.pid, time.time())
        if decision.kept:
            append_event(self.run_dir, ev.Release(
                daemon=self.descriptor.name, key_id=self.descriptor.key_id, mode="copy", client_pid=client.pid,
                weights_dropped=False, kept_for_attaches=decision.kept_for_attaches,
                kept_for_leases=decision.kept_for_leases))
        if decision.end_lease:
            self._end_lease(client)
        client.matched = False  # another map on this connection needs another hello
        client.mode = None
        self._release_if_due()
        with self.shared.lock:
            state, pending = self.shared.state, self.shared.release is not None
        return ReleaseReply(state=state, release_queued=pending), ()

    def _handle_check_arena(self, client: _Client, request: CheckArena) -> Reply:
        """Re-hash every processed tensor in the arena against the digest recorded when it was built.

        Outside the shared lock, and one check at a time: hashing a large arena takes seconds, and hellos,
        stats and the health probes must answer meanwhile (a kubelet gives a probe 1 s)."""
        from wcache.load.loader import changed_in_arena

        with self.shared.lock:
            ready = self.shared.state == "ready"
        if ready:
            try:
                with self._checking:
                    changed = changed_in_arena(self.loaded.arena, self.loaded.entries, self.loaded.processed_digests)
                return ArenaReport(checked=len(self.loaded.entries), changed=changed), ()
            except ArenaClosedError:
                pass  # released to a copy-mode engine, or stopping, before the check began
        return ErrorReply(f"{self._released_message()}; nothing to check"), ()

    def stats(self) -> StatsReply:
        d = self.descriptor
        with self.shared.lock:
            state = self.shared.state
            holds = state == "ready"
            counters = dict(self.shared.counters)
            if self.scrubber is not None:
                counters["scrub_passes"] = self.scrubber.stats.passes
                counters["scrub_bytes"] = self.scrubber.stats.bytes_hashed
                counters["scrub_last_pass_ms"] = round(self.scrubber.stats.last_pass_s * 1000)
            return StatsReply(
                name=d.name, pid=d.pid, device=d.device, tp_size=d.tp_size, tp_rank=d.tp_rank,
                key_id=d.key_id, source=d.source, state=state, holds_weights=holds,
                weights_bytes=self.loaded.arena.total_bytes if holds else 0,
                leases=len(self.shared.leases), uptime_s=round(time.time() - self.started, 3),
                load_s=round(self.loaded.load_seconds, 3), counters=counters,
                connections=self.shared.clients, release_queued=self.shared.release is not None,
                released=self.shared.released, provenance=d.provenance,
                corrupt=tuple(self.shared.corrupt) or None,
            )

    def _handle_stats(self, client: _Client, request: Stats) -> Reply:
        return self.stats(), ()

    def _handle_build_next(self, client: _Client, delta_fd: int) -> Reply:
        if self.host is None:
            os.close(delta_fd)
            return BuiltNext(elsewhere="this daemon hosts no other version"), ()
        try:
            return self.host.build(self, delta_fd), ()
        except WcacheError as exc:
            return ErrorReply(str(exc)), ()

    def _handle_shutdown(self, client: _Client, request: Shutdown) -> Reply:
        with self.shared.lock:
            leases = len(self.shared.leases - {client.ident})
        if not lease_rules.shutdown_stops(leases, request.force):
            return ShutdownReply(stopping=False, leases=leases), ()
        self.request_stop()
        return ShutdownReply(stopping=True, leases=leases), ()


def _close_fds(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
