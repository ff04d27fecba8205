"""An attach's weights, and the lease that keeps zero-copy tensors backed: a watcher notices the daemon leave, and
hears when the daemon finds those weights changed in memory."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from wcache.attach.report import AttachReport
from wcache.ipc.wire.client import DaemonConnection
from wcache.ipc.wire.framing import NOTICE_LIMITS, PeerClosedError, ProtocolError, receive
from wcache.ipc.wire.messages import CorruptNotice, read_reply
from wcache.key.cache_key import KeyFile
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event

log = logging.getLogger("wcache.attach")

if TYPE_CHECKING:
    import torch

    from wcache.ipc.arenas.engine_side import MappedArena


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
    """Until the lease ends: record each tensor the daemon reports changed in memory (the one frame it sends
    unasked); anything else that wakes this thread means the connection is gone."""
    unexpected = False
    while True:
        try:
            sock.settimeout(None)
            frame = receive(sock, NOTICE_LIMITS)
        except (OSError, ProtocolError) as exc:
            # Closed under us, by close() or by the daemon going away; or a frame no daemon of ours sends.
            unexpected = isinstance(exc, ProtocolError) and not isinstance(exc, PeerClosedError)
            break
        try:
            notice = read_reply(frame)
        except ProtocolError:
            unexpected = True
            break
        finally:
            for fd in frame.fds:
                os.close(fd)
        if not isinstance(notice, CorruptNotice):
            unexpected = True
            break
        _weights_corrupt(notice, report, run_dir)
    if closing.is_set():
        return
    report.lost.set()
    append_event(run_dir, ev.DaemonLost(daemon=report.daemon, key_id=report.key_id, device=report.device,
                                        tensors_valid=report.device == "cpu", unexpected_data=unexpected))


def _weights_corrupt(notice: CorruptNotice, report: AttachReport, run_dir: Path) -> None:
    """The daemon found a tensor this process maps changed in memory: say so once, where operators look."""
    report.corrupt.add(notice.tensor, notice.reason)
    log.error("wcache: the daemon %s found the weights this engine maps changed in memory: %s; this engine must "
              "not serve them until it switches or restarts on good weights.", report.daemon, notice.reason)
    append_event(run_dir, ev.EngineWeightsCorrupt(daemon=report.daemon, key_id=report.daemon_key_id,
                                                  tensor=notice.tensor, reason=notice.reason))
