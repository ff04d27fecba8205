"""A rank daemon process: `python -m wcache.daemon ...` (started by the supervisor, not by users)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

from wcache.daemon.server import DaemonServer
from wcache.daemon.status_pipe import ProgressReporter, StatusWriter
from wcache.digest_store import DigestStore
from wcache.errors import WcacheError
from wcache.events import append_event
from wcache.key import KeyFile
from wcache.loader import load_rank
from wcache.plan import PlanSpec
from wcache.rundir import (
    DaemonDescriptor,
    DaemonExistsError,
    daemon_name,
    ensure_run_dir,
    hold_daemon_lock,
    process_created,
    socket_path,
    write_descriptor,
)


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wcache.daemon")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--plan", default="fused")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--health-url", default=None)
    parser.add_argument("--supervisor-pid", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    status = StatusWriter()

    def on_term(signum: int, frame: object) -> None:
        if server is not None:
            server.request_stop()
        else:
            raise KeyboardInterrupt

    server: DaemonServer | None = None
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        run_dir = ensure_run_dir(args.run_dir)
        spec = PlanSpec(tp_size=args.tp, tp_rank=args.rank, dtype=args.dtype, quantization=args.quantization,
                        layout=args.plan)
        locks: list[int] = []  # held (open) for the life of the process

        def own_key(key_file: KeyFile) -> None:
            locks.append(hold_daemon_lock(run_dir, daemon_name(args.device, key_file.key.short_id), args.device))

        with DigestStore.open() as store:
            loaded = load_rank(args.model, spec, args.device, store,
                               ProgressReporter(status, rank=args.rank), on_key=own_key)
        key_file = loaded.key_file
        name = daemon_name(args.device, key_file.key.short_id)
        descriptor = DaemonDescriptor(
            name=name, pid=os.getpid(), pid_created=process_created(os.getpid()) or 0.0, device=args.device,
            tp_size=args.tp, tp_rank=args.rank, key_id=key_file.key.short_id,
            key={"checkpoint": key_file.key.checkpoint, "config": key_file.key.config,
                 "plan": key_file.key.plan, "format": key_file.key.format},
            plan=key_file.plan.to_json(), config=key_file.config, source=key_file.source,
            socket=str(socket_path(run_dir, name)), health_url=args.health_url,
            supervisor_pid=args.supervisor_pid, started=datetime.now(UTC).isoformat(timespec="seconds"),
            weights_bytes=loaded.arena.total_bytes,
        )
        server = DaemonServer(loaded, descriptor, run_dir)
        server.bind()
        write_descriptor(run_dir, descriptor)
    except KeyboardInterrupt:
        status.emit("failed", rank=args.rank, reason="stopped before it was ready.", exit_code=1)
        return 1
    except DaemonExistsError as exc:
        status.emit("exists", rank=args.rank, reason=str(exc))
        return 0
    except WcacheError as exc:
        status.emit("failed", rank=args.rank, reason=str(exc), exit_code=exc.exit_code)
        return exc.exit_code
    except Exception as exc:  # the supervisor must hear why, whatever it was
        logging.exception("rank %d failed while loading", args.rank)
        status.emit("failed", rank=args.rank, reason=f"{type(exc).__name__}: {exc}", exit_code=1)
        return 1
    append_event(run_dir, "ready", daemon=descriptor.name, key_id=descriptor.key_id, rank=args.rank,
                 device=args.device, source=descriptor.source, weights_bytes=descriptor.weights_bytes,
                 load_s=round(loaded.load_seconds, 3))
    status.emit("ready", rank=args.rank, name=descriptor.name, key_id=descriptor.key_id,
                socket=descriptor.socket, weights_bytes=descriptor.weights_bytes,
                load_s=round(loaded.load_seconds, 3))
    status.close()
    server.serve_forever()  # returns at once, cleaning up, if a stop came during loading
    return 0


if __name__ == "__main__":
    sys.exit(main())
