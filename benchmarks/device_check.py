"""The CUDA path, end to end, on one machine with nothing to download; prints one table.

Run through benchmarks/device_check.sh (it picks the interpreter and caps the time). Every step runs the real
CLI or the real attach API in its own process against a private run dir and digest store, on a checkpoint
written here (wcache_dev.synth). `--device cpu` runs the same steps on CPU (a dry run of the script itself).

Exit 0 when every PASS/FAIL check passed, 1 when one failed, 2 when this machine cannot run the check.
The kill -9 row is a finding, not a pass or a failure: does an engine's zero-copy mapping stay readable
after its daemon dies? (CPU: the memfd outlives it. CUDA: the question this script exists to answer.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STEP_TIMEOUT_S = 150.0
HOLDER_TIMEOUT_S = 90.0


@dataclass
class Row:
    check: str
    status: str  # PASS, FAIL or INFO
    result: str
    seconds: float


class Checks:
    """The table, filled step by step; a step that raises is a FAIL row with its reason, never a traceback."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        outcome: dict[str, Any] = {"status": "PASS", "result": ""}
        began = time.monotonic()
        try:
            yield outcome
        except Exception as exc:  # a step's failure is one row; the next steps still run
            outcome.update(status="FAIL", result=f"{type(exc).__name__}: {one_line(str(exc))}")
        self.rows.append(Row(name, outcome["status"], outcome["result"], time.monotonic() - began))

    def skip(self, name: str, why: str) -> None:
        self.rows.append(Row(name, "FAIL", f"not run: {why}", 0.0))

    def print(self, title: str) -> None:
        width = max(len(r.check) for r in self.rows)
        print(f"\n{title}")
        print(f"{'check'.ljust(width)}  status  {'s':>6}  result")
        for r in self.rows:
            print(f"{r.check.ljust(width)}  {r.status:<6}  {r.seconds:6.1f}  {r.result}")

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.rows)


def one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Rig:
    """A private run dir and digest store; every process started here is stopped at the end."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = Path(tempfile.mkdtemp(prefix="wcdev-", dir="/tmp"))  # AF_UNIX paths stay short
        self.run_dir = self.base / "run"
        self.env = {
            **os.environ, "WCACHE_RUN_DIR": str(self.run_dir), "WCACHE_CACHE_DIR": str(self.base / "cache"),
            "NO_COLOR": "1", "COLUMNS": "200",
            "PYTHONPATH": os.pathsep.join([str(REPO / "core"), str(REPO / "cli"), os.environ.get("PYTHONPATH", "")]),
        }
        self.holders: list[subprocess.Popen[str]] = []

    def cli(self, *args: str, timeout: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "wcache_cli.main", *args, "--run-dir", str(self.run_dir)],
                              capture_output=True, text=True, env=self.env, timeout=timeout, stdin=subprocess.DEVNULL)

    def cli_json(self, *args: str, ok_codes: tuple[int, ...] = (0,)) -> tuple[int, dict[str, Any]]:
        """Exit code and JSON document of `wcache ARGS --json`; another exit code is the step's failure."""
        result = self.cli(*args, "--json")
        if result.returncode not in ok_codes:
            detail = one_line(result.stderr or result.stdout)
            raise RuntimeError(f"wcache {args[0]} exited {result.returncode}: {detail}")
        return result.returncode, json.loads(result.stdout)

    def daemons(self) -> list[dict[str, Any]]:
        return self.cli_json("status")[1].get("daemons", [])

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted((self.run_dir / "logs").glob("*.log")))

    def close(self) -> None:
        for holder in self.holders:
            if holder.poll() is None:
                holder.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                holder.communicate(timeout=10)
        with contextlib.suppress(Exception):
            self.cli("stop", "--all", "--force", timeout=60)
        kill_mentioning(str(self.base))
        shutil.rmtree(self.base, ignore_errors=True)


def kill_mentioning(marker: str) -> None:
    """SIGKILL what is left of our processes: their command lines carry our private base path."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)


def http_code(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


# -- the steps ------------------------------------------------------------------------------------------------


def preload(rig: Rig, model: Path, checks: Checks, name: str) -> dict[str, Any] | None:
    ready: dict[str, Any] | None = None
    with checks.step(name) as row:
        _, ready = rig.cli_json("preload", str(model), "--device", rig.device, "--detach")
        ranks = ready["ranks"]
        row["result"] = (f"{len(ranks)} rank(s) ({', '.join(str(r.get('name')) for r in ranks)}), "
                         f"{sum(int(r.get('weights_bytes', 0)) for r in ranks)} bytes in {ready['seconds']:.2f} s")
    return ready


def attach(rig: Rig, model: Path, checks: Checks, mode: str) -> None:
    with checks.step(f"attach --mode {mode} --no-fallback") as row:
        _, report = rig.cli_json("attach", str(model), "--device", rig.device, "--mode", mode, "--no-fallback")
        if report["outcome"] != "hit":
            raise RuntimeError(f"{report['outcome']}: {report.get('reason')}")
        timings = {step: f"{ms:.1f} ms" for step, ms in report.get("timings_ms", {}).items() if step in ("map", "copy")}
        row["result"] = (f"hit, {report['num_tensors']} tensors, {report['bytes_mapped']} bytes, "
                         + ", ".join(f"{step} {ms}" for step, ms in timings.items()))


def verify(rig: Rig, model: Path, checks: Checks, how: str) -> None:
    with checks.step(f"verify {how}") as row:
        code, report = rig.cli_json("verify", str(model), how, "--device", rig.device, ok_codes=(0, 1))
        if code != 0:
            raise RuntimeError(f"differences: {one_line(json.dumps(report))}")
        row["result"] = one_line(summarize_verify(report))


def summarize_verify(report: dict[str, Any]) -> str:
    """One line from verify's JSON (tolerant of fields it lacks)."""
    if "content" in report:
        content = report["content"]
        arena, source = content.get("arena", {}), content.get("source", {})
        return (f"arena: {arena.get('checked', '?')} tensors re-hashed, {len(arena.get('changed', []))} changed; "
                f"checkpoint: {len(source.get('changed', []))} changed")
    greedy = report.get("greedy", {})
    prompts = greedy.get("prompts", [])
    attached = greedy.get("attach", {})
    return (f"{sum(bool(p.get('match')) for p in prompts)}/{len(prompts)} prompts match token for token; "
            f"cached side {attached.get('outcome')} {attached.get('mode')} on {attached.get('device')}")


def copy_release_then_stop(rig: Rig, model: Path, checks: Checks, health_url: str | None) -> None:
    attach(rig, model, checks, "copy")
    with checks.step("after copy release: alive, not ready") as row:
        (daemon,) = rig.daemons()
        codes = {p: http_code(f"{health_url}{p}") for p in ("/livez", "/readyz")} if health_url else {}
        row["result"] = f"state {daemon.get('state')}, " + ", ".join(f"{p} {c}" for p, c in codes.items())
        if daemon.get("state") != "released" or codes.get("/livez") != 200 or codes.get("/readyz") == 200:
            row["status"] = "FAIL"
    with checks.step("stop after copy release (clean exit)") as row:
        before = rig.daemons()
        pid = int(before[0]["pid"]) if before else None
        result = rig.cli("stop", "--all")
        if result.returncode != 0:
            raise RuntimeError(f"stop exited {result.returncode}: {one_line(result.stderr)}")
        if pid is not None and not wait_gone(pid):
            raise RuntimeError(f"daemon {pid} still runs after stop")
        logs = rig.logs()
        exits = re.findall(r"rank \d+ exited with code (-?\d+)", logs)
        if "Traceback" in logs or any(code != "0" for code in exits):
            tail = logs[logs.find("Traceback"):] if "Traceback" in logs else logs[-400:]
            raise RuntimeError(f"rank exit codes {exits or '?'}; {one_line(tail, 200)}")
        row["result"] = f"daemon exited cleanly (exit codes {', '.join(exits) or 'not logged'}), no traceback"


VLLM_PRESET = "small"  # bf16, head_dim 64 and a tokenizer: a checkpoint vLLM runs as it is
_BUILD_PEAK = re.compile(r"the build allocated at most ([\d.]+) MiB on the device")
_PRIVATE = re.compile(r"private memory grew by ([\d.]+) MiB")


def vllm_no_second_copy(rig: Rig, checks: Checks) -> None:
    """vLLM with load_format wcache on a hit: the parameters are the daemon's, the build allocates (almost) none.

    Before the meta-device build every parameter was allocated on the device and then replaced: the peak was
    the weights' size again. Now it is at most one parameter at a time plus what the daemon lacks.
    """
    name = f"vLLM load_format wcache: no second copy ({VLLM_PRESET})"
    try:
        import vllm  # noqa: F401
    except ImportError:
        checks.rows.append(Row(name, "INFO", "not run: vLLM is not importable with this interpreter "
                                             "(pip install 'wcache[vllm]')", 0.0))
        return
    from wcache.integrations.vllm.runner import VllmRun, greedy_tokens
    from wcache_dev.synth import write_checkpoint

    model = write_checkpoint(VLLM_PRESET, rig.base / f"vllm-{VLLM_PRESET}")
    ready = preload(rig, model, checks, f"preload --device {rig.device} ({VLLM_PRESET}, for vLLM)")
    if ready is None:
        checks.skip(name, "the preload failed")
        return
    weights_mib = sum(int(r.get("weights_bytes", 0)) for r in ready["ranks"]) / 2**20
    with checks.step(name) as row:
        os.environ.update(rig.env)  # greedy_tokens hands this process's environment (PYTHONPATH included) to vLLM
        result = greedy_tokens(VllmRun(str(model), ["the weights cache keeps"], 4, load_format="wcache",
                                       extra_config={"run_dir": str(rig.run_dir), "fallback": False}),
                               timeout=STEP_TIMEOUT_S)
        line = next((ln for ln in result.log.splitlines() if "wcache: weight cache hit" in ln), "")
        peak = _BUILD_PEAK.search(line)
        private = _PRIVATE.search(line)
        if rig.device == "cuda":
            if peak is None:
                raise RuntimeError(f"no device-peak figure in the loader's line: {one_line(line)}")
            row["result"] = (f"the build allocated at most {peak[1]} MiB on the device for {weights_mib:.1f} MiB "
                             "of weights the daemon holds")
            if float(peak[1]) >= weights_mib / 2:
                row["status"] = "FAIL"
        else:
            row["status"] = "INFO"
            row["result"] = (f"CPU dry run: private memory grew by {private[1] if private else '?'} MiB for "
                             f"{weights_mib:.1f} MiB of weights")
    rig.cli("stop", "--all", "--force")


def arena_tests(rig: Rig, checks: Checks) -> None:
    with checks.step("tests/test_arena_close.py") as row:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 str(REPO / "tests" / "test_arena_close.py")], capture_output=True, text=True,
                                env=rig.env, timeout=STEP_TIMEOUT_S, cwd=REPO)
        summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
        row["result"] = summary
        if result.returncode != 0:
            row["status"] = "FAIL"


def kill_while_mapped(rig: Rig, model: Path, checks: Checks) -> None:
    """An engine maps the arena zero-copy; the daemon gets SIGKILL; the engine reads and checksums it again."""
    ready = preload(rig, model, checks, "preload again for kill -9")
    if ready is None:
        checks.skip("kill -9 daemon while engine maps", "the preload failed")
        return
    holder = subprocess.Popen(
        [sys.executable, __file__, "--hold", str(model), "--device", rig.device, "--run-dir", str(rig.run_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rig.env,
    )
    rig.holders.append(holder)
    with checks.step("kill -9 daemon while engine maps") as row:
        mapped = read_line(holder, "MAPPED")
        (daemon,) = rig.daemons()
        os.kill(int(daemon["pid"]), signal.SIGKILL)
        if not wait_gone(int(daemon["pid"])):
            raise RuntimeError(f"daemon {daemon['pid']} survived SIGKILL")
        time.sleep(1.0)
        assert holder.stdin is not None
        holder.stdin.write("CHECK\n")
        holder.stdin.flush()
        after = read_line(holder, "AFTER")
        pressured = read_line(holder, "PRESSURED")
        same = mapped.split()[1] == after.split()[1] == pressured.split()[1]
        row["status"] = "INFO"
        row["result"] = ("mapping stays readable: " + ("yes, checksum unchanged after the kill and under new "
                         "allocations" if same else f"NO: {mapped} / {after} / {pressured}"))


def read_line(holder: subprocess.Popen[str], tag: str) -> str:
    """The holder's next line, which must start with `tag`; its death or an ERROR line is the step's failure."""
    assert holder.stdout is not None
    deadline = time.monotonic() + HOLDER_TIMEOUT_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([holder.stdout], [], [], 0.5)
        if readable:
            line = holder.stdout.readline().strip()
            if line.startswith(tag):
                return line
            if line:
                raise RuntimeError(one_line(line))
        if holder.poll() is not None:
            stderr = holder.stderr.read() if holder.stderr else ""
            raise RuntimeError(f"the engine process died ({describe_exit(holder.returncode)}): "
                               f"{one_line(stderr[-300:])}")
    raise RuntimeError(f"no {tag} line from the engine within {HOLDER_TIMEOUT_S:.0f} s")


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit {code}"


# -- the engine that holds a mapping (run as a child: --hold) ---------------------------------------------------


def hold(model: Path, device: str, run_dir: Path) -> int:
    import torch
    from wcache.attach import attach as attach_weights

    weights = attach_weights(model, device=device, mode="zero_copy", fallback=False, run_dir=run_dir)
    print(f"MAPPED {checksum(weights.tensors)} {weights.report.bytes_mapped}", flush=True)
    sys.stdin.readline()
    try:
        print(f"AFTER {checksum(weights.tensors)}", flush=True)
        # Memory the driver freed would be handed out again: allocate and overwrite a good share of it.
        if device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            filler = torch.full((min(free // 4, 8 << 30),), 0xA5, dtype=torch.uint8, device=device)
        else:
            filler = torch.full((256 << 20,), 0xA5, dtype=torch.uint8)
        print(f"PRESSURED {checksum(weights.tensors)} {filler.numel()}", flush=True)
    except Exception as exc:  # the answer to the question, reported, not raised
        print(f"ERROR reading the mapping after the kill: {type(exc).__name__}: {one_line(str(exc))}", flush=True)
        return 1
    return 0


def checksum(tensors: dict[str, Any]) -> str:
    import blake3
    import torch

    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()
    digest = blake3.blake3()
    for name in sorted(tensors):
        digest.update(tensors[name].detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


# -- main ---------------------------------------------------------------------------------------------------


def preflight(device: str) -> str | None:
    """Why this machine cannot run the check (one sentence), or None."""
    try:
        import torch
        import wcache_cli.app  # noqa: F401  (every CLI dependency importable)
    except ImportError as exc:
        return f"cannot import {exc.name} with {sys.executable}; install the repository there (pip install -e .)."
    if device == "cuda" and not torch.cuda.is_available():
        build = torch.version.cuda or "none"
        return (f"no CUDA device is visible to torch {torch.__version__} (CUDA build: {build}); run on a GPU "
                "machine with a CUDA torch, or pass --device cpu for a dry run.")
    return None


def environment(device: str) -> str:
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, {props.name}, "
                f"{props.total_memory / 2**30:.0f} GiB, driver visible devices {torch.cuda.device_count()}")
    return f"torch {torch.__version__}, CPU only"


def run(device: str, preset: str) -> int:
    from wcache_dev.synth import write_checkpoint

    reason = preflight(device)
    if reason:
        print(f"device_check: {reason}", file=sys.stderr)
        return 2
    checks = Checks()
    rig = Rig(device)
    # `timeout` (device_check.sh) sends SIGTERM: stop what we started before going.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        with checks.step("environment") as row:
            row["status"], row["result"] = "INFO", environment(device)
        model = write_checkpoint(preset, rig.base / preset)
        ready = preload(rig, model, checks, f"preload --device {device} ({preset})")
        if ready is None:
            for name in ("attach", "verify", "copy release", "kill -9"):
                checks.skip(name, "the preload failed")
        else:
            health_url = ready.get("health_url")
            attach(rig, model, checks, "zero_copy")
            verify(rig, model, checks, "--content")
            verify(rig, model, checks, "--greedy")
            copy_release_then_stop(rig, model, checks, health_url)
            kill_while_mapped(rig, model, checks)
            rig.cli("stop", "--all", "--force")
            vllm_no_second_copy(rig, checks)
        arena_tests(rig, checks)
    finally:
        rig.close()
    checks.print(f"wcache device check ({device}, preset {preset})")
    return 1 if checks.failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", default="tiny", help="a wcache_dev.synth preset to write and preload")
    parser.add_argument("--hold", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold is not None:
        return hold(args.hold, args.device, args.run_dir)
    return run(args.device, args.preset)


if __name__ == "__main__":
    sys.exit(main())
