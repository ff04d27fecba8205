"""The end of `wcache demo`: leave a daemon and a served engine running for `wcache top`, and stop them later."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from wcache.daemon.launch import start_daemons
from wcache.daemon.stopping import stop_daemon, terminate_started
from wcache.ipc.http.client import http_request
from wcache.ipc.interpreter import python_module_argv
from wcache.ipc.run_dir.directory import census, ensure_run_dir
from wcache.ipc.run_dir.engines import read_engine_descriptor
from wcache.ipc.run_dir.paths import RunPaths

from wcache_cli.output import out

STATE_NAME = "serving.json"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
SHARED_PREFIX = (
    "wcache demo: every request in this workload starts with the same long system prompt, so the engine's "
    "prefix cache hits and SWA bounded replay rebuilds the sliding windows. "
)
TAILS = ("What is a weight cache?", "Why hash every byte?", "How does replay work?", "Who holds the lease?",
         "When does a miss happen?", "Where do events go?")


def _wait_for_engine(run_dir: Path, process: subprocess.Popen[bytes]) -> str:
    descriptor = RunPaths(run_dir).engine(process.pid)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the served engine exited with code {process.returncode}")
        if descriptor.exists() and (url := read_engine_descriptor(descriptor).url) is not None:
            return url  # the reference engine's server always announces its URL
        time.sleep(0.2)
    raise RuntimeError("the served engine did not come up in time")


def _complete(url: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    status, answer = http_request(f"{url}/v1/completions", method="POST", body=body,
                                  headers={"Content-Type": "application/json"}, timeout=60)
    if status != 200 or answer is None:
        raise RuntimeError(f"the served engine at {url} answered {status or 'nothing'} to a completion")
    return dict(json.loads(answer))


def leave_serving(original: Path, modified: Path, workdir: Path, run_dir: Path) -> None:
    """Preload `original`, serve it, run a shared-prefix workload and one forced fallback; record the pids."""
    from wcache.attach import attach
    from wcache.plan.spec import PlanSpec

    ensure_run_dir(run_dir)
    group = start_daemons(original, run_dir=run_dir)
    group.detach()  # the daemon outlives this command
    state: dict[str, Any] = {"run_dir": str(run_dir), "daemons": group.names, "supervisor_pid": group.supervisor.pid}
    (workdir / STATE_NAME).write_text(json.dumps(state))
    with (workdir / "engine.log").open("ab") as log:
        engine = subprocess.Popen(
            python_module_argv("wcache_cli.main", "attach", str(original), "--serve", "--port", "0", "--run-dir",
                               str(run_dir)),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    state["engine_pid"] = engine.pid
    (workdir / STATE_NAME).write_text(json.dumps(state))
    url = _wait_for_engine(run_dir, engine)
    state["engine_url"] = url
    (workdir / STATE_NAME).write_text(json.dumps(state))

    hits = 0
    for tail in TAILS:
        hits += int(_complete(url, SHARED_PREFIX + tail)["wcache"]["adopted"])
    out.print(f"served {len(TAILS)} requests sharing a {len(SHARED_PREFIX)}-token prefix at {url}: "
              f"{hits} reused the cached prefix (with bounded replay)")
    # One engine that misses, so the dashboard's event feed has a fallback with its reason and diff.
    with attach(modified, PlanSpec(), run_dir=run_dir) as missed:
        out.print(f"and one engine for the zeroed copy fell back to disk: {missed.report.reason}")


def stop_serving(workdir: Path) -> bool:
    """Stop what an earlier demo left running from `workdir`; False when there was nothing recorded."""
    path = workdir / STATE_NAME
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    engine_pid = state.get("engine_pid")
    if isinstance(engine_pid, int):
        terminate_started(engine_pid, marker="--serve", timeout_s=STOP_TIMEOUT_S)
    run_dir = Path(state["run_dir"])
    if run_dir.exists():
        for descriptor in census(run_dir).live:
            if descriptor.name in state.get("daemons", []):
                stop_daemon(descriptor, force=True)
    supervisor_pid = state.get("supervisor_pid")
    if isinstance(supervisor_pid, int):
        terminate_started(supervisor_pid, marker="wcache.daemon.supervisor", timeout_s=STOP_TIMEOUT_S)
    path.unlink()
    return True
