"""The daemon group a served vLLM attaches to: exactly the plan vLLM will ask for, reused or started.

The plan comes from vLLM itself (`plan_child`: its dtype rule, TP size, quantization and layout), so the
launcher never starts a daemon that the server then misses. A running group of the same checkpoint and plan is
reused and left running when the launcher stops; a group the launcher started lives as long as the launcher,
across every restart of its server, and stops with it. Either way the launcher holds a zero-copy lease on every
rank for as long as it runs (a hello with the daemon's own key, a map, the connection kept open; nothing is
mapped here): between a server's death and its restart no engine holds one, and a `wcache stop` without
`--force` then refuses instead of taking the weights the restarted server is about to attach. A following
server's launcher moves its leases to each version the server is moved to (`move_to`), which a restart then
attaches: the version it started on is left to whoever stops it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from wcache.daemon.launch import DaemonGroup, start_daemons
from wcache.daemon.replace import checkpoint_identity
from wcache.errors import UnavailableError
from wcache.ipc.run_dir.directory import DaemonDescriptor, DaemonExistsError, census, group_of
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import Hello, MapRequest, WantedKey
from wcache.plan.spec import PlanSpec


@dataclass
class ServedDaemons:
    """The daemons a launcher's servers attach to; `started` is the group it started itself (None: reused)."""

    descriptors: list[DaemonDescriptor]
    started: DaemonGroup | None
    leases: list[DaemonConnection] = field(default_factory=list)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.descriptors)

    @property
    def key_id(self) -> str:
        """Rank 0's key id: the weights, their config and tokenizer, and the plan."""
        return self.descriptors[0].key_id

    def hold_leases(self) -> None:
        """Take a zero-copy lease on every rank, held until `stop`; UnavailableError when a rank refuses."""
        for descriptor in self.descriptors:
            self.leases.append(_lease(descriptor))

    def move_to(self, group: list[DaemonDescriptor]) -> None:
        """Hold the leases on `group` instead: the version a following server is being moved to, which its restart
        then attaches. The new leases are taken before the old ones end; UnavailableError, nothing changed, when a
        rank of `group` refuses."""
        taken: list[DaemonConnection] = []
        try:
            for descriptor in group:
                taken.append(_lease(descriptor))
        except BaseException:
            for connection in taken:
                connection.close()
            raise
        for connection in self.leases:
            connection.close()
        self.leases, self.descriptors = taken, list(group)

    def stop(self) -> None:
        """End the leases, and stop the group if this launcher started it; a reused group keeps serving whoever
        else uses it."""
        for connection in self.leases:
            connection.close()
        self.leases.clear()
        if self.started is not None:
            self.started.terminate()
            self.started = None


def _same_plan(descriptor: DaemonDescriptor, plan: PlanSpec) -> bool:
    held = descriptor.plan
    # What `preload --engine vllm` takes from vLLM's plan (quantization the daemons read from the checkpoint).
    return (held.tp_size, held.dtype, held.layout) == (plan.tp_size, plan.dtype, plan.layout)


def _whole_group(live: list[DaemonDescriptor], chosen: DaemonDescriptor) -> list[DaemonDescriptor] | None:
    group = group_of(chosen, live)
    return group if len(group) == chosen.tp_size else None


def find_group(run_dir: Path, model: Path, plan: PlanSpec, device: str,
               named_in: str | None = None) -> list[DaemonDescriptor] | None:
    """A whole running group of `model` (or, with `named_in`, of the daemon that sentence names) with `plan`."""
    from wcache.daemon.supervisor import rank_devices

    live = list(census(run_dir).live) if run_dir.exists() else []
    wanted = checkpoint_identity(model)
    first_device = rank_devices(device, plan.tp_size)[0]
    for descriptor in live:
        if descriptor.tp_rank != 0 or not _same_plan(descriptor, plan) or descriptor.device != first_device:
            continue
        if (descriptor.name in named_in) if named_in is not None else checkpoint_identity(descriptor.source) == wanted:
            group = _whole_group(live, descriptor)
            if group is not None:
                return group
    return None


def ensure_daemons(model: Path, plan: PlanSpec, device: str, run_dir: Path,
                   env: Mapping[str, str] | None = None, version_pool: int = 0) -> ServedDaemons:
    """The group serving `model` with `plan` in `run_dir`: a running one (with the version pool it has), else one
    started now (and ready) with a pool of `version_pool` bytes per rank."""
    found = find_group(run_dir, model, plan, device)
    if found is not None:
        return ServedDaemons(found, None)
    try:
        group = start_daemons(model, device=device, tp=plan.tp_size, dtype=plan.dtype,
                              layout=plan.layout, run_dir=run_dir, env=env, version_pool=version_pool)
    except DaemonExistsError as exc:
        # The same weights under another path already serve this key: the refusal names that daemon.
        found = find_group(run_dir, model, plan, device, named_in=str(exc))
        if found is None:
            raise
        return ServedDaemons(found, None)
    return ServedDaemons(group.descriptors(), group)


def _lease(descriptor: DaemonDescriptor) -> DaemonConnection:
    """A connection holding a zero-copy lease on `descriptor`'s daemon: the descriptors its map sends are closed
    at once (the launcher reads no weights); the lease lasts as long as the connection."""
    key = descriptor.key
    connection = DaemonConnection(descriptor.socket)
    try:
        hello = connection.request(Hello(key=WantedKey(config=key.config, tokenizer=key.tokenizer, plan=key.plan,
                                                       format=key.format, checkpoint=key.checkpoint),
                                         pid=os.getpid()))
        if hello.status != "hit":
            raise UnavailableError(f"daemon {descriptor.name} answers {hello.status} to its own key.")
        mapped = connection.request(MapRequest(mode="zero_copy"))
        for fd in mapped.fds:
            os.close(fd)
    except (DaemonError, UnavailableError):
        connection.close()
        raise
    return connection
