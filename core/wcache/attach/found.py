"""The daemons that may serve an attach, a connection to each, and the key to ask for, computed meanwhile."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from wcache.attach.context import AttachContext, collector_paused
from wcache.daemon_choice import on_device
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import WantedKey
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key, trusted_key


def connect_all(descriptors: list[DaemonDescriptor]) -> dict[str, DaemonConnection | DaemonError]:
    results: dict[str, DaemonConnection | DaemonError] = {}
    for d in descriptors:
        try:
            results[d.name] = DaemonConnection(d.socket)
        except DaemonError as exc:
            results[d.name] = exc
    return results


@dataclass(slots=True)
class Found:
    """The daemons that may serve this attach (live, on its device, named if one is), and a connection to each."""

    candidates: list[DaemonDescriptor]
    connections: dict[str, DaemonConnection | DaemonError]

    @classmethod
    def look(cls, run_dir: Path, device: str, daemon: str | None) -> Found:
        candidates = on_device(run_dir, device, daemon)
        return cls(candidates, connect_all(candidates))

    def close(self) -> None:
        for leftover in self.connections.values():
            if isinstance(leftover, DaemonConnection):
                leftover.close()
        self.connections.clear()


def key_while_connecting(ctx: AttachContext, timings: dict[str, float]) -> tuple[WantedKey, KeyFile | None, Found]:
    """The key to ask for (and the local KeyFile, unless the daemon is trusted), found while connecting."""

    def full_key() -> KeyFile:
        t = time.perf_counter()
        result = compute_key(ctx.model, ctx.plan, store=ctx.store, progress=ctx.progress)
        timings["key"] = (time.perf_counter() - t) * 1000
        return result

    with collector_paused(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-key") as pool:
        if ctx.options.trust_daemon:
            t = time.perf_counter()
            wanted = WantedKey(**trusted_key(ctx.model, ctx.plan, ctx.store))
            timings["key"] = (time.perf_counter() - t) * 1000
        else:
            key_future = pool.submit(full_key)
        t = time.perf_counter()
        found = Found.look(ctx.run_dir, ctx.device, ctx.options.daemon)
        timings["connect"] = (time.perf_counter() - t) * 1000
        if ctx.options.trust_daemon:
            return wanted, None, found
        try:
            local = key_future.result()
        except BaseException:
            found.close()
            raise
        return WantedKey.of(local.key), local, found
