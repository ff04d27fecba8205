"""What every step of one attach shares, and the collector pause around the steps that build many objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from wcache.attach_options import AttachOptions
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import HashProgress
from wcache.plan.spec import PlanSpec


@dataclass(frozen=True, slots=True)
class AttachContext:
    """What every step of one attach shares."""

    model: Path
    plan: PlanSpec
    options: AttachOptions
    device: str
    store: DigestStore | None
    progress: HashProgress | None
    run_dir: Path
    began: float
    dp_size: int
    engine: str
    views: bool  # False: report only; nothing is mapped and no tensor made


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a key or a map builds its objects, as it was again after.

    Both build several objects per tensor (receipts, manifest entries, reply lists, views), none of them in a
    cycle, so reference counting frees what is dropped. Left on, the collector runs a full collection whenever
    enough of them outlive two young ones: ~100 ms over the ~170k objects a process holds once torch is
    imported, in about every second attach of 11k tensors.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
