"""An attach's steps in order: the key while connecting, each daemon holding it tried, then a hit or a miss."""

from __future__ import annotations

import time
from pathlib import Path

from wcache.attach.context import AttachContext, collector_paused
from wcache.attach.fallback import miss
from wcache.attach.found import Found, key_while_connecting
from wcache.attach.hit import hit
from wcache.attach.lease import AttachedWeights
from wcache.attach.mapping import Mapped, Refusal, try_map
from wcache.attach_options import AttachOptions
from wcache.daemon_choice import holding
from wcache.errors import BadInputError, option
from wcache.ipc.run_dir.directory import default_run_dir, ensure_run_dir
from wcache.ipc.wire.client import DaemonConnection
from wcache.key.compute import compute_key
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import HashProgress
from wcache.plan.spec import PlanSpec

WAIT_POLL_S = 0.25


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
    pass for it and compares only config, tokenizer, plan and format. `wait_s` keeps looking for a daemon with this
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
    context = AttachContext(model, plan, options, device, store, progress, run_dir, began, dp_size, engine, views)
    wanted, local, found = key_while_connecting(context, timings)
    refusal: Refusal | None = None
    try:
        while True:
            fitting = [d for d in holding(found.candidates, wanted)
                       if isinstance(found.connections[d.name], DaemonConnection)]
            if options.trust_daemon and options.daemon is None and len(fitting) > 1:
                raise BadInputError(
                    f"{len(fitting)} daemons on {device} match this config and plan; name one with {option('daemon')}."
                )
            for descriptor in fitting:
                connection = found.connections.pop(descriptor.name)
                assert isinstance(connection, DaemonConnection)
                with collector_paused():
                    outcome = try_map(connection, descriptor, wanted, local, context)
                if isinstance(outcome, Mapped):
                    return hit(outcome, descriptor, connection, local, context, timings)
                refusal = outcome
            if time.monotonic() >= deadline:
                break
            found.close()
            time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
            found = Found.look(run_dir, device, options.daemon)
        if local is None:
            local = compute_key(model, plan, store=store, progress=progress)
        return miss(local, found, refusal, context, timings)
    finally:
        found.close()
