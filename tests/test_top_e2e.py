"""End to end: `wcache top --json --once` over a real daemon, a real served engine under a shared-prefix
workload, and one forced fallback.

Everything runs inside a `daemon_rig` (a private /tmp run dir); the served engine carries the rig's path on
its command line, so the rig's sweep kills it even if this test's own cleanup is skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import queue
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from daemon_fixtures import (
    DaemonRig,
    copy_checkpoint,
    daemon_rig,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
)
from helpers import WCACHE
from wcache_dev.synth import overwrite_tensor_bytes

SERVE_TIMEOUT_S = 120.0
# A shared prefix of 220 bytes (the tiny checkpoint's tokenizer is bytes): several blocks and well past the
# 32-token sliding window, so later requests hit the prefix cache and replay the window.
PREFIX = ("wcache keeps processed weights alive across engine restarts; the prefix below is shared by every "
          "request so that the engine's prefix cache hits and sliding-window layers replay their window. ") * 2


@contextlib.contextmanager
def served_engine(rig: DaemonRig, model: Path) -> Iterator[str]:
    """`wcache attach MODEL --serve --port 0`; yields the base URL once it prints SERVING; always stops it."""
    process = subprocess.Popen(
        [*WCACHE, "attach", str(model), "--serve", "--port", "0",
         "--run-dir", str(rig.run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, **rig.env},
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            try:
                line = lines.get(timeout=SERVE_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"no SERVING line within {SERVE_TIMEOUT_S} s: {seen}") from None
            if line is None:
                raise AssertionError(f"the engine exited ({process.wait()}) before serving: {seen}")
            seen.append(line)
            if line.startswith("SERVING "):
                url = line.split()[1].removesuffix("/v1/completions")
                break
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(15)


def tui_in_a_terminal(rig: DaemonRig, expect: list[bytes], timeout: float = 60.0) -> tuple[bytes, int]:
    """Run the real `wcache top` in a 120x40 pseudo-terminal until the screen shows every `expect`, press q;
    returns what it drew and its exit status."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: become `wcache top` on the terminal, and never return into pytest
        try:
            os.environ.update({**rig.env, "TERM": "xterm-256color"})
            os.execv(sys.executable, [*WCACHE, "top", "--run-dir",
                                      str(rig.run_dir), "--interval", "0.5"])
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    screen = b""
    try:
        deadline = time.monotonic() + timeout
        while not all(e in screen for e in expect) and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):
                    screen += os.read(fd, 1 << 16)
        os.write(fd, b"q")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    os.read(fd, 1 << 16)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return screen, os.waitstatus_to_exitcode(status)
        raise AssertionError("wcache top did not exit on q")
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def complete(url: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_top_reports_daemon_engine_replay_hits_and_the_fallback(tiny_template: Path) -> None:
    with daemon_rig() as rig:
        model = copy_checkpoint(tiny_template, rig.base / "tiny")
        [daemon] = rig.preload(model)
        with served_engine(rig, model) as url:
            answers = [complete(url, f"{PREFIX}question {i}: what is cached?") for i in range(4)]
            assert [a["wcache"]["adopted"] for a in answers] == [False, True, True, True]

            # A copy with one tensor changed past its header: same shapes, different key: a miss, then disk.
            modified = copy_checkpoint(model, rig.base / "tiny-modified")
            overwrite_tensor_bytes(modified, "model.norm.weight", 0, bytes(64))
            fallback = rig.cli("attach", str(modified), "--run-dir", str(rig.run_dir))
            assert fallback.returncode == 0, fallback.stderr
            assert "FALLBACK" in fallback.stdout

            document = rig.cli("top", "--json", "--once", "--run-dir", str(rig.run_dir), "--interval", "0.3",
                               as_json=True)
            human = rig.cli("top", "--once", "--run-dir", str(rig.run_dir), "--interval", "0.1")
            expect = [daemon.key_id.encode(), b"fallback", b"Replay and prefix cache"]
            screen, code = tui_in_a_terminal(rig, expect)
            assert code == 0
            assert all(e in screen for e in expect), screen[-2000:]

        [d] = [d for d in document["daemons"] if d["name"] == daemon.name]
        assert d["alive"] and d["state"] == "ready" and d["key_id"] == daemon.key_id
        assert d["weights_bytes"] > 0 and d["health_status"] == 200 and d["model"] == "tiny"

        [engine] = [e for e in document["engines"] if e["url"] == url]
        assert engine["kind"] == "wcache" and engine["up"] and engine["model"] == "tiny"
        assert engine["weights"] == "hit" and engine["daemon"] == daemon.name and engine["attach_ms"] > 0
        assert engine["hit_rate_overall"] > 0
        assert engine["replayed_tokens_total"] > 0
        assert engine["adopted_hits_total"] == 3
        assert engine["prefill_saved_total"] > 0

        kinds = [e["kind"] for e in document["events"]]
        assert {"preload", "ready", "attach_hit", "attach_miss", "fallback"} <= set(kinds), kinds
        [fell] = [e for e in document["events"] if e["kind"] == "fallback"]
        assert fell["severity"] == "warning"
        assert fell["detail"]["source"] == str(modified)
        reason = fell["detail"]["reason"]
        assert "differs" in reason and reason in fell["summary"]
        [miss] = [e for e in document["events"] if e["kind"] == "attach_miss"]
        assert miss["detail"]["reason"] == reason
        assert "model.norm.weight" in miss["detail"]["diff"]["changed"]

        assert human.returncode == 0, human.stderr
        assert daemon.key_id in human.stdout and "fell back to disk" in human.stdout
        assert "model.norm.weight" in human.stdout  # the miss's key diff, under "Why"
