"""Where one `publish` spends its time: each phase of publishing N+1, then each loop step, on the same change.

In one run, on the ``--preset`` checkpoint (qwen3-0.6b: 1.5 GB bf16, fused plan, TP 1): N is started with
`start_daemons` (with ``--version-pool``), N+1 is N after ``--fraction`` (1.5%) of every tensor's elements moved,
handed to `publish` as (flat indices, values); each of publish's steps is timed in this process (the changes
checked; where the parent's process builds the version, the sealed delta written and the parent's build; else the
parent mapped and the changed tensors hashed, the delta file written and `start_next_version`), and the new rank's
own build time (``load_s`` of its ready event), which splits `start_next_version` into the build and the
processes' start. Each further step publishes the same elements moved again, from the version published last,
``--gap`` seconds (a training step's compute: the retired arena is brought forward meanwhile) after stopping the one
before.

Last, the in-place publish's floor on this machine, in the same run: the two passes a build cannot skip, on the
step's own tensors in this process, on every core as the daemon runs them (largest tensor first): BLAKE3 of every
tensor the step touches (a step that moves 1.5% of random elements touches every 1 KiB chunk, so no chunk's digest
can be kept), the scatter of the step's elements, and both per tensor; plus the publishing process's own steps as
measured (the changes checked, the sealed delta written). The loop's median publish is printed against it.

Run::

    .venv/bin/python benchmarks/publish_phases.py --steps 3 --version-pool 2GiB --workdir DIR
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import torch
from bench_common import workspace
from follow import sparse_changes, step_options, step_workspace
from wcache.daemon import publish as publishing
from wcache.daemon.launch import start_daemons
from wcache.daemon.stopping import stop_daemons
from wcache.ipc.run_dir.directory import census
from wcache.monitor.event_types import Ready
from wcache.monitor.events import read_typed_events
from wcache_cli.byte_size import parse_byte_size
from wcache_dev.synth import read_tensors, training_step

FLOOR_REPEAT = 3  # runs of each floor pass; their median is printed

# publish's steps, in the order it takes them: the in-place build (sealed_delta, then the parent's build) or, where
# new processes build the version, the digests, the delta file and their start.
PHASES = ("_change", "sealed_delta", "_build_in_place", "_new_digests", "write_delta", "start_next_version")


def _timed(spent: dict[str, float], name: str) -> None:
    """Wrap publish's step `name` so each call adds its seconds to `spent[name]`."""
    inner: Callable[..., Any] = getattr(publishing, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - began

    setattr(publishing, name, timed)


def _build_seconds(run_dir: Path, daemon: str) -> float:
    """The build time daemon `daemon` reported in its ready event."""
    return next(float(e.load_s or 0.0) for e in read_typed_events(run_dir)
                if isinstance(e, Ready) and e.daemon == daemon)


def _floor_passes(tensors: Mapping[str, torch.Tensor], step: Mapping[str, object]) -> dict[str, float]:
    """Seconds (median of FLOOR_REPEAT) of each pass an in-place build makes over the tensors `step` changes, on
    every core, largest tensor first: BLAKE3 alone, the scatter of `step`'s elements alone (writing the values
    `tensors` already hold), and both per tensor, hashed while its bytes are in the cache."""
    arrays = {}
    for name, change in step.items():
        assert isinstance(change, tuple)
        indices, values = change
        flat = tensors[name].reshape(-1).view({2: torch.int16, 4: torch.int32}[tensors[name].element_size()])
        arrays[name] = (flat.numpy(), indices.numpy(), values.view(flat.dtype).numpy())
    names = sorted(arrays, key=lambda name: -arrays[name][0].nbytes)

    def hash_one(name: str) -> None:
        blake3.blake3(memoryview(arrays[name][0]).cast("B")).hexdigest()

    def scatter_one(name: str) -> None:
        target, indices, values = arrays[name]
        target[indices] = values

    def both(name: str) -> None:
        scatter_one(name)
        hash_one(name)

    seconds: dict[str, float] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as workers:
        for label, one in (("hash", hash_one), ("scatter", scatter_one), ("both", both)):
            runs = []
            for _ in range(FLOOR_REPEAT):
                began = time.perf_counter()
                list(workers.map(one, names))
                runs.append(time.perf_counter() - began)
            seconds[label] = statistics.median(runs)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = step_options(__doc__.splitlines()[0], 2, "loop steps after N+1")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds from a stop to the next publish")
    args = parser.parse_args(argv)
    spent: dict[str, float] = {}
    for name in PHASES:
        _timed(spent, name)
    with workspace(args.workdir) as work:
        place = step_workspace(work, args.preset)
        run_dir, parent = place.run_dir, place.parent
        began = time.perf_counter()
        group = start_daemons(parent, run_dir=run_dir,
                              version_pool=parse_byte_size(args.version_pool, "--version-pool"))
        group.detach()
        print(f"preload of N: {time.perf_counter() - began:.3f} s")
        current = group.names[0]
        try:
            tensors = read_tensors(parent)
            stepped = training_step(tensors, args.fraction, seed=1)
            changes = sparse_changes(tensors, stepped)
            del tensors
            step = changes
            client: list[float] = []  # the publishing process's own steps, in place: changes checked, delta written
            publishes: list[float] = []
            for i in range(args.steps + 1):
                spent.clear()
                began = time.perf_counter()
                published = publishing.publish(current, step, run_dir=run_dir)
                total = time.perf_counter() - began
                build = _build_seconds(run_dir, published.daemons[0])
                # A version the parent's process builds (`version_host`) starts no process: no start_next_version.
                how = (f"processes' start and READY {spent['start_next_version'] - build:.3f}"
                       if "start_next_version" in spent else "in the parent's process")
                if i and "start_next_version" not in spent:
                    publishes.append(total)
                    client.append(spent.get("_change", 0.0) + spent.get("sealed_delta", 0.0))
                print(f"publish {i} (to READY): {total:.3f} s = " + ", ".join(
                    f"{name.strip('_')} {spent.get(name, 0.0):.3f}" for name in PHASES)
                    + f" (build {build:.3f}, {how})")
                stop_daemons([d for d in census(run_dir).live if d.name == current])
                time.sleep(args.gap)
                current = published.daemons[0]
                step = {}
                for name, change in changes.items():
                    assert isinstance(change, tuple)
                    flat = stepped[name].reshape(-1)
                    flat[change[0]] = (flat[change[0]].float() * (1 + 1 / 16)).to(flat.dtype)
                    step[name] = (change[0], flat[change[0]].clone())
        finally:
            stop_daemons(census(run_dir).live, force=True)
        if publishes:
            floor = _floor_passes(stepped, step)
            least = statistics.median(client) + floor["both"]
            print(f"floor of an in-place publish here: the publishing process {statistics.median(client):.3f} s "
                  f"+ scatter and BLAKE3 per tensor {floor['both']:.3f} s (BLAKE3 alone {floor['hash']:.3f}, the "
                  f"scatter alone {floor['scatter']:.3f}, on {os.cpu_count()} cores) = {least:.3f} s; the loop's "
                  f"median publish {statistics.median(publishes):.3f} s is {statistics.median(publishes) / least:.2f}× "
                  f"it, and ≥ 4× would need a full preload of at least {4 * least:.3f} s.")
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
