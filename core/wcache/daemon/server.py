"""The daemon's serve loop: one thread per client, leases for zero-copy clients, any bad client dropped alone."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wcache.arena import CpuArena
from wcache.events import append_event
from wcache.loader import LoadedRank
from wcache.protocol import Frame, PeerClosedError, ProtocolError, peer_uid, receive, require, send
from wcache.rundir import DaemonDescriptor, remove_daemon_files

log = logging.getLogger("wcache.daemon")

# A reply: its type, its fields, and the descriptors that travel with it.
Reply = tuple[str, dict[str, Any], tuple[int, ...]]
# A client that stops mid-frame must not hold a thread forever.
CLIENT_TIMEOUT_S = 60.0
KEY_FIELDS = ("checkpoint", "config", "plan", "format")


@dataclass
class _Client:
    """Per-connection state: whether it said hello with our key, and whether it holds a lease."""

    ident: int
    pid: int | None = None
    matched: bool = False
    mode: str | None = None


@dataclass
class DaemonState:
    """Everything the serve threads share, behind one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = "ready"
    leases: set[int] = field(default_factory=set)
    counters: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)


class DaemonServer:
    """Serves one loaded rank on a Unix socket."""

    def __init__(self, loaded: LoadedRank, descriptor: DaemonDescriptor, run_dir: Path) -> None:
        self.loaded = loaded
        self.descriptor = descriptor
        self.run_dir = run_dir
        self.shared = DaemonState()
        self.started = time.time()
        self._listener: socket.socket | None = None
        self._next_ident = 0

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
        listener.listen(64)
        listener.settimeout(0.25)
        self._listener = listener

    def serve_forever(self) -> None:
        assert self._listener is not None
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
            self._next_ident += 1
            threading.Thread(target=self._serve_client, args=(conn, self._next_ident), daemon=True).start()
        self._shutdown()

    def request_stop(self) -> None:
        self.shared.stop.set()

    def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
        remove_daemon_files(self.run_dir, self.descriptor.name)
        with self.shared.lock:
            leases = len(self.shared.leases)
            self.shared.state = "stopped"
        append_event(self.run_dir, "stop", daemon=self.descriptor.name, key_id=self.descriptor.key_id,
                     leases=leases)
        self.loaded.arena.close()

    # -- one client ----------------------------------------------------------------------------------

    def _serve_client(self, conn: socket.socket, ident: int) -> None:
        client = _Client(ident)
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
                    # A lease holder may stay silent for as long as it serves; only other clients time out.
                    conn.settimeout(None if client.mode == "zero_copy" else CLIENT_TIMEOUT_S)
                    try:
                        frame = receive(conn)
                    except PeerClosedError:
                        return
                    reply_type, fields, fds = self._dispatch(client, frame)
                    try:
                        send(conn, reply_type, fields, fds)
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
            self._end_lease(client)

    def _dispatch(self, client: _Client, frame: Frame) -> Reply:
        for fd in frame.fds:
            os.close(fd)  # clients never send descriptors; do not leak what a bad one sends
        handler = getattr(self, f"_handle_{frame.type}", None)
        if handler is None:
            self._count("unknown_requests")
            return "error", {"message": f"unknown request {frame.type!r}"}, ()
        try:
            return handler(client, frame.fields)
        except ProtocolError as exc:
            self._count("bad_requests")
            return "error", {"message": str(exc)}, ()

    def _count(self, name: str, amount: int = 1) -> None:
        with self.shared.lock:
            self.shared.counters[name] += amount

    def _end_lease(self, client: _Client) -> None:
        with self.shared.lock:
            had = client.ident in self.shared.leases
            self.shared.leases.discard(client.ident)
        if had:
            append_event(self.run_dir, "release", daemon=self.descriptor.name, key_id=self.descriptor.key_id,
                         mode="zero_copy", client_pid=client.pid)

    # -- requests ------------------------------------------------------------------------------------

    def _summary(self) -> dict[str, Any]:
        d = self.descriptor
        with self.shared.lock:
            state = self.shared.state
        return {"name": d.name, "key_id": d.key_id, "key": d.key, "plan": d.plan, "config": d.config,
                "source": d.source, "device": d.device, "state": state}

    def _handle_hello(self, client: _Client, fields: dict[str, Any]) -> Reply:
        wanted = require(fields, "key", dict)
        client.pid = fields.get("pid") if isinstance(fields.get("pid"), int) else None
        # A client that trusts us may leave out `checkpoint`; every field it sends must match.
        compared = [f for f in KEY_FIELDS if f in wanted]
        if "plan" not in compared or "config" not in compared or "format" not in compared:
            raise ProtocolError("hello must carry at least the config, plan and format fields")
        mismatched = [f for f in compared if wanted[f] != self.descriptor.key[f]]
        with self.shared.lock:
            released = self.shared.state != "ready"
            self.shared.counters["hellos"] += 1
        if released:
            status = "released"
            self._count("misses_released")
        elif mismatched:
            status = "miss"
            self._count("misses_" + "_".join(mismatched))
        else:
            status = "hit"
            self._count("hits")
        client.matched = status == "hit"
        return "hello", {"status": status, "mismatched": mismatched, "daemon": self._summary()}, ()

    def _handle_manifest(self, client: _Client, fields: dict[str, Any]) -> Reply:
        tensors = [e.to_json() for e in self.loaded.key_file.manifest]
        return "manifest", {"tensors": tensors, "daemon": self._summary()}, ()

    def _handle_map(self, client: _Client, fields: dict[str, Any]) -> Reply:
        mode = require(fields, "mode", str)
        if mode not in ("zero_copy", "copy"):
            raise ProtocolError(f"mode must be zero_copy or copy, not {mode!r}")
        if not client.matched:
            return "error", {"message": "say hello with a matching key before asking for a map"}, ()
        arena = self.loaded.arena
        with self.shared.lock:
            if self.shared.state != "ready":
                return "error", {"message": "this daemon released its weights"}, ()
            if mode == "zero_copy":
                self.shared.leases.add(client.ident)
            self.shared.counters["attaches"] += 1
            self.shared.counters[f"attaches_{mode}"] += 1
            self.shared.counters["bytes_served"] += arena.total_bytes
            # The descriptor is duplicated under the lock so a concurrent release cannot close it mid-send.
            fds: tuple[int, ...] = (os.dup(arena.fd),) if isinstance(arena, CpuArena) else ()
        client.mode = mode
        reply: dict[str, Any] = {
            "kind": "memfd" if isinstance(arena, CpuArena) else "cuda",
            "total_bytes": arena.total_bytes,
            "entries": [e.to_wire() for e in self.loaded.entries],
        }
        if not isinstance(arena, CpuArena):
            reply["cuda"] = arena.export_handle()
        return "map", reply, fds

    def _handle_release(self, client: _Client, fields: dict[str, Any]) -> Reply:
        if client.mode == "copy":
            # Copy mode hands ownership to the engine and the daemon lets go of its weights, unless zero-copy
            # engines still map them: their memory stays in use anyway, and new engines can still attach.
            with self.shared.lock:
                others = len(self.shared.leases - {client.ident})
                if self.shared.state == "ready" and not others:
                    self.shared.state = "released"
                    self.loaded.arena.close()
            append_event(self.run_dir, "release", daemon=self.descriptor.name, key_id=self.descriptor.key_id,
                         mode="copy", client_pid=client.pid, kept_for_leases=others)
        else:
            self._end_lease(client)
        client.mode = None
        return "released", {"state": self._summary()["state"]}, ()

    def _handle_check_arena(self, client: _Client, fields: dict[str, Any]) -> Reply:
        """Re-hash every processed tensor in the arena against the digest recorded when it was built."""
        from wcache.loader import processed_digest

        with self.shared.lock:
            if self.shared.state != "ready":
                return "error", {"message": "this daemon released its weights; nothing to check"}, ()
            tensors = self.loaded.arena.tensors(self.loaded.entries)
            changed = [name for name, tensor in tensors.items()
                       if processed_digest(tensor) != self.loaded.processed_digests[name]]
        return "arena", {"checked": len(tensors), "changed": changed}, ()

    def stats(self) -> dict[str, Any]:
        d = self.descriptor
        with self.shared.lock:
            state = self.shared.state
            holds = state == "ready"
            return {
                "name": d.name, "pid": d.pid, "device": d.device, "tp_size": d.tp_size, "tp_rank": d.tp_rank,
                "key_id": d.key_id, "source": d.source, "state": state, "holds_weights": holds,
                "weights_bytes": self.loaded.arena.total_bytes if holds else 0,
                "leases": len(self.shared.leases), "uptime_s": round(time.time() - self.started, 3),
                "load_s": round(self.loaded.load_seconds, 3), "counters": dict(self.shared.counters),
            }

    def _handle_stats(self, client: _Client, fields: dict[str, Any]) -> Reply:
        return "stats", self.stats(), ()

    def _handle_shutdown(self, client: _Client, fields: dict[str, Any]) -> Reply:
        force = bool(fields.get("force", False))
        with self.shared.lock:
            leases = len(self.shared.leases - {client.ident})
        if leases and not force:
            return "shutdown", {"stopping": False, "leases": leases}, ()
        self.request_stop()
        return "shutdown", {"stopping": True, "leases": leases}, ()


def _close_fds(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
