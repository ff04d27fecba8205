"""What a serving engine announces in `<run dir>/engines/<pid>.json`, so `wcache top` can find and scrape it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from wcache.ipc.attach_summary import AttachSummary
from wcache.ipc.run_dir.directory import Pid, read_run_file
from wcache.ipc.run_dir.paths import RunPaths
from wcache.schema import Schema

# An announcement is a URL, a model name and an attach report: hundreds of bytes. Anything far larger is not one.
MAX_ANNOUNCEMENT_BYTES = 64 * 1024


class EngineDescriptor(Schema, frozen=True):
    """One serving engine: where its API is, what it serves, and how its weights were attached."""

    pid: Pid
    url: str
    model: str
    source: str
    attach: AttachSummary | None  # how the engine attached its weights; None: it loaded them from disk
    key_id: str | None
    started: float


def write_engine_descriptor(run_dir: Path, descriptor: EngineDescriptor) -> Path:
    """Announce an engine (atomically: a temporary file, then a rename); again after a switch."""
    paths = RunPaths(run_dir)
    paths.engines.mkdir(mode=0o700, exist_ok=True)
    path = paths.engine(descriptor.pid)
    temporary = path.with_suffix(f".tmp-{os.getpid()}")
    temporary.write_text(json.dumps(descriptor.to_wire()))
    temporary.replace(path)
    return path


def read_engine_descriptor(path: Path) -> EngineDescriptor:
    """One announcement; OSError or ValueError (SchemaError) when it cannot be read or is not one."""
    return EngineDescriptor.from_wire(read_run_file(path, MAX_ANNOUNCEMENT_BYTES))
