"""An engine's disk load: every output of a plan from one read of each tensor it needs, in tensors the caller
owns. Nothing is hashed and no arena is filled (that is the daemon's pass, `single_pass`)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from wcache.checkpoint.dtypes import TORCH_NAMES
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.ipc.arenas.engine_side import torch_dtype
from wcache.key.shard_hash import CHUNK_BYTES, OpenShard
from wcache.load.buffers import HELD_BYTES, BufferPool, as_buffer, typed
from wcache.load.schedule import Schedule, file_order
from wcache.plan.processing import ProcessingPlan

if TYPE_CHECKING:
    import torch


def read_outputs(plan: ProcessingPlan, shards: Sequence[OpenShard]) -> dict[str, torch.Tensor]:
    """Every output of `plan` from one read of each tensor it needs, in tensors the caller owns (a disk load)."""
    import torch

    schedule = Schedule(plan)
    outputs: dict[str, torch.Tensor] = {}
    held: dict[str, tuple[memoryview, torch.Tensor]] = {}  # tensor → (pooled buffer, typed view of it)
    users_left = {name: len(users) for name, users in schedule.computed.items()}
    pool = BufferPool(HELD_BYTES)
    workers = os.cpu_count() or 2
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wcache-read") as readers:
        for shard, tensor in file_order(shards):
            copies = schedule.copies.get(tensor.name, [])
            if tensor.name in schedule.computed:
                # A reused buffer: it lives only until the outputs computed from it are made.
                base = pool.take(tensor.nbytes)
                shard.read_into(tensor, 0, base[: tensor.nbytes])
                view = typed(base[: tensor.nbytes], tensor)
                held[tensor.name] = (base, view)
                for output in copies:
                    outputs[output.name] = view.clone()
                for output in schedule.arrived(tensor.name):
                    outputs[output.name] = plan.produce(output, lambda name: held[name][1])
                    for name in output.sources:
                        users_left[name] -= 1
                        if users_left[name] == 0:
                            pool.give(held.pop(name)[0])
            elif copies:
                # The engine owns these: the first copy is read straight into its own tensor, any other is a
                # clone (an engine may change one in place).
                data = torch.empty(tensor.nbytes, dtype=torch.uint8)
                _read_in_parts(shard, tensor, data, readers, workers)
                view = data.view(torch_dtype(TORCH_NAMES[tensor.dtype])).reshape(tensor.shape)
                for i, output in enumerate(copies):
                    outputs[output.name] = view if i == 0 else view.clone()
            # A tensor no output needs is not read: a disk load does not hash.
    pool.clear()
    return {o.name: outputs[o.name] for o in plan.outputs}


def _read_in_parts(shard: OpenShard, tensor: TensorInfo, data: torch.Tensor, readers: ThreadPoolExecutor,
                   workers: int) -> None:
    """Read a tensor into fresh memory a part per thread: the first touch of each page (a fault) is then paid
    by several cores at once, as a parallel copy would."""
    parts = max(1, min(workers, tensor.nbytes // CHUNK_BYTES))
    bounds = [tensor.nbytes * i // parts for i in range(parts + 1)]
    futures = [readers.submit(shard.read_into, tensor, lo, as_buffer(data[lo:hi]))
               for lo, hi in itertools.pairwise(bounds)]
    for future in futures:
        future.result()
