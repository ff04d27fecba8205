"""What an engine announces in `<run dir>/engines/<pid>.json`, so `wcache top` and `wcache status` show it.

The reference engine's server announces itself and removes the file when it stops; every vLLM rank that runs
the `wcache` load format (an offline `LLM` or a server's) announces itself too, hit or fallback. vLLM ends its
workers with signals, where nothing runs at exit, so a reader judges an announcement by its process: one whose
pid is gone, or was started after the announcement (a reused pid), is stale (`announcer_alive`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from wcache.ipc.attach_summary import AttachSummary
from wcache.ipc.run_dir.directory import Pid, process_created, process_exited, read_run_file, run_subdir
from wcache.ipc.run_dir.paths import RunPaths
from wcache.schema import Schema

# An announcement is a URL, a model name and an attach report: hundreds of bytes. Anything far larger is not one.
MAX_ANNOUNCEMENT_BYTES = 64 * 1024


# The engines that announce themselves: wcache's reference engine, and vLLM through the load format.
REFERENCE_ENGINE = "wcache"
VLLM_ENGINE = "vllm"
# A process's start time and the announcement's clock differ by rounding; a reused pid starts well after.
START_SLACK_S = 1.0


class EngineDescriptor(Schema, frozen=True):
    """One engine: where its API is, what it serves, and how its weights were attached."""

    pid: Pid
    url: str | None  # its HTTP API; None for an offline engine, or a server whose port is not known
    model: str
    source: str
    attach: AttachSummary | None  # how the engine attached its weights; None: it loaded them from disk
    key_id: str | None
    started: float
    engine: str = REFERENCE_ENGINE
    tp_rank: int = 0
    tp_size: int = 1
    follows: bool = False  # it moves to its weights' newest version by itself (`attach --serve --follow`,
    # `serve --follow`)


def announcer_alive(descriptor: EngineDescriptor) -> bool:
    """Whether the process that wrote `descriptor` still runs (in this pid namespace): not gone, not a new
    process that reuses its pid."""
    created = process_created(descriptor.pid)
    return created is not None and created <= descriptor.started + START_SLACK_S


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


def _announcements(run_dir: Path) -> Iterator[tuple[Path, EngineDescriptor]]:
    """Every readable announcement in the run dir, with its file."""
    directory = run_subdir(run_dir, RunPaths.ENGINES)  # a symlink there is refused: never read or remove through it
    for path in RunPaths.engine_files(directory) if directory is not None else []:
        try:
            yield path, read_engine_descriptor(path)
        except (OSError, ValueError):
            continue


def announced_at(run_dir: Path, url: str) -> list[EngineDescriptor]:
    """The live engines (each TP rank's) announced at `url`."""
    return [d for _, d in _announcements(run_dir) if d.url == url and announcer_alive(d) and not process_exited(d.pid)]


def remove_gone_announcements(run_dir: Path, url: str) -> list[int]:
    """Remove the announcements (and tokens) of engines at `url` whose process is gone; their pids.

    What `wcache serve` does once a server it supervised is stopped: its URL answers again for the next server,
    so a reader, which shows a gone announcer while its URL answers (it may live in another pid namespace),
    could not tell the dead ranks from their successors."""
    paths = RunPaths(run_dir)
    removed = []
    for path, descriptor in _announcements(run_dir):
        if descriptor.url == url and (not announcer_alive(descriptor) or process_exited(descriptor.pid)):
            path.unlink(missing_ok=True)
            paths.engine_token(descriptor.pid).unlink(missing_ok=True)
            removed.append(descriptor.pid)
    return removed
