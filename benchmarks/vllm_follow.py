"""A served vLLM following the versions a training loop publishes (``wcache serve --follow``): its in-place reload.

In one run, on the ``--preset`` checkpoint (qwen3-0.6b: 1.5 GB bf16), TP 1, CPU:

* ``wcache serve N --follow --version-pool SIZE -- --host 127.0.0.1 ...`` serves N from the daemon it starts.
* Each of ``--steps`` steps is a simulated training step (``--fraction``, 1.5%, of every tensor's elements moved)
  published from memory as (flat indices, values) with ``publish(parent, changes)``. Timed: the publish call (to the
  new version READY), then from its return until the server's rank 0 announces the new key (the launcher paused
  vLLM, which reloaded in place), and until a one-token completion answered after that. vLLM's reload itself is the
  launcher's ``switch_ms`` (pause, reload, prefix-cache reset, resume), read from its log line.
* The last version's greedy tokens (16) against vLLM's own loader reading that version's tensors from disk, in the
  same server (``wcache_dev.vllm_disk_reload``): equal, or the run fails.
* Then ``--alternate`` rounds of a switch back to the last version's daemon (``wcache switch URL --daemon D``'s)
  and that disk reload, one after the other: the steps' reloads are the server's first and the disk reload above
  its last, and an engine's first reloads run slower.

The reload is vLLM's: on CPU it re-runs its oneDNN repack of every linear layer, whatever the daemon gives it.

Run (vLLM's CPU build; other vLLM runs wait on the lock)::

    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_follow.py --version-pool 2GiB --steps 4
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
from bench_common import fmt_seconds, stop_preloaded, wcache_command, workspace
from follow import (
    PROMPT_IDS,
    arenas_held,
    changed_bytes,
    sparse_changes,
    step_options,
    step_workspace,
    stop_version,
)
from restart import our_leftovers
from vllm_restart import free_port
from wcache.daemon.publish import publish
from wcache.ipc.run_dir.directory import census
from wcache.ipc.run_dir.engine_token import TOKEN_FILE_ENV, read_token_file
from wcache.ipc.run_dir.paths import RunPaths
from wcache.serve.follow import served_key
from wcache.vllm_served import switch_served, vllm_version
from wcache_dev.synth import read_tensors, training_step, write_tensors
from wcache_dev.vllm_disk_reload import reload_from_disk

PROMPT: list[int] = []  # follow.py's prompt ids, modulo the vocabulary: the synthetic tokenizers encode few words
GREEDY_TOKENS = 16
SERVED_NAME = "followed"
READY_S = 900.0
# Each look reads every engine announcement and checks its process: at follow.py's 5 ms it would take a core from
# the reload it times. The launcher itself looks every 50 ms.
POLL_S = 0.05
RELOADED = re.compile(r"→ (\w+) \(daemon \S+\): vLLM reloaded in place in ([\d.]+) s")


def _complete(url: str, max_tokens: int) -> list[int]:
    body = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return list(json.loads(response.read())["choices"][0]["token_ids"])
    except urllib.error.HTTPError as exc:
        said = exc.read().decode(errors="replace")
        raise SystemExit(f"the server refused a completion ({exc.code}): {said}") from None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _serve(cli: list[str], model: Path, run_dir: Path, env: dict[str, str], log: Path,
           version_pool: str) -> tuple[Any, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        process = subprocess.Popen(
            [*cli, "serve", str(model), "--follow", "--version-pool", version_pool, "--run-dir", str(run_dir), "--",
             "--host", "127.0.0.1", "--port",
             str(port), "--enforce-eager", "--max-model-len", "512", "--served-model-name", SERVED_NAME],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    began = time.monotonic()
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() - began > READY_S:
            raise SystemExit(f"wcache serve did not serve: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    print(f"served at {url} in {time.monotonic() - began:.1f} s", file=sys.stderr)
    return process, url


def _followed(run_dir: Path, url: str, key_id: str, log: Path, timeout: float = 300.0) -> tuple[float, float]:
    """Seconds until the server's rank 0 announces `key_id`, and vLLM's reload time as the launcher logged it."""
    began = time.perf_counter()
    while served_key(run_dir, url) != key_id:
        if time.perf_counter() - began > timeout:
            raise SystemExit(f"the server did not follow to {key_id} in {timeout:.0f} s: {log.read_text()[-2000:]}")
        time.sleep(POLL_S)
    announced = time.perf_counter() - began
    while not (reloads := {m.group(1): float(m.group(2)) for m in RELOADED.finditer(log.read_text())}).get(key_id):
        time.sleep(POLL_S)
    return announced, reloads[key_id]


def main(argv: list[str] | None = None) -> int:
    parser = step_options(__doc__.splitlines()[0], 3, "publish steps the server follows")
    parser.add_argument("--alternate", type=int, default=3,
                        help="rounds of a switch back to the last version's daemon and a disk reload, alternately")
    args = parser.parse_args(argv)
    cli = wcache_command()
    began = time.perf_counter()
    with workspace(args.workdir) as work:
        place = step_workspace(work, args.preset, "last", VLLM_CPU_KVCACHE_SPACE="1")
        run_dir, env, parent, config = place.run_dir, place.env, place.parent, place.config
        PROMPT[:] = [i % int(config["vocab_size"]) for i in PROMPT_IDS]
        log = work / "serve.log"
        server: Any = None
        steps: list[dict[str, float]] = []
        alternate: dict[str, list[float]] = {"daemon": [], "disk": []}
        arenas = 0
        try:
            server, url = _serve(cli, parent, run_dir, env, log, args.version_pool)
            [current] = [d.name for d in census(run_dir).live]
            before = _complete(url, GREEDY_TOKENS)
            tensors = read_tensors(parent)
            for step in range(args.steps):
                stepped = training_step(tensors, args.fraction, seed=step + 1)
                changes = sparse_changes(tensors, stepped)
                t = time.perf_counter()
                made = publish(current, changes, run_dir=run_dir)
                publish_s = time.perf_counter() - t
                announced_s, reload_s = _followed(run_dir, url, made.key.short_id, log)
                _complete(url, 1)
                answered_s = time.perf_counter() - t - publish_s
                steps.append({"publish_s": publish_s, "announced_s": announced_s, "reload_s": reload_s,
                              "answered_s": answered_s, "changed": changed_bytes(changes)})
                # The version left behind goes, as a loop's does (N too: the launcher's leases moved with the server).
                stop_version(cli, current, env)
                current, tensors = made.daemons[0], stepped
            arenas = arenas_held(sorted({d.pid for d in census(run_dir).live}))
            followed = _complete(url, GREEDY_TOKENS)
            write_tensors(tensors, config, work / "last", 1)
            token_file = RunPaths(run_dir).engine_token(server.pid)
            t = time.perf_counter()
            reload_from_disk(url, work / "last", read_token_file(token_file))
            disk_reload_s = time.perf_counter() - t
            on_disk = _complete(url, GREEDY_TOKENS)
            # The steps' reloads were the server's first ones, the disk reload above its last: alternately now,
            # each side after the other, so neither pays for an engine that has not reloaded yet.
            os.environ[TOKEN_FILE_ENV] = str(token_file)  # the switch's development routes take the token
            for _ in range(args.alternate):
                switched = switch_served(url, vllm_version(url), None, current)
                alternate["daemon"].append(switched["switch_ms"] / 1000)
                t = time.perf_counter()
                reload_from_disk(url, work / "last", read_token_file(token_file))
                alternate["disk"].append(time.perf_counter() - t)
        finally:
            if server is not None:
                server.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.wait(120)
            leftovers = [p for p in our_leftovers(run_dir) if p.pid != os.getpid()]
            for line in stop_preloaded(cli, run_dir, leftovers):
                print(line, file=sys.stderr)
    equal = followed == on_disk
    print(f"A served vLLM ({args.preset}, TP 1, CPU) following {len(steps)} versions, each {args.fraction:.1%} of "
          f"every tensor's elements ({statistics.median(s['changed'] for s in steps) / 1e6:,.1f} MB of changed "
          "values), published from memory:")
    for field, what in (("publish_s", "publish call (to the version READY)"),
                        ("announced_s", "after it returned: the server's rank 0 on the new key"),
                        ("answered_s", "after it returned: a one-token completion answered on it"),
                        ("reload_s", "of which vLLM's in-place reload (pause, reload, reset, resume)")):
        values = [s[field] for s in steps]
        print(f"  {what}: median {fmt_seconds(statistics.median(values))} "
              f"({', '.join(fmt_seconds(v) for v in values)})")
    print(f"  arenas the daemons hold after the last step, every version left behind stopped (N too): {arenas} "
          "(the version served and the pool's)")
    print(f"  the same server reloading the last version from disk with vLLM's own loader: "
          f"{fmt_seconds(disk_reload_s)}")
    if alternate["daemon"]:
        daemon_s, disk_s = statistics.median(alternate["daemon"]), statistics.median(alternate["disk"])
        print(f"  then alternately, {args.alternate} rounds: the switch back to the last version's daemon median "
              f"{fmt_seconds(daemon_s)} ({', '.join(fmt_seconds(v) for v in alternate['daemon'])}), the disk "
              f"reload median {fmt_seconds(disk_s)} ({', '.join(fmt_seconds(v) for v in alternate['disk'])}): "
              f"{daemon_s / disk_s:.2f}×")
    print(f"  greedy tokens ({GREEDY_TOKENS}) equal to vLLM's disk load of the last version: "
          f"{'yes' if equal else 'NO'}; they changed from N's: {'yes' if followed != before else 'no'}")
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, whole run {time.perf_counter() - began:.0f} s.")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
