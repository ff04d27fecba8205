"""Move a running reference engine to another daemon's weights between requests, or refuse and keep serving.

The new weights are attached (and their model built) while requests keep running on the old ones; the swap
itself takes the engine's request lock, so the request running then finishes on the weights it began with
and the next one starts on the new weights: no request ever sees two versions. A switch never falls back
to disk: when no daemon holds the checkpoint's key the switch is refused with the attach's reason and the
engine keeps what it had. The prefix cache needs no flush: its block hashes are namespaced by the weights'
content key (`block_manager.weights_root`), so blocks computed under the old weights cannot hit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import msgspec

from wcache.attach import AttachMissError, AttachReport, attach_with
from wcache.daemon_choice import lineage_checkpoint, on_device
from wcache.engine.engine import Engine, ServedWeights, checkpoint_model
from wcache.engine.model import Transformer
from wcache.errors import BadInputError, UnavailableError
from wcache.ipc.run_dir.directory import census, default_run_dir
from wcache.key.digest_store import DigestStore
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event
from wcache.serving.api import ServedClaim, WeightsSwitched


class SwitchMissError(UnavailableError):
    """No daemon serves the checkpoint a switch asked for; the engine still serves its old weights."""


@dataclass(frozen=True, slots=True)
class SwitchResult:
    """What a switch replaced, with what, and how long the attach and the swap took."""

    previous: ServedWeights
    current: ServedWeights
    report: AttachReport
    seconds: float

    def answer(self) -> WeightsSwitched:
        """The reply of POST /v1/weights."""
        return WeightsSwitched(object="weights_switch", previous=served_claim(self.previous),
                               current=served_claim(self.current), attach=self.report.summary(),
                               switch_ms=round(self.seconds * 1000, 3))


def served_claim(served: ServedWeights) -> ServedClaim:
    """The weights an engine claims to serve, as its API states them."""
    return ServedClaim(model=str(served.source) if served.source is not None else None, key=served.key,
                       key_id=served.key_id)


def _target(engine: Engine, checkpoint: Path | None, daemon: str | None) -> ServedWeights:
    """What a switch attaches, not yet keyed: `checkpoint`, or without it the weights of the one live daemon
    `daemon` names (a name or key id prefix): its checkpoint, or for a version built from a delta, that delta
    with its lineage's checkpoint (else the engine's own) for the config, tokenizer and headers."""
    if checkpoint is not None:
        return ServedWeights(checkpoint)
    if daemon is None:
        raise BadInputError("name the weights to switch to: a checkpoint, a daemon, or both.")
    run_dir = _run_dir(engine)
    named = on_device(run_dir, engine.device, daemon)
    if len(named) != 1:
        raise SwitchMissError(f"{len(named)} running daemons on {engine.device} match {daemon!r} in {run_dir}; "
                              "name exactly one.")
    (descriptor,) = named
    if descriptor.parent is None:
        return ServedWeights(Path(descriptor.source))
    lineage = lineage_checkpoint(census(run_dir).live, descriptor) or engine.served.checkpoint
    if lineage is None:
        raise BadInputError(f"daemon {descriptor.name} was built from a delta and no checkpoint of its lineage is "
                            "known; name one with the switch.")
    return ServedWeights(Path(descriptor.source), lineage=lineage)


def _run_dir(engine: Engine) -> Path:
    options = engine.attach_options
    return Path(options.run_dir) if options is not None and options.run_dir else default_run_dir()


def _architecture_change(old: Any, new: Any) -> list[str]:
    return [f.name for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)]


def switch_weights(engine: Engine, checkpoint: Path | None, daemon: str | None = None) -> SwitchResult:
    """Attach `checkpoint` (through `daemon` when named; without a checkpoint, the weights `daemon` holds) under
    the engine's own plan and serve it from the next request on. Raises SwitchMissError (no daemon serves it)
    or BadInputError, the engine unchanged."""
    if engine.attach_options is None:
        raise BadInputError("this engine loaded its weights without wcache; only an attached engine can switch.")
    if engine.tp.size > 1:
        raise BadInputError(f"switching a tensor-parallel engine (TP {engine.tp.size}) is not implemented; "
                            "restart it on the new checkpoint.")
    target = _target(engine, checkpoint, daemon)
    assert target.source is not None and target.checkpoint is not None
    source, architecture = target.source, target.checkpoint
    with engine.switch_lock:  # one switch at a time; requests keep running meanwhile
        began = time.perf_counter()
        model_config, tokenizer = checkpoint_model(architecture)
        changed = _architecture_change(engine.model_config, model_config)
        if changed:
            raise BadInputError(f"{source} has another architecture ({', '.join(changed)} differ); a switch "
                                "keeps the engine's KV cache, so start a new engine for it.")
        # Weights built from a delta have no checkpoint on disk to compute their key from: the named daemon's key
        # is taken once its config, plan and format are the lineage checkpoint's (a trusted attach).
        options = msgspec.structs.replace(engine.attach_options, fallback=False, daemon=daemon, wait_s=0.0,
                                          trust_daemon=target.lineage is not None)
        try:
            with DigestStore.open() as store:
                attached = attach_with(architecture, engine.attach_plan, options, device=engine.device, store=store)
        except AttachMissError as miss:
            append_event(_run_dir(engine), ev.SwitchRefused(engine_pid=os.getpid(), source=str(source),
                                                            key_id=engine.served.key_id, reason=miss.report.reason))
            raise SwitchMissError(f"still serving {engine.served.key_id}, no switch to {source}: "
                                  f"{miss.report.reason}") from None
        try:
            model = Transformer(model_config, attached.tensors, engine.tp)
            if model.dtype != engine.model.dtype:
                raise BadInputError(f"{source} attaches as {model.dtype}, not the engine's {engine.model.dtype}; "
                                    "start a new engine for it.")
        except BaseException:
            attached.close()
            raise
        previous = engine.served
        current = ServedWeights(source, attached.key_file.key, target.lineage)
        replaced = engine.install(model, tokenizer, current, attached)
        if replaced is not None:
            replaced.close()  # CPU views stay valid while referenced; no request references them any more
        seconds = time.perf_counter() - began
    append_event(_run_dir(engine), ev.EngineSwitch(engine_pid=os.getpid(), source=str(source),
                                                   previous_key_id=previous.key_id, key_id=current.key_id,
                                                   daemon=attached.report.daemon, seconds=round(seconds, 3)))
    return SwitchResult(previous, current, attached.report, seconds)
