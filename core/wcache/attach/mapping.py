"""One daemon that holds our key: hello, then map (or copy) its arena, or the reason it refused."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from wcache.attach.context import AttachContext
from wcache.errors import UnavailableError
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.run_dir.remote_key import daemon_key_file
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import Hello, HelloReply, Manifest, MapMode, MapRequest, Release, WantedKey
from wcache.key.cache_key import KeyFile

if TYPE_CHECKING:
    # torch, and the modules that make tensors, are imported where tensors are made: an attach that only
    # reports (`wcache attach` without --prompt/--serve) never loads torch.
    import torch

    from wcache.ipc.arenas.engine_side import MappedArena


@dataclass(frozen=True, slots=True)
class Mapped:
    """A daemon's tensors in this process, and what they were made from."""

    tensors: dict[str, torch.Tensor]
    mapping: MappedArena | None
    key_file: KeyFile
    total_bytes: int
    num_tensors: int
    timings_ms: dict[str, float]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a daemon that holds our key did not serve it."""

    reason: str
    mismatched: tuple[str, ...] = ()


def try_map(connection: DaemonConnection, descriptor: DaemonDescriptor, wanted: WantedKey,
            local: KeyFile | None, ctx: AttachContext) -> Mapped | Refusal:
    """Hello, then map (or copy) this daemon's arena; a refusal closes the connection."""
    mode = cast(MapMode, ctx.options.mode)
    t = time.perf_counter()
    try:
        hello = connection.request(Hello.mine(wanted, ctx.dp_size))
        if hello.status != "hit":
            connection.close()
            return Refusal(refusal_reason(descriptor, hello), hello.mismatched)
        key_file = local if local is not None else daemon_key_file(descriptor, connection.request(Manifest()).tensors)
        reply = connection.request(MapRequest(mode))
    except DaemonError as exc:
        connection.close()
        return Refusal(str(exc).rstrip("."))
    entries = reply.entries  # wire lists, viewed as they are: no object per tensor in between
    timings: dict[str, float] = {}
    mapping: MappedArena | None = None
    tensors: dict[str, torch.Tensor] = {}
    if reply.kind == "memfd":
        if len(reply.fds) != 1:
            connection.close()
            raise UnavailableError(f"daemon {descriptor.name} sent no arena descriptor.")
        if ctx.views:
            from wcache.ipc.arenas.engine_side import map_cpu_arena

            mapping = map_cpu_arena(reply.fds[0], reply.total_bytes, entries)
            tensors = mapping.tensors
        else:  # only a report: what mapping would check first, and nothing mapped
            from wcache.ipc.arenas.engine_side import check_arena_size

            try:
                check_arena_size(reply.fds[0], reply.total_bytes)
            finally:
                os.close(reply.fds[0])
    elif ctx.views:
        import torch

        from wcache.ipc.arenas.engine_side import open_cuda_handle, views_from_wire

        if reply.cuda is None:
            connection.close()
            raise UnavailableError(f"daemon {descriptor.name} sent no CUDA handle.")
        block = open_cuda_handle(reply.cuda.to_wire(), torch.device(descriptor.device).index or 0)
        tensors = views_from_wire(block, entries)
    timings["map"] = (time.perf_counter() - t) * 1000
    if mode == "copy":
        t = time.perf_counter()
        if mapping is None:  # CUDA: the engine's own device memory
            tensors = {name: tensor.clone() for name, tensor in tensors.items()}
        # On CPU the map is already the engine's own copy without copying a byte: it is MAP_PRIVATE (a write
        # lands in a private page) and keeps the memfd's pages alive after the daemon lets go of them, so the
        # daemon can release and the weights stay in memory once, now the engine's.
        timings["copy"] = (time.perf_counter() - t) * 1000
        if ctx.views:  # a report (`wcache attach --mode copy` alone) takes no weights: the daemon keeps them
            with contextlib.suppress(DaemonError):
                connection.request(Release())
        connection.close()
    return Mapped(tensors, mapping, key_file, reply.total_bytes, len(entries), timings)


def refusal_reason(descriptor: DaemonDescriptor, hello: HelloReply) -> str:
    """Why a daemon with our key answered hello with something other than a hit."""
    released = hello.daemon.released
    if hello.status == "corrupt":
        found = "; ".join(hello.corrupt or ())
        return f"the daemon {descriptor.name} found its weights changed in memory ({found}) and refuses new attaches"
    if hello.status == "released" and released is not None:
        return (f"the daemon {descriptor.name} released its weights to a copy-mode engine "
                f"(pid {released.client_pid}) at {released.at}")
    return f"the daemon {descriptor.name} answered {hello.status}"
