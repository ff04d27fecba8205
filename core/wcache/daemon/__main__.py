"""A rank daemon process: `python -m wcache.daemon ...` (started by the supervisor, not by users)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from wcache.checkpoint.provenance import FileVerdict, counts, overall
from wcache.daemon.argv import LoadArgs
from wcache.daemon.server import DaemonServer
from wcache.daemon.version_host import VersionHost, describe
from wcache.delta.arena import build_next, find_parent
from wcache.errors import EXIT_OK, EXIT_UNAVAILABLE, WcacheError, marked, option
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    DaemonExistsError,
    daemon_name,
    ensure_run_dir,
    hold_daemon_lock,
    process_created,
    write_descriptor,
)
from wcache.ipc.run_dir.loading import LoadingBoard, LoadingRecord
from wcache.ipc.wire.status_pipe import Exists, Failed, ProgressReporter, RankReady, StatusWriter
from wcache.key.cache_key import KeyFile, WeightCacheKey
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import HashProgress
from wcache.key.provenance import require, verdicts_of
from wcache.load.loader import LoadedRank, load_rank
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event
from wcache.monitor.logs import configure as configure_logging

log = logging.getLogger("wcache.daemon")


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wcache.daemon")
    LoadArgs.add_to(parser)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--health-url", default=None)
    parser.add_argument("--supervisor-pid", type=int, default=None)
    return parser.parse_args(argv)


class _Both:
    """Progress for the supervisor's pipe and for the run dir's loading record alike."""

    def __init__(self, *targets: HashProgress) -> None:
        self._targets = targets

    def start(self, total_bytes: int, num_files: int) -> None:
        for target in self._targets:
            target.start(total_bytes, num_files)

    def advance(self, nbytes: int) -> None:
        for target in self._targets:
            target.advance(nbytes)


@dataclass
class _Loading:
    """One rank while it loads: its arguments, run dir and loading record, the lock of the name its key gives
    (taken as soon as the key is known), and each file's provenance verdict where it was judged before READY."""

    args: argparse.Namespace
    load: LoadArgs
    run_dir: Path
    board: LoadingBoard
    status: StatusWriter
    locks: list[int] = field(default_factory=list)  # the name's lock, held open until the server takes it
    judged: list[FileVerdict] = field(default_factory=list)

    @classmethod
    def begin(cls, args: argparse.Namespace, status: StatusWriter) -> _Loading:
        run_dir = ensure_run_dir(args.run_dir)
        board = LoadingBoard(run_dir, LoadingRecord(
            pid=os.getpid(), pid_created=process_created(os.getpid()) or 0.0, source=str(args.model.absolute()),
            device=args.device, tp_size=args.tp, tp_rank=args.rank, supervisor_pid=args.supervisor_pid,
            started=time.time(), phase="starting"))
        return cls(args, LoadArgs.from_namespace(args), run_dir, board, status)

    def own_key(self, key: WeightCacheKey) -> None:
        """Take the name `key` gives on this device (DaemonExistsError when another daemon serves it)."""
        name = daemon_name(self.args.device, key.short_id)
        self.locks.append(hold_daemon_lock(self.run_dir, name, self.args.device))
        log.info("key %s: this process is daemon %s", key.short_id, name)
        self.board.update(name=name)

    def judge_and_own(self, key_file: KeyFile) -> None:
        """Judge the files' provenance where the key already holds every SHA-256 (else it follows READY), then
        take the name: a refused checkpoint leaves nothing behind."""
        if not (self.verdict_after_ready and any(f.sha256 is None for f in key_file.files)):
            self.judged[:] = verdicts_of(key_file.source, key_file.files, self.load.expected)
            require(tuple(self.judged), self.load.require_provenance, str(self.args.model))  # type: ignore[arg-type]
        self.own_key(key_file.key)

    @property
    def verdict_after_ready(self) -> bool:
        # Nothing refuses on the verdict: a cold pass leaves each file's SHA-256 for after READY.
        return self.load.require_provenance == "warn"


def main(argv: list[str] | None = None) -> int:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    configure_logging(f"rank{args.rank}", args.log_level, args.log_format, args.log_file)
    log.info("loading %s for %s (tp %d, rank %d)", args.model, args.device, args.tp, args.rank)
    status = StatusWriter()
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    loading: _Loading | None = None
    try:
        loading = _Loading.begin(args, status)
        loaded, bytes_read, parent = _load(loading)
        loading.board.update(phase="publishing")
        server = _publish(loading, loaded, parent, stop)
    except (Exception, KeyboardInterrupt) as exc:
        stop.loading = False  # reporting from here on: see _Stop
        return _report_failure(exc, args, status)
    finally:
        if loading is not None:
            loading.board.remove()  # ready (the descriptor says the rest) or gone
    _announce_ready(loading, server, bytes_read, parent)
    if loaded.sha256_after is not None:
        threading.Thread(target=_provenance_after_ready, args=(server, loaded, loading.load.expected), daemon=True,
                         name="wcache-sha256").start()
    assert stop.host is not None
    stop.host.serve(server)  # returns at once, cleaning up, if a stop came during loading
    log.info("stopped: daemon %s and every version built in its process", server.descriptor.name)
    return EXIT_OK


def _load(loading: _Loading) -> tuple[LoadedRank, int, DaemonDescriptor | None]:
    """The rank's weights: read from the checkpoint, or built from the parent daemon's arena and a delta. Also
    the bytes read from files, and the parent."""
    args, load = loading.args, loading.load
    parent_name = load.parent_of(args.rank)
    if parent_name is not None:
        parent = find_parent(loading.run_dir, parent_name)
        built = build_next(parent, args.model, str(args.model.absolute()), on_key=loading.own_key)
        log.info("built from daemon %s: %d tensor(s), %d output(s) changed, %d bytes read", parent.name,
                 built.tensors_changed, built.outputs_changed, built.bytes_read)
        return built.loaded, built.bytes_read, parent
    with DigestStore.open() as store:
        loaded = load_rank(args.model, load.plan_spec(args.rank), args.device, store,
                           _Both(ProgressReporter(loading.status, rank=args.rank), loading.board),
                           on_key=loading.judge_and_own, sha256_after_ready=loading.verdict_after_ready,
                           reusable_arena=load.version_pool > 0)
    return loaded, sum(e.nbytes for e in loaded.key_file.manifest), None


def _publish(loading: _Loading, loaded: LoadedRank, parent: DaemonDescriptor | None, stop: _Stop) -> DaemonServer:
    """Bind the rank's socket and write its descriptor: from here on engines find it. The version host that will
    serve it (and the versions built from it) is made here."""
    args = loading.args
    host = stop.host = VersionHost(loading.run_dir, args.scrub_interval, loading.load.version_pool, DaemonServer)
    judged = loading.judged
    descriptor = describe(loading.run_dir, loaded, parent, overall(judged) if judged else None, device=args.device,
                          tp_size=args.tp, tp_rank=args.rank, health_url=args.health_url,
                          supervisor_pid=args.supervisor_pid)
    server = stop.server = DaemonServer(loaded, descriptor, loading.run_dir, args.scrub_interval, host=host,
                                        lock_fd=loading.locks.pop() if loading.locks else None)
    server.bind()
    write_descriptor(loading.run_dir, descriptor)
    return server


def _announce_ready(loading: _Loading, server: DaemonServer, bytes_read: int, parent: DaemonDescriptor | None) -> None:
    """READY: the provenance verdict where it is known, the ready event, the supervisor's status line, the log."""
    args, descriptor, loaded = loading.args, server.descriptor, server.loaded
    _report_provenance(loading.run_dir, descriptor, loading.judged)
    append_event(loading.run_dir, ev.Ready(
        daemon=descriptor.name, key_id=descriptor.key_id, rank=args.rank, device=args.device,
        source=descriptor.source, weights_bytes=descriptor.weights_bytes, load_s=round(loaded.load_seconds, 3),
        bytes_read=bytes_read, parent_key_id=None if parent is None else parent.key_id,
        parent=None if parent is None else parent.name))
    loading.status.emit(RankReady(rank=args.rank, name=descriptor.name, key_id=descriptor.key_id,
                                  socket=descriptor.socket, weights_bytes=descriptor.weights_bytes,
                                  load_s=round(loaded.load_seconds, 3)))
    log.info("ready: daemon %s serves key %s, %d bytes, loaded in %.2f s", descriptor.name, descriptor.key_id,
             descriptor.weights_bytes, loaded.load_seconds)
    loading.status.close()


def _provenance_after_ready(server: DaemonServer, loaded: LoadedRank, expected: Path | None) -> None:
    """Each file's SHA-256, read once more after READY; the verdict then published as a preload's would be."""
    assert loaded.sha256_after is not None
    try:
        with DigestStore.open() as store:
            # The shards' SHA-256s now; config.json's and the tokenizer files' were read with the key.
            files = loaded.sha256_after.run(store) + loaded.key_file.companions
        judged = list(verdicts_of(loaded.key_file.source, files, expected))
        descriptor = msgspec.structs.replace(server.descriptor, files=files, provenance=overall(judged))
        if server.republish(descriptor):
            _report_provenance(server.run_dir, descriptor, judged)
    except Exception:  # the weights serve on; only the verdict is missing
        log.exception("provenance: each file's SHA-256 could not be computed after READY")


class _Stop:
    """What SIGTERM and SIGINT do to a rank. While it loads: interrupt the load (a KeyboardInterrupt, reported
    as stopped before it was ready). Once it serves: stop its server. While it reports how its load failed:
    nothing, as it exits right after. The supervisor stops every rank as soon as one reports a failure, often
    before that rank has finished reporting; an interrupt there printed a traceback on the stderr the ranks
    share with the user's (journald, `docker logs`, CI), breaking a JSON log stream."""

    def __init__(self) -> None:
        self.loading = True
        self.server: DaemonServer | None = None
        self.host: VersionHost | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.host is not None and self.server is not None:
            self.host.request_stop_all()
        elif self.server is not None:
            self.server.request_stop()
        elif self.loading:
            raise KeyboardInterrupt


def _report_failure(exc: BaseException, args: argparse.Namespace, status: StatusWriter) -> int:
    """Tell the supervisor (and the log) why this rank has no daemon; the rank's exit code."""
    if isinstance(exc, KeyboardInterrupt):
        log.info("stopped before it was ready")
        status.emit(Failed(rank=args.rank, reason="stopped before it was ready.", exit_code=EXIT_UNAVAILABLE))
        return EXIT_UNAVAILABLE
    if isinstance(exc, DaemonExistsError):
        log.info("%s", exc)
        status.emit(Exists(rank=args.rank, reason=str(exc)))
        return EXIT_OK
    if isinstance(exc, WcacheError):
        log.error("load failed: %s", exc)
        status.emit(Failed(rank=args.rank, reason=marked(exc), exit_code=exc.exit_code))
        return exc.exit_code
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        # Checkpoint reads raise CheckpointError; what runs out of space here is the run dir (lock, socket,
        # descriptor) or the arena's memory.
        reason = (f"no space left to publish the daemon in {args.run_dir} or to hold its weights "
                  f"({exc.strerror}); free some space or choose another {option('run_dir')}")
        log.error("load failed: %s", reason)
        status.emit(Failed(rank=args.rank, reason=reason, exit_code=EXIT_UNAVAILABLE))
        return EXIT_UNAVAILABLE
    # A crash (a bug, not the user's input): this rank is unavailable, never "a check found a difference"; the
    # supervisor must hear why, whatever it was.
    log.error("rank %d failed while loading", args.rank, exc_info=exc)
    status.emit(Failed(rank=args.rank, reason=f"{type(exc).__name__}: {exc}", exit_code=EXIT_UNAVAILABLE))
    return EXIT_UNAVAILABLE


def _report_provenance(run_dir: Path, descriptor: DaemonDescriptor, judged: list[FileVerdict]) -> None:
    """The verdict as an event, and a warning naming each file that differs or is unknown."""
    if not judged:
        return
    append_event(run_dir, ev.Provenance(daemon=descriptor.name, key_id=descriptor.key_id,
                                        verdict=overall(judged), counts=counts(judged),
                                        differs=[v.name for v in judged if v.verdict == "differs"],
                                        unknown=[v.name for v in judged if v.verdict == "unknown"]))
    for verdict in judged:
        if verdict.verdict == "differs":
            log.warning("provenance: %s", verdict.sentence())
        elif verdict.verdict == "unknown":
            log.info("provenance: %s", verdict.sentence())


if __name__ == "__main__":
    sys.exit(main())
