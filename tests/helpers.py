"""What the test modules share: running `wcache`, the one-error-sentence checks, and finding processes.

`wcache` has two runners. `wcache_process` starts the real process: for tests whose subject is the process
(daemons, signals, pipes, hangs a timeout must end, import cost, another uid, tracebacks a real interpreter
prints). `wcache_in_process` calls the same entry point, `wcache_cli.main.main()`, in this interpreter with
argv, environment and standard streams of its own, and turns its exit into the same `CompletedProcess`: for
tests whose subject is what the CLI says (argument checks, error sentences, exit codes, JSON). It runs
everything main() does (the typed-error sentence, the warning handler, --verbose tracebacks), which Typer's
`CliRunner.invoke` would skip, and starts nothing a real process would not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
from wcache.checkpoint.files import INDEX_NAME
from wcache.key.digest_store import RACY_WINDOW_NS

CLI_TIMEOUT_S = 120.0
# The tests that import vLLM into pytest's own process, from whichever module, on one pytest-xdist worker:
# an import costs a core ~7 s here, once per worker that makes it.
VLLM_IN_PYTEST = pytest.mark.xdist_group("vllm-in-pytest")
KILL_WAIT_S = 15.0
# `python -m wcache_cli.main`: the console script's own entry point, with this interpreter and sys.path.
WCACHE = [sys.executable, "-m", "wcache_cli.main"]

# An environment override: a value sets the variable, None removes it.
EnvOverrides = Mapping[str, str | None]


def cli_env(cache: Path | None = None) -> dict[str, str | None]:
    """Overrides for a `wcache` run whose output a test reads: no debug tracebacks, no colour, 200 columns,
    and `cache` (if given) as the digest store."""
    env: dict[str, str | None] = {"WCACHE_DEBUG": None, "NO_COLOR": "1", "COLUMNS": "200"}
    if cache is not None:
        env["WCACHE_CACHE_DIR"] = str(cache)
    return env


def environment(overrides: EnvOverrides | None) -> dict[str, str]:
    """This process's environment with `overrides` applied."""
    env = dict(os.environ)
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def wcache_process(*args: str, env: EnvOverrides | None = None, timeout: float = CLI_TIMEOUT_S,
                   cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`wcache ARGS` as a real process, stdin closed; TimeoutExpired after `timeout` (the process is killed)."""
    return subprocess.run([*WCACHE, *args], capture_output=True, text=True, env=environment(env), timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=cwd)


def wcache_in_process(*args: str, env: EnvOverrides | None = None) -> subprocess.CompletedProcess[str]:
    """`wcache ARGS` through `main()` in this interpreter: the exit status, stdout and stderr a process would
    give. An exception main() lets through is printed as a traceback with status 1, as the interpreter would."""
    from typer.testing import CliRunner
    from wcache_cli import main as entry
    from wcache_cli.output import out
    from wcache_cli.state import CliState, state

    logger = logging.getLogger("wcache")
    saved_handlers, saved_propagate = list(logger.handlers), logger.propagate
    saved_argv, saved_hook, saved_verbose = sys.argv, sys.excepthook, state.verbose
    with CliRunner().isolation(env=dict(env or {})) as (stdout, stderr, _):
        sys.argv = ["wcache", *args]
        state.verbose = CliState().verbose  # what a fresh process reads from WCACHE_DEBUG
        _forget_consoles(out)  # rich reads NO_COLOR, COLUMNS and the stream's kind when a console is made
        try:
            entry.main()
            code = 0
        except SystemExit as exc:
            code = _exit_status(exc.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            _forget_consoles(out)
            logger.handlers[:], logger.propagate = saved_handlers, saved_propagate
            sys.argv, sys.excepthook, state.verbose = saved_argv, saved_hook, saved_verbose
        return subprocess.CompletedProcess(["wcache", *args], code, stdout.getvalue().decode(),
                                           stderr.getvalue().decode(errors="backslashreplace"))


def _forget_consoles(out: object) -> None:
    for name in ("stdout", "stderr"):
        vars(out).pop(name, None)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): the interpreter prints it and exits 1
    return 1


def run_python(code: str, *args: str, env: EnvOverrides | None = None, timeout: float = 300,
               ) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet in a fresh interpreter (import costs, audit hooks, another process's view)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=environment(env), timeout=timeout, stdin=subprocess.DEVNULL)


# Records every imported module at exit (atexit runs after the SystemExit that Typer ends with).
_MODULES_PROBE = """
import atexit, json, sys
record = sys.argv[1]
def dump():
    with open(record, "w") as f:
        json.dump(sorted(sys.modules), f)
atexit.register(dump)
sys.argv = ["wcache", *sys.argv[2:]]
from wcache_cli.main import main
main()
"""


def modules_after_cli(scratch: Path, *args: str, env: EnvOverrides | None = None,
                      ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run `wcache ARGS` (the console script's entry point) in a fresh interpreter: its result, and every module
    it had imported when it exited (recorded in a file in the directory `scratch`)."""
    record = scratch / "modules.json"
    record.unlink(missing_ok=True)
    result = run_python(_MODULES_PROBE, str(record), *args, env={"NO_COLOR": "1", **(env or {})}, timeout=120)
    assert record.exists(), result.stderr
    return result, json.loads(record.read_text())


# What a light command never imports: the tensor stack and the dashboard's UI.
HEAVY = ("torch", "textual", "numpy", "safetensors")


def loaded_of(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    """The modules of `packages` (a package and its sub-modules) among `modules`."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def plant_wcache(where: Path, marker: Path) -> Path:
    """A new directory holding a `wcache/` package and a `wcache.py`, each appending to `marker` when imported:
    run from there, a child that puts the working directory on `sys.path` would run them."""
    where.mkdir()
    code = f"open({str(marker)!r}, 'a').write(__file__ + '\\n')\n"
    for package in (where / "wcache", where / "wcache" / "daemon", where / "wcache" / "integrations"):
        package.mkdir()
        (package / "__init__.py").write_text(code)
    (where / "wcache" / "daemon" / "__main__.py").write_text(code)
    (where / "wcache.py").write_text(code)
    return where


def wait_past_racy_window() -> None:
    """Sleep until files written now are old enough for their receipts to be trusted."""
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving_in_thread(server: ThreadingHTTPServer) -> Iterator[int]:
    """`server` answering from a thread of this process; its port. Shut and joined on the way out."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def edited_index(checkpoint: Path) -> Iterator[dict[str, Any]]:
    """A sharded checkpoint's index, to change in place: written back (compact JSON) on the way out."""
    index = json.loads((checkpoint / INDEX_NAME).read_text())
    yield index
    (checkpoint / INDEX_NAME).write_text(json.dumps(index))


@contextlib.contextmanager
def mounted_tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A fresh tmpfs at `where` with these mount options (-o), unmounted on the way out; mounting needs root."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.fail(f"this test mounts a tmpfs and needs root: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


# -- error sentences ------------------------------------------------------------------------------------


def one_sentence(stderr: str) -> str:
    """The single line on stderr, which ends a sentence; no traceback."""
    text = stderr.strip()
    assert text, "expected an error sentence on stderr"
    assert "\n" not in text, f"expected one line on stderr, got: {stderr!r}"
    assert "Traceback" not in text
    assert text.endswith("."), text
    return text


def assert_one_error_sentence(result: subprocess.CompletedProcess[str], *names: str) -> str:
    """Exit 2, nothing on stdout, one non-empty stderr line "error: … ." naming every one of `names`."""
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, everything
    assert result.returncode == 2, everything
    assert result.stdout == "", everything
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error:"), line
    assert line.rstrip().endswith("."), line
    for name in names:
        assert name in line, (name, line)
    return line


# -- processes ------------------------------------------------------------------------------------------


def cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def processes_mentioning(*markers: str) -> list[psutil.Process]:
    """Live (non-zombie) processes other than this one whose command line contains any of `markers`."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        line = cmdline(process)
        if any(marker in line for marker in markers):
            found.append(process)
    return found


def kill_and_wait(processes: list[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL each process and wait for it; returns those still alive (not even zombies) afterwards."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    # A killed process whose parent has not reaped it yet is a zombie: dead, holding nothing. (PID 1 may reap
    # orphans only now and then, so waiting for the pid to vanish could take long.)
    deadline = time.monotonic() + KILL_WAIT_S
    alive = [p for p in processes if is_running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if is_running(p)]
    for process in processes:
        with contextlib.suppress(psutil.Error, ChildProcessError):
            os.waitpid(process.pid, os.WNOHANG)  # reap it if it happens to be our child
    return alive


def is_running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# A version's tensors, rank by rank, against a disk load of checkpoint argv[2] under the same plan (a script for
# `DaemonRig.python`: argv[2:7] are the checkpoint, the TP size, dtype, quantization and run dir); prints each
# rank's daemon.
SAME_AS_DISK = """
import sys
from pathlib import Path
import torch
from wcache.attach import attach
from wcache.key.compute import compute_key
from wcache.load.loader import load_from_disk
from wcache.plan.spec import PlanSpec
model, tp, dtype, quantization, run_dir = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
for rank in range(tp):
    spec = PlanSpec(tp_size=tp, tp_rank=rank, dtype=dtype, quantization=quantization)
    with attach(model, spec, fallback=False, run_dir=Path(run_dir)) as weights:
        disk = load_from_disk(compute_key(model, spec), model)
        assert weights.report.outcome == "hit", weights.report
        assert set(disk) == set(weights.tensors)
        for name, tensor in disk.items():
            assert torch.equal(tensor.view(torch.uint8), weights.tensors[name].view(torch.uint8)), name
        print(weights.report.daemon)
"""
