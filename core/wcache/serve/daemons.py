"""The daemon group a served vLLM attaches to: exactly the plan vLLM will ask for, reused or started.

The plan comes from vLLM itself (`plan_child`: its dtype rule, TP size, quantization and layout), so the
launcher never starts a daemon that the server then misses. A running group of the same checkpoint and plan is
reused and left running when the launcher stops; a group the launcher started lives as long as the launcher,
across every restart of its server, and stops with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from wcache.daemon.launch import DaemonGroup, checkpoint_identity, group_of, start_daemons
from wcache.ipc.run_dir.directory import DaemonDescriptor, DaemonExistsError, census
from wcache.plan.spec import PlanSpec


@dataclass
class ServedDaemons:
    """The daemons a launcher's servers attach to; `started` is the group it started itself (None: reused)."""

    descriptors: list[DaemonDescriptor]
    started: DaemonGroup | None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.descriptors)

    @property
    def key_id(self) -> str:
        """Rank 0's key id: the weights, their config and tokenizer, and the plan."""
        return self.descriptors[0].key_id

    def stop(self) -> None:
        """Stop the group if this launcher started it; a reused group keeps serving whoever else uses it."""
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
                   env: Mapping[str, str] | None = None) -> ServedDaemons:
    """The group serving `model` with `plan` in `run_dir`: a running one, else one started now (and ready)."""
    found = find_group(run_dir, model, plan, device)
    if found is not None:
        return ServedDaemons(found, None)
    try:
        group = start_daemons(model, device=device, tp=plan.tp_size, dtype=plan.dtype,
                              layout=plan.layout, run_dir=run_dir, env=env)
    except DaemonExistsError as exc:
        # The same weights under another path already serve this key: the refusal names that daemon.
        found = find_group(run_dir, model, plan, device, named_in=str(exc))
        if found is None:
            raise
        return ServedDaemons(found, None)
    return ServedDaemons(group.descriptors(), group)
