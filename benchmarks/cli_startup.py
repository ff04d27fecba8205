"""Wall time of short `wcache` commands next to the interpreter's own start-up (`python -c pass`, the floor).

Each command runs as a real process through the installed `wcache` console script, output discarded (as in a
script or a probe), `--runs` times, round-robin so machine noise spreads over all of them; the median is shown
with its ratio to the floor's median. `key` is warm: the tiny checkpoint's receipts are in a scratch digest
store before timing starts. `status (daemon)` asks a real daemon of the tiny checkpoint, started (in its own run
dir) before timing and stopped after. `attach --no-fallback` finds no daemon and exits 3: the cost of a miss that
needs no tensors. Target (issues 11 and 30): `--help`, both `status` rows and warm `key` within 150 ms.
`serve (typo)` is `wcache serve MODEL -- --max-model-lenn 5` refused by the check against vLLM's saved option table
(built by the warm-up run, where vLLM is installed; the row is left out where it is not). Target (issue 31): within
2 s, against the 7-15 s of importing vLLM's own parser.

Bytecode is cached as in any installed copy (compiled files go to a scratch PYTHONPYCACHEPREFIX, even where the
environment sets PYTHONDONTWRITEBYTECODE); `--no-bytecode-cache` compiles every wcache module on every run.

`--against REV` times each wcache command a second time, round-robin with the first, under the `core/` and `cli/`
of git revision REV (exported to the scratch dir and put first on PYTHONPATH): a before/after in one run, on
one machine load. The daemon both ask is this tree's.

Run::

    .venv/bin/python benchmarks/cli_startup.py
    .venv/bin/python benchmarks/cli_startup.py --runs 15
    .venv/bin/python benchmarks/cli_startup.py --runs 9 --against HEAD~1
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_MS = 150.0
TARGETS_MS = {"wcache --help": TARGET_MS, "wcache status": TARGET_MS, "wcache status (daemon)": TARGET_MS,
              "wcache key (warm)": TARGET_MS, "wcache serve (typo)": 2000.0}


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time_once(argv: list[str], env: dict[str, str], codes: tuple[int, ...]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; CPU time moves less than wall time on a busy machine."""
    cpu, began = _cpu_of_children(), time.perf_counter()
    result = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, check=False)
    wall, cpu = time.perf_counter() - began, _cpu_of_children() - cpu
    if result.returncode not in codes:
        raise SystemExit(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.decode(errors='replace')}")
    return wall, cpu


def _sample(args: argparse.Namespace, env: dict[str, str], python: str, wcache: str, run_dir: Path,
            daemon_run_dir: Path, model: Path) -> dict[str, list[tuple[float, float]]]:
    """Each command's (wall, CPU) seconds, `--runs` of them, after one warm-up run each."""
    from wcache.key.digest_store import RACY_WINDOW_NS

    root = run_dir.parent
    if args.no_bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")  # compiled once by the warm-up, never in the tree
    commands: dict[str, tuple[list[str], tuple[int, ...]]] = {
        "python -c pass (floor)": ([python, "-c", "pass"], (0,)),
        "wcache --help": ([wcache, "--help"], (0,)),
        "wcache status": ([wcache, "status", "--run-dir", str(run_dir)], (0,)),
        "wcache status (daemon)": ([wcache, "status", "--run-dir", str(daemon_run_dir)], (0,)),
        "wcache key (warm)": ([wcache, "key", str(model)], (0,)),
        "wcache attach --no-fallback (miss)": ([wcache, "attach", str(model), "--no-fallback"], (3,)),
    }
    from wcache.integrations.vllm.version import version_problem

    if version_problem() is None:
        commands["wcache serve (typo)"] = ([wcache, "serve", str(model), "--", "--max-model-lenn", "5"], (2,))
    envs: dict[str, dict[str, str]] = {}  # a command's environment where it is not `env` (--against)
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.1)  # receipts of files changed this recently are never trusted
    for argv, codes in commands.values():  # warm-up: fills the digest store and the page cache
        _time_once(argv, env, codes)
    shown = subprocess.run(commands["wcache key (warm)"][0], env=env, capture_output=True, text=True, check=True)
    if ", 0 hashed" not in shown.stdout:
        raise SystemExit(f"`wcache key` still hashes after the warm-up:\n{shown.stdout}")
    if args.against:
        against = {**env, "PYTHONPATH": os.pathsep.join(str(root / "against" / part) for part in ("core", "cli"))}
        for name, (argv, codes) in list(commands.items()):
            if argv[0] == wcache:
                commands[f"{name} [{args.against}]"] = (argv, codes)
                envs[f"{name} [{args.against}]"] = against
        for name, (argv, codes) in commands.items():
            if name in envs:
                _time_once(argv, envs[name], codes)  # its warm-up
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, (argv, codes) in commands.items():
            samples[name].append(_time_once(argv, envs.get(name, env), codes))
    return samples


def _export(revision: str, dest: Path) -> None:
    """This repository's core/ and cli/ as of git `revision`, written under `dest`."""
    repo = Path(__file__).resolve().parents[1]
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", revision, "core", "cli"], capture_output=True,
                             check=False)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {revision} failed: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each command (default 7)")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="recompile wcache's modules on every run (as under PYTHONDONTWRITEBYTECODE=1)")
    parser.add_argument("--against", metavar="REV",
                        help="also time each wcache command under git revision REV's core/ and cli/ (before/after)")
    args = parser.parse_args()

    import wcache
    from wcache_dev import synth

    python = sys.executable
    wcache_script = str(Path(python).with_name("wcache"))
    with tempfile.TemporaryDirectory(prefix="wcache-cli-startup-") as tmp:
        root = Path(tmp)
        run_dir = root / "run"
        run_dir.mkdir(mode=0o700)
        daemon_run_dir = root / "run-daemon"
        daemon_run_dir.mkdir(mode=0o700)
        if args.against:
            _export(args.against, root / "against")
        model = root / "tiny"
        synth.write_checkpoint("tiny", model)
        env = {**os.environ, "WCACHE_CACHE_DIR": str(root / "cache"), "WCACHE_RUN_DIR": str(run_dir)}
        os.environ["WCACHE_CACHE_DIR"] = env["WCACHE_CACHE_DIR"]  # the daemon's receipts stay in the scratch store
        group = wcache.start_daemons(model, run_dir=daemon_run_dir)
        try:
            samples = _sample(args, env, python, wcache_script, run_dir, daemon_run_dir, model)
        finally:
            group.stop()
    walls = {name: statistics.median(w for w, _ in runs) * 1000 for name, runs in samples.items()}
    cpus = {name: statistics.median(c for _, c in runs) * 1000 for name, runs in samples.items()}
    floor = walls["python -c pass (floor)"]
    cache = "recompiled every run" if args.no_bytecode_cache else "bytecode cached"
    print(f"median of {args.runs} runs each ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"Python {sys.version.split()[0]}, {cache})")
    width = max(map(len, walls))
    print(f"{'command':<{width}} {'wall':>10} {'× floor':>8} {'CPU':>10}  target (wall)")
    for name, ms in walls.items():
        target = TARGETS_MS.get(name.split(" [")[0])
        verdict = ("ok" if ms <= target else "OVER") + f" (≤ {target:.0f} ms)" if target is not None else ""
        print(f"{name:<{width}} {ms:>7.1f} ms {ms / floor:>7.1f}× {cpus[name]:>7.1f} ms  {verdict}")


if __name__ == "__main__":
    main()
