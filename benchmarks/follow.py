"""Engines follow: a served reference engine with ``--follow`` answering on the version a training loop publishes.

In one run, on the ``--preset`` checkpoint (qwen3-0.6b: 1.5 GB bf16, fused plan, TP 1):

* ``wcache preload N`` holds N; ``wcache attach N --serve --follow`` serves it.
* N+1 is N after a simulated training step (``--fraction``, 1.5%, of every tensor's elements moved), held in this
  process as tensors; ``publish(N, changes)`` gets each tensor's changed elements as (flat indices, values).
  Timed: the publish call (to the new daemon READY), then from its return until ``GET /v1/weights`` names N+1's
  key, and until a one-token completion answers with ``weights_key`` = N+1's key (target ≤ 1 s).
* The engine's greedy tokens (16, from a fixed prompt of token ids) against an engine loading N+1 from disk
  (N+1's tensors written as a checkpoint): equal, or the run fails.
* What a publish is weighed against: three cold preloads of N+1 written as a checkpoint (each in a run dir and
  digest store of its own; the files written back first, in the page cache), their median.
* Then ``--steps`` steps of a loop (publish, follow, generate, stop the version left behind, which must need no
  ``--force``: the engine released its lease): each step moves the same ``--fraction`` of every tensor's elements
  again (by 1/16), handed to publish as (indices, values) from the version published last, which has no file of
  its own: its parent's process built it from a delta in memory. Each step's follow time, the engine's RSS and
  USS, the live daemons' RSS and the number of arenas (distinct ``memfd:wcache-arena`` inodes mapped or held by the
  engine and the daemons), first step against last.

Run::

    .venv/bin/python benchmarks/follow.py                          # qwen3-0.6b, 1.5%, 20 loop steps
    .venv/bin/python benchmarks/follow.py --preset small --steps 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from bench_common import fmt_seconds, stop_preloaded, timed_preload, wcache_command, workspace
from restart import our_leftovers
from wcache.daemon.publish import publish
from wcache.ipc.run_dir.directory import census
from wcache_dev.synth import read_tensors, training_step, write_checkpoint, write_tensors

PROMPT_IDS = [11, 257, 1024, 3000, 42, 7, 99, 512]  # taken modulo the vocabulary
PROMPT: list[int] = []
GREEDY_TOKENS = 16
SERVING = re.compile(r"SERVING (http://127\.0\.0\.1:\d+)/v1/completions")
POLL_S = 0.005
FULL_PRELOADS = 3  # cold preloads of N+1 a publish is weighed against (their median)
# How often the memfds are counted: a delta lives for a third of a second, and each count reads the engine's and
# the daemons' /proc maps (a few ms of this process's time, beside the publish it measures).
SAMPLE_S = 0.05


def sparse_changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, object]:
    """Each changed tensor as (flat int64 indices, values): what a trainer holding both would hand to publish."""
    changes: dict[str, object] = {}
    for name, new in after.items():
        old = before[name]
        bits = {2: torch.int16, 4: torch.int32}[new.element_size()]
        where = (new.reshape(-1).view(bits) != old.reshape(-1).view(bits)).nonzero().reshape(-1)
        if where.numel():
            changes[name] = (where, new.reshape(-1)[where].clone())
    return changes


def changed_bytes(changes: dict[str, object]) -> int:
    total = 0
    for value in changes.values():
        assert isinstance(value, tuple)
        total += value[1].numel() * value[1].element_size()
    return total


class MemfdPeak:
    """The most memory held at once in wcache's memfds (arenas, the pool's, a delta in flight): the pages allocated
    to each distinct one the given processes hold open or map, sampled every SAMPLE_S on a thread while inside
    ``with``; what made up the peak (bytes by memfd name, deltas apart), and the largest delta seen."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.peak = 0
        self.at_peak: list[tuple[str, int]] = []
        self.largest_delta = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            held = list(_memfds(self.pids(), "memfd:wcache-").values())
            self.largest_delta = max([self.largest_delta, *(n for name, n in held if name == "wcache-delta")])
            if sum(n for _, n in held) > self.peak:
                self.peak, self.at_peak = sum(n for _, n in held), sorted(held)

    def __enter__(self) -> MemfdPeak:
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return dict(json.loads(response.read()))


def _complete(url: str, max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def _follow(url: str, key_id: str, timeout: float = 60.0) -> tuple[float, float]:
    """Seconds until /v1/weights names `key_id`, and until a one-token completion runs on it."""
    began = time.perf_counter()
    while _get(f"{url}/v1/weights")["key_id"] != key_id:
        if time.perf_counter() - began > timeout:
            raise SystemExit(f"the engine did not follow to {key_id} in {timeout:.0f} s")
        time.sleep(POLL_S)
    switched = time.perf_counter() - began
    while _complete(url, 1)["wcache"]["weights_key"] != key_id:
        pass
    return switched, time.perf_counter() - began


def _serve(cli: list[str], model: Path, run_dir: Path, env: dict[str, str],
           log: Path) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([*cli, "attach", str(model), "--serve", "--follow", "--port", "0", "--run-dir",
                                str(run_dir)], stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env,
                               stdin=subprocess.DEVNULL)
    assert process.stdout is not None
    for line in process.stdout:
        if (match := SERVING.search(line)) is not None:
            return process, match.group(1)
    raise SystemExit(f"the engine exited {process.wait()}: {log.read_text()[-2000:]}")


MEMFD = re.compile(r"memfd:(wcache-[a-z-]+)")


def _memfds(pids: list[int], named: str) -> dict[int, tuple[str, int]]:
    """The memfds whose name starts `named` that the processes hold open or map: inode → (name, bytes: the pages
    allocated to one held open, the map of one only mapped)."""
    held: dict[int, tuple[str, int]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    found = MEMFD.search(str(fd.readlink()))
                    if found and found.group(0).startswith(named):
                        info = fd.stat()
                        held[info.st_ino] = (found.group(1), info.st_blocks * 512)
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                found = MEMFD.search(line)
                if found and found.group(0).startswith(named):
                    fields = line.split()
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    held.setdefault(int(fields[4]), (found.group(1), end - start))
    return held


def arenas_held(pids: list[int]) -> int:
    """Distinct arena memfds the processes map or hold open."""
    return len(_memfds(pids, "memfd:wcache-arena"))


def _memory(engine: psutil.Process, run_dir: Path) -> dict[str, int]:
    daemons = sorted({d.pid for d in census(run_dir, clean=False).live})  # versions hosted by one process count once
    info = engine.memory_full_info()
    daemon_rss = 0
    for pid in daemons:
        with contextlib.suppress(psutil.Error):
            daemon_rss += psutil.Process(pid).memory_info().rss
    return {"engine_rss": info.rss, "engine_uss": info.uss, "engine_anon": _anonymous([engine.pid]),
            "daemon_rss": daemon_rss, "daemon_anon": _anonymous(daemons), "daemons": len(daemons),
            "arenas": arenas_held([engine.pid, *daemons])}


def _anonymous(pids: list[int]) -> int:
    """The processes' own memory (RssAnon), apart from the arenas' shared pages their maps have touched: RSS has
    both, and USS counts an arena page as the engine's own while no other process maps it."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, AttributeError):
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
    return total


def _full_preloads(cli: list[str], env: dict[str, str], work: Path, spawned: list[psutil.Process]) -> list[float]:
    """Seconds to READY of FULL_PRELOADS preloads of N+1 (``work/n1``), each cold (a run dir and digest store of its
    own, as N+1's key is served in the benchmark's), its files in the page cache and written back first: what a
    publish is weighed against, without the checkpoint's writeback competing with the first of them."""
    os.sync()
    seconds: list[float] = []
    for i in range(FULL_PRELOADS):
        run_dir, store = work / f"run-full-{i}", work / f"store-full-{i}"
        for owned in (run_dir, store):
            shutil.rmtree(owned, ignore_errors=True)
        apart = {**env, "WCACHE_RUN_DIR": str(run_dir), "WCACHE_CACHE_DIR": str(store)}
        took, full = timed_preload([*cli, "preload", str(work / "n1"), "--detach", "--json"], apart, run_dir,
                                   spawned)
        stop_version(cli, full["ranks"][0]["name"], apart)
        seconds.append(took)
    return seconds


def stop_version(cli: list[str], name: str, env: dict[str, str]) -> None:
    done = subprocess.run([*cli, "stop", name], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"`wcache stop {name}` (no --force) failed: {done.stderr.strip()}")


def step_options(description: str, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The options of a benchmark of publish steps: the checkpoint, the share changed, the steps, a work dir."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--fraction", type=float, default=0.015, help="share of every tensor's elements changed")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--version-pool", default="0", help="preload N with this --version-pool (e.g. 2GiB)")
    return parser


@dataclass(frozen=True)
class StepWorkspace:
    """Where a benchmark of publish steps runs: its run dir, digest store, checkpoint N (and N's config.json), and
    the environment pointing at the first two."""

    run_dir: Path
    store: Path
    parent: Path
    config: dict[str, Any]
    env: dict[str, str]


def step_workspace(work: Path, preset: str, *scratch: str, **env: str) -> StepWorkspace:
    """The workspace in `work`: the run dir, store and `scratch` paths cleared, this process's environment pointed at
    them too (publish, called here, reads the same store), N written as the `preset` checkpoint unless it is there."""
    run_dir, store = work / "run", work / "store"
    for owned in (run_dir, store, *(work / name for name in scratch)):
        shutil.rmtree(owned, ignore_errors=True)
    environment = {**os.environ, "WCACHE_RUN_DIR": str(run_dir), "WCACHE_CACHE_DIR": str(store), **env}
    os.environ.update(environment)
    parent = work / "n"
    if not parent.exists():
        print(f"writing the {preset!r} checkpoint ...", file=sys.stderr)
        write_checkpoint(preset, parent)
    return StepWorkspace(run_dir, store, parent, json.loads((parent / "config.json").read_text()), environment)


def main(argv: list[str] | None = None) -> int:
    args = step_options(__doc__.splitlines()[0], 20, "publish-follow-generate loop steps").parse_args(argv)
    cli = wcache_command()
    began = time.perf_counter()
    with workspace(args.workdir) as work:
        place = step_workspace(work, args.preset, "n1")
        run_dir, env, parent, config = place.run_dir, place.env, place.parent, place.config
        PROMPT[:] = [i % int(config["vocab_size"]) for i in PROMPT_IDS]
        spawned: list[psutil.Process] = []
        engine_process: subprocess.Popen[str] | None = None
        engine_pid: list[int] = []
        shmem = MemfdPeak(lambda: [os.getpid(), *engine_pid, *{d.pid for d in census(run_dir, clean=False).live}])
        try:
            _, ready = timed_preload([*cli, "preload", str(parent), "--detach", "--json", "--version-pool",
                                      args.version_pool], env, run_dir, spawned)
            current = ready["ranks"][0]["name"]
            arena_bytes = int(ready["ranks"][0]["weights_bytes"])
            engine_process, url = _serve(cli, parent, run_dir, env, work / "engine.err")
            engine = psutil.Process(engine_process.pid)
            engine_pid.append(engine.pid)
            tensors = read_tensors(parent)
            stepped = training_step(tensors, args.fraction, seed=1)
            changes = sparse_changes(tensors, stepped)
            with shmem:
                t = time.perf_counter()
                published = publish(current, changes, run_dir=run_dir)
                publish_s = time.perf_counter() - t
                switched_s, answered_s = _follow(url, published.key.short_id)
                served = _complete(url, GREEDY_TOKENS)["choices"][0]["token_ids"]
                stop_version(cli, current, env)
            current = published.daemons[0]
            write_tensors(stepped, config, work / "n1", 1)
            del tensors
            full_preloads_s = _full_preloads(cli, env, work, spawned)
            full_preload_s = statistics.median(full_preloads_s)
            from wcache.engine.engine import Engine

            disk = Engine.from_disk(work / "n1")
            on_disk = disk.generate(PROMPT, GREEDY_TOKENS).token_ids
            disk.close()
            del disk
            shutil.rmtree(work / "n1")
            steps: list[dict[str, Any]] = []
            for _ in range(args.steps):
                # The elements N+1 moved, moved again by 1/16 (more than a bf16 ulp), from the version published
                # last: `stepped` follows each step so the next one's values are the parent's plus a change.
                step_changes: dict[str, object] = {}
                for name, change in changes.items():
                    assert isinstance(change, tuple)
                    flat = stepped[name].reshape(-1)
                    flat[change[0]] = (flat[change[0]].float() * (1 + 1 / 16)).to(flat.dtype)
                    step_changes[name] = (change[0], flat[change[0]].clone())
                with shmem:
                    t = time.perf_counter()
                    made = publish(current, step_changes, run_dir=run_dir)
                    step_publish_s = time.perf_counter() - t
                    step_switch_s, step_answer_s = _follow(url, made.key.short_id)
                    generated = _complete(url, 4)
                    assert generated["wcache"]["weights_key"] == made.key.short_id
                    stop_version(cli, current, env)
                current = made.daemons[0]
                steps.append({"publish_s": step_publish_s, "switch_s": step_switch_s, "answer_s": step_answer_s,
                              "written": made.bytes_written, **_memory(engine, run_dir)})
        finally:
            if engine_process is not None:
                engine_process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    engine_process.wait(30)
            spawned.extend(p for p in our_leftovers(run_dir) if p.pid != os.getpid())
            stop_preloaded(cli, run_dir, spawned)
    elapsed = time.perf_counter() - began
    changed = changed_bytes(changes)
    equal = served == on_disk
    print(f"N → N+1 on {args.preset} ({arena_bytes / 1e9:.2f} GB arena), {args.fraction:.1%} of every tensor's "
          f"elements ({len(changes)} tensors, {changed / 1e6:,.1f} MB of changed values), published from memory:")
    print(f"  publish call (to N+1 READY): {fmt_seconds(publish_s)}")
    print(f"  after it returned: /v1/weights on N+1 in {fmt_seconds(switched_s)}, a completion answered on N+1 in "
          f"{fmt_seconds(answered_s)} (target ≤ 1 s: {'met' if answered_s <= 1.0 else 'NOT met'}); "
          f"from the publish call's start {fmt_seconds(publish_s + answered_s)}")
    print(f"  greedy tokens ({GREEDY_TOKENS}) equal to a disk load of N+1: {'yes' if equal else 'NO'}")
    if steps:
        first, last = steps[0], steps[-1]

        def median(field: str) -> str:
            return fmt_seconds(statistics.median(s[field] for s in steps))

        print(f"loop of {len(steps)} steps (sparse steps, publish → follow → generate → stop the old version "
              f"without --force): median publish {median('publish_s')}, switch seen {median('switch_s')}, "
              f"answered {median('answer_s')} after publish returned (max "
              f"{fmt_seconds(max(s['answer_s'] for s in steps))})")
        warm = steps[1:] or steps  # the first step's pool holds no ancestor yet
        publish_median = statistics.median(s["publish_s"] for s in warm)
        print(f"  publish with the version pool ({args.version_pool}) warm: median {fmt_seconds(publish_median)} "
              f"(target ≤ 0.6 s: {'met' if publish_median <= 0.6 else 'NOT met'}); a full preload of N+1 in this "
              f"run, median of {len(full_preloads_s)} cold ones ("
              + ", ".join(fmt_seconds(s) for s in full_preloads_s) + f"), {fmt_seconds(full_preload_s)}: "
              f"{full_preload_s / publish_median:.1f}× (target ≥ 4×)")
        bound = 2 * arena_bytes + shmem.largest_delta
        print(f"  peak memory in memfds over the publishes and switches: {shmem.peak / 1e9:.3f} GB ("
              + " + ".join(f"{name} {n / 1e6:,.0f} MB" for name, n in shmem.at_peak)
              + f"; target ≤ 2 arenas + the delta, {bound / 1e9:.3f} GB: "
              f"{'met' if shmem.peak <= bound else 'NOT met'})")
        written = [s["written"] for s in warm if s["written"] is not None]
        if written:
            print(f"  bytes written per step: median {statistics.median(written) / changed:.2f}× the changed bytes, "
                  f"max {max(written) / changed:.2f}× (target ≤ 3× once the pool is warm)")
        for label, s in (("first step", first), ("last step", last)):
            print(f"  {label}: engine RSS {s['engine_rss'] / 1e6:,.0f} MB (USS {s['engine_uss'] / 1e6:,.0f} MB), "
                  f"{s['daemons']} daemon process(es) RSS {s['daemon_rss'] / 1e6:,.0f} MB (anonymous "
                  f"{s['daemon_anon'] / 1e6:,.0f} MB), {s['arenas']} arena(s)")
        marks = sorted({0, len(steps) // 4, len(steps) // 2, 3 * len(steps) // 4, len(steps) - 1})
        print("  engine USS by step: " + ", ".join(f"{i + 1}: {steps[i]['engine_uss'] / 1e6:,.0f} MB" for i in marks))
        print("  engine anonymous memory by step: " + ", ".join(
            f"{i + 1}: {steps[i]['engine_anon'] / 1e6:,.0f} MB" for i in marks))
        print("  daemons' anonymous memory by step: " + ", ".join(
            f"{i + 1}: {steps[i]['daemon_anon'] / 1e6:,.0f} MB" for i in marks))
        growth = last["engine_uss"] - first["engine_uss"]
        print(f"  engine USS growth first → last: {growth / 1e6:+,.1f} MB (anonymous "
              f"{(last['engine_anon'] - first['engine_anon']) / 1e6:+,.1f} MB); daemons' RSS "
              f"{(last['daemon_rss'] - first['daemon_rss']) / 1e6:+,.1f} MB, anonymous "
              f"{(last['daemon_anon'] - first['daemon_anon']) / 1e6:+,.1f} MB; arenas at the end: {last['arenas']}")
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, whole run {elapsed:.0f} s.")
    # The served version's arena, and a retired one the pool keeps when it has a budget.
    leaked = bool(steps) and steps[-1]["arenas"] != (1 if args.version_pool in ("0", "") else 2)
    return 0 if equal and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
