"""`wcache top` polling cost: 16 daemons and 16 engines at 2 Hz must stay under 5% of one core.

The run:

1. writes 16 `tiny` checkpoints with seeds 0..15 (16 distinct keys) and preloads each (`wcache preload
   --detach`, 16 real daemons, each with its supervisor's /health) into a private run dir;
2. serves 16 fake engine `/metrics` endpoints from threads of this process, in vLLM's format (prefix-cache
   counters per DP engine with `_created` samples, gauges and histograms) with counters that advance on every
   scrape;
3. runs `wcache top --json --interval 0.5 --count N --scrape URL ×16 --run-dir R` as a separate process and
   reads its lines; after `--warmup` lines it samples the process's CPU time (psutil, user + system, all
   threads) and again `--samples` lines later (about 20 s at 2 Hz). CPU % of one core = CPU seconds / wall
   seconds over that window, so start-up (imports) is excluded and reported on its own line.

It also reports what the polling costs the daemons and supervisors (answering `stats` and `/health`), and
exits 1 if the target is missed or a line does not show all 16 daemons alive and 16 engines up. Everything
it starts is stopped and its directory removed, however it ends.

Run::

    .venv/bin/python benchmarks/top_cpu.py                    # 16 + 16 at 2 Hz, 40 samples (~1 min)
    .venv/bin/python benchmarks/top_cpu.py --samples 80       # a longer window
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table
from wcache.ipc.http.server import PROMETHEUS_TEXT, QuietHandler, make_http_server
from wcache_dev.synth import write_checkpoint

TARGET_PERCENT = 5.0
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_prompt_tokens", "request_generation_tokens")
BUCKETS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5",
           "5.0", "7.5", "10.0", "+Inf")
console = Console(highlight=False)


def vllm_metrics(n: int, model: str, dp: int = 2) -> str:
    """vLLM-format /metrics at scrape `n`: what PrometheusStatLogger exports, prefix counters advancing."""
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{sample}{{{labels}}} {value!r}" for sample, labels, value in samples)

    engines = [f'engine="{e}",model_name="{model}"' for e in range(dp)]
    created = 1.7949504e9
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        family(f"vllm:{gauge}", "gauge", gauge.replace("_", " "), [(f"vllm:{gauge}", lab, 1.0) for lab in engines])
    for counter, per_scrape in (("prefix_cache_queries", 1000), ("prefix_cache_hits", 700), ("prompt_tokens", 1000),
                                ("generation_tokens", 250), ("num_preemptions", 0), ("request_success", 4)):
        name = f"vllm:{counter}"
        family(f"{name}_total", "counter", counter.replace("_", " "),
               [(f"{name}_total", lab, float(per_scrape * n + 10 * e)) for e, lab in enumerate(engines)])
        family(f"{name}_created", "gauge", counter.replace("_", " "), [(f"{name}_created", lab, created)
                                                                        for lab in engines])
    for histogram in HISTOGRAMS:
        name = f"vllm:{histogram}"
        samples = []
        for lab in engines:
            samples += [(f"{name}_bucket", f'{lab},le="{le}"', float(n * i)) for i, le in enumerate(BUCKETS)]
            samples += [(f"{name}_count", lab, float(n * len(BUCKETS))), (f"{name}_sum", lab, n * 0.5),
                        (f"{name}_created", lab, created)]
        family(name, "histogram", histogram.replace("_", " "), samples)
    return "\n".join(lines) + "\n"


class FakeEngines:
    """`count` /metrics endpoints on threads of this process; each scrape advances that engine's counters."""

    def __init__(self, count: int) -> None:
        self.servers: list[ThreadingHTTPServer] = []
        self.scrapes = [0] * count
        self.sizes: list[int] = []
        for index in range(count):
            self.servers.append(self._server(index))
        self.urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers]
        self.threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
                        for s in self.servers]

    def _server(self, index: int) -> ThreadingHTTPServer:
        owner = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                owner.scrapes[index] += 1
                body = vllm_metrics(owner.scrapes[index], f"model-{index}").encode()
                owner.sizes.append(len(body))
                self.send_body(200, PROMETHEUS_TEXT, body)

        return make_http_server("127.0.0.1", 0, Handler)

    def __enter__(self) -> FakeEngines:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def wcache(*args: str, env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "wcache_cli.main", *args], env={**os.environ, **env},
                            stdin=subprocess.DEVNULL, text=True, **kwargs)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def ours(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and marker in " ".join(process.info["cmdline"] or ()):
                found.append(process)
    return found


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="wc-topcpu-", dir="/tmp"))
    try:
        yield base
    finally:
        env = {"WCACHE_CACHE_DIR": str(base / "cache")}
        with contextlib.suppress(Exception):
            subprocess.run([sys.executable, "-m", "wcache_cli.main", "stop", "--all", "--force", "--run-dir",
                            str(base / "r")], env={**os.environ, **env}, capture_output=True, timeout=60)
        left = ours(str(base))
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)
        shutil.rmtree(base, ignore_errors=True)


def measure_tui(args: list[str], env: dict[str, str], warmup_s: float, window_s: float) -> tuple[float, float]:
    """The interactive dashboard in a 120x40 pseudo-terminal (output drained): its CPU seconds over a window."""
    pid, fd = pty.fork()
    if pid == 0:
        try:
            os.environ.update({**env, "TERM": "xterm-256color"})
            os.execv(sys.executable, [sys.executable, "-m", "wcache_cli.main", *args])
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    watched = psutil.Process(pid)

    def drain(seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        while (left := deadline - time.perf_counter()) > 0:
            if select.select([fd], [], [], min(left, 0.1))[0]:
                with contextlib.suppress(OSError):
                    os.read(fd, 1 << 16)

    try:
        drain(warmup_s)
        t0, cpu0 = time.perf_counter(), cpu_seconds(watched)
        drain(window_s)
        t1, cpu1 = time.perf_counter(), cpu_seconds(watched)
        os.write(fd, b"q")
        drain(1.0)
        return cpu1 - cpu0, t1 - t0
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def preload_all(base: Path, run_dir: Path, env: dict[str, str], count: int) -> float:
    began = time.perf_counter()
    models = [write_checkpoint("tiny", base / f"tiny-{i:02d}", seed=i) for i in range(count)]
    launched = [wcache("preload", str(m), "--detach", "--run-dir", str(run_dir), env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE) for m in models]
    for model, process in zip(models, launched, strict=True):
        _, stderr = process.communicate(timeout=300)
        if process.returncode != 0:
            raise SystemExit(f"preload of {model} failed ({process.returncode}): {stderr.strip()}")
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--daemons", type=int, default=16)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls (0.5 = 2 Hz)")
    parser.add_argument("--warmup", type=int, default=3, help="lines before the measured window")
    parser.add_argument("--samples", type=int, default=40, help="lines in the measured window")
    args = parser.parse_args()

    with workspace() as base, FakeEngines(args.engines) as engines:
        run_dir = base / "r"
        run_dir.mkdir(mode=0o700)
        env = {"WCACHE_CACHE_DIR": str(base / "cache"), "WCACHE_RUN_DIR": str(run_dir)}
        preload_s = preload_all(base, run_dir, env, args.daemons)
        daemons = [p for p in ours(str(run_dir)) if "wcache.daemon" in " ".join(p.cmdline())]

        command = ["top", "--json", "--interval", f"{args.interval:g}", "--count", "100000",
                   "--run-dir", str(run_dir)]
        shown = " ".join(["wcache", *command, "--scrape", engines.urls[0], "...", f"(×{len(engines.urls)})"])
        for url in engines.urls:
            command += ["--scrape", url]
        console.print(f"command: {shown}", soft_wrap=True)
        started = time.perf_counter()
        top = wcache(*command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=1)
        watched = psutil.Process(top.pid)
        assert top.stdout is not None
        bad: list[str] = []
        t0 = cpu0 = daemons0 = 0.0
        startup_cpu = startup_s = 0.0
        try:
            for number in range(1, args.warmup + args.samples + 1):
                line = top.stdout.readline()
                if not line:
                    error = top.stderr.read() if top.stderr else ""
                    raise SystemExit(f"wcache top exited early ({top.wait()}): {error}")
                document = json.loads(line)
                alive = sum(1 for d in document["daemons"] if d["alive"])
                up = sum(1 for e in document["engines"] if e["up"] and e["hit_rate_interval"] is not None)
                if alive != args.daemons or up != args.engines:
                    bad.append(f"line {number}: {alive} daemons alive, {up} engines up with a rate")
                if number == 1:
                    startup_s, startup_cpu = time.perf_counter() - started, cpu_seconds(watched)
                if number == args.warmup:
                    t0, cpu0 = time.perf_counter(), cpu_seconds(watched)
                    daemons0 = sum(cpu_seconds(d) for d in daemons)
            t1, cpu1 = time.perf_counter(), cpu_seconds(watched)
            daemons1 = sum(cpu_seconds(d) for d in daemons)
        finally:
            top.kill()
            top.wait(10)
        tui_args = [c for c in command if c not in ("--json", "--count", "100000")]
        tui_cpu, tui_wall = measure_tui(tui_args, env, warmup_s=3.0, window_s=args.samples * args.interval)

    wall = t1 - t0
    percent = (cpu1 - cpu0) / wall * 100
    daemon_percent = (daemons1 - daemons0) / wall * 100
    table = Table(title=f"wcache top: {args.daemons} daemons + {args.engines} engines, every {args.interval:g} s "
                        f"({1 / args.interval:g} Hz)", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("measured window", f"{wall:.1f} s, {args.samples} polls")
    table.add_row("wcache top CPU", f"{cpu1 - cpu0:.3f} s")
    table.add_row("[bold]wcache top CPU, % of one core[/]", f"[bold]{percent:.2f} %[/]")
    table.add_row("CPU per poll", f"{(cpu1 - cpu0) / args.samples * 1000:.1f} ms")
    table.add_row("start-up to first line (not in the window)", f"{startup_s:.2f} s wall, {startup_cpu:.2f} s CPU")
    table.add_row("daemons + supervisors answering stats and /health", f"{daemon_percent:.2f} % of one core")
    table.add_row("the interactive dashboard (Textual, 120x40 pty), same polling",
                  f"{tui_cpu / tui_wall * 100:.2f} % of one core")
    table.add_row("/metrics text per scrape", f"{sum(engines.sizes) / max(1, len(engines.sizes)) / 1024:.1f} KiB")
    table.add_row(f"preloading the {args.daemons} daemons (setup)", f"{preload_s:.1f} s")
    load = os.getloadavg()
    table.add_row("machine load average (1, 5 min) / cores", f"{load[0]:.1f}, {load[1]:.1f} / {os.cpu_count()}")
    console.print(table)
    ok = percent < TARGET_PERCENT and not bad
    for problem in bad[:5]:
        console.print(f"[red]{problem}[/]")
    verdict = "[green]PASS[/]" if ok else "[red]FAIL[/]"
    console.print(f"target: under {TARGET_PERCENT:g} % of one core: {percent:.2f} % {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
