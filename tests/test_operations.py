"""What an operator relies on: loading daemons are visible, probes tell ready from not, --replace, TP groups
stop whole, logs reach a service manager's stderr, the events log stays bounded, and the CLI behaves in pipes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from daemon_fixtures import (
    DaemonRig,
    daemon_rig,
    nothing_survives,  # noqa: F401
    wait_for,
)
from helpers import WCACHE, wcache_in_process
from wcache.attach import attach
from wcache.ipc.run_dir.loading import read_loading
from wcache.ipc.run_dir.paths import RunPaths
from wcache.monitor.collector import EventTail
from wcache.monitor.event_types import Stop
from wcache.monitor.events import append_event, read_events, rotated_path
from wcache_dev.synth import write_checkpoint


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


@pytest.fixture
def tiny(rig: DaemonRig) -> Path:
    return write_checkpoint("tiny", rig.base / "tiny")


def _start_preload(rig: DaemonRig, model: Path, *options: str,
                   stderr: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*WCACHE, "preload", str(model), "--run-dir", str(rig.run_dir), *options],
        stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, **rig.env},
    )


def _loading_rank(rig: DaemonRig) -> int:
    """Wait for a rank's loading record and freeze that rank where it stands; returns its pid."""
    def first() -> int | None:
        for path in (rig.run_dir / RunPaths.LOADING).glob("*.json"):
            return int(path.stem)
        return None
    pid = wait_for(first, timeout=60, interval=0.002, what="a loading record")
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_a_loading_daemon_is_listed_and_not_ready_until_it_is(rig: DaemonRig, tiny: Path) -> None:
    preload = _start_preload(rig, tiny, "--detach", "--json")
    pid = _loading_rank(rig)
    try:
        listed = rig.status()
        [row] = listed["daemons"]
        assert row["state"] == "loading" and row["pid"] == pid and row["source"] == str(tiny)
        assert listed["ready"] is False
        check = rig.cli("status", "--check", "--run-dir", str(rig.run_dir))
        assert check.returncode == 3 and f"pid {pid} is still loading" in check.stderr
        assert "loading" in rig.cli("status", "--run-dir", str(rig.run_dir)).stdout
    finally:
        os.kill(pid, signal.SIGCONT)
    assert preload.wait(timeout=60) == 0
    assert read_loading(rig.run_dir) == []  # the record goes once the descriptor is published
    check = rig.cli("status", "--check", "--run-dir", str(rig.run_dir))
    assert check.returncode == 0 and "ready: 1 daemon(s)" in check.stdout, check.stderr


def test_check_fails_without_daemons(rig: DaemonRig) -> None:
    check = rig.cli("status", "--check", "--run-dir", str(rig.run_dir))
    assert check.returncode == 3 and "no daemons in" in check.stderr and check.stdout == ""


def test_stop_all_stops_a_daemon_that_is_still_loading(rig: DaemonRig, tiny: Path) -> None:
    preload = _start_preload(rig, tiny, "--detach")
    pid = _loading_rank(rig)
    os.kill(pid, signal.SIGCONT)  # SIGTERM must reach a running process
    stopped = rig.cli("stop", "--all", "--run-dir", str(rig.run_dir))
    assert stopped.returncode == 0, stopped.stderr
    # The rank may reach READY between SIGCONT and the stop (the preload then succeeds) and stay a zombie until its
    # supervisor reaps it; either way it has exited.
    preload.wait(timeout=60)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert rig.status()["daemons"] == []


def test_a_killed_supervisor_leaves_one_daemon_that_the_next_preload_and_stop_see(rig: DaemonRig, tiny: Path) -> None:
    preload = _start_preload(rig, tiny, "--detach")
    rank = _loading_rank(rig)
    supervisor = psutil.Process(rank).ppid()
    os.kill(supervisor, signal.SIGKILL)
    os.kill(rank, signal.SIGCONT)
    preload.wait(timeout=60)
    # The orphaned rank carries on; a second preload of the same key finds it instead of loading a twin.
    again = rig.cli("preload", str(tiny), "--detach", "--run-dir", str(rig.run_dir))
    assert again.returncode == 0, again.stderr
    assert "already" in again.stdout or "READY" in again.stdout
    wait_for(lambda: rig.descriptors(), timeout=60, what="the orphan to publish")
    ranks = [p for p in psutil.process_iter()
             if "wcache.daemon " in " ".join(_cmd(p)) and str(rig.base) in " ".join(_cmd(p))]
    assert len(ranks) == 1, [p.pid for p in ranks]
    assert rig.cli("stop", "--all", "--run-dir", str(rig.run_dir)).returncode == 0
    wait_for(lambda: not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE,
             timeout=30, what="the orphan to exit")


def _cmd(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def test_replace_refuses_while_leased_and_force_replaces(rig: DaemonRig, tiny: Path) -> None:
    [old] = rig.preload(tiny)
    with attach(tiny, run_dir=rig.run_dir, fallback=False) as weights:
        assert weights.report.outcome == "hit"
        refused = rig.cli("preload", str(tiny), "--detach", "--replace", "--run-dir", str(rig.run_dir))
        assert refused.returncode == 3 and "lease" in refused.stderr and "--force" in refused.stderr
        assert [d.pid for d in rig.descriptors()] == [old.pid]
        replaced = rig.cli("preload", str(tiny), "--detach", "--json", "--replace", "--force",
                           "--run-dir", str(rig.run_dir))
        assert replaced.returncode == 0, replaced.stderr
    [new] = rig.descriptors()
    assert new.name == old.name and new.pid != old.pid
    assert not psutil.pid_exists(old.pid) or psutil.Process(old.pid).status() == psutil.STATUS_ZOMBIE
    assert rig.cli("preload", str(tiny), "--force", "--run-dir", str(rig.run_dir)).returncode == 2


def test_one_rank_of_a_group_is_never_stopped_alone(rig: DaemonRig, tiny: Path) -> None:
    first, second = rig.preload(tiny, "--tp", "2")
    alone = rig.cli("stop", first.name, "--run-dir", str(rig.run_dir))
    assert alone.returncode == 2 and "--group" in alone.stderr and second.name in alone.stderr
    assert len(rig.descriptors()) == 2
    group = rig.cli("stop", first.name, "--group", "--run-dir", str(rig.run_dir))
    assert group.returncode == 0, group.stderr
    assert first.name in group.stdout and second.name in group.stdout
    assert rig.descriptors() == []


def test_a_rank_that_dies_takes_its_group_down(rig: DaemonRig, tiny: Path) -> None:
    _, second = rig.preload(tiny, "--tp", "2")
    os.kill(second.pid, signal.SIGKILL)
    wait_for(lambda: rig.status()["daemons"] == [], timeout=30, what="the rest of the group to stop")
    assert rig.events("group_stopped")
    # `top` knows every kind the log has: a group stopped whole is in its feed, as an error naming the rank.
    top = rig.cli("top", "--once", "--json", "--interval", "0.1", "--run-dir", str(rig.run_dir), as_json=True)
    [stopped] = [e for e in top["events"] if e["kind"] == "group_stopped"]
    assert stopped["severity"] == "error" and "stopped whole" in stopped["summary"]
    assert f"rank {second.tp_rank} exited" in stopped["summary"]


def test_foreground_preload_logs_to_a_non_terminal_stderr_as_json(rig: DaemonRig, tiny: Path) -> None:
    preload = _start_preload(rig, tiny, "--log-format", "json", stderr=subprocess.PIPE)
    assert preload.stdout is not None
    assert preload.stdout.readline().startswith("READY"), "no READY line"
    preload.send_signal(signal.SIGTERM)
    _, stderr = preload.communicate(timeout=60)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    components = {line["component"] for line in lines}
    assert {"supervisor", "rank0"} <= components, stderr
    messages = " ".join(line["message"] for line in lines)
    assert "ready: daemon" in messages and "stopped: daemon" in messages
    logs = list((rig.run_dir / "logs").glob("preload-*-rank0.log"))
    assert logs and "ready: daemon" in logs[0].read_text()  # and the log file keeps them too


def test_events_rotate_by_size_and_readers_follow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WCACHE_EVENTS_MAX_BYTES", "4096")
    tail = EventTail(tmp_path / "events.jsonl")
    followed = []
    for i in range(400):
        append_event(tmp_path, Stop(daemon=f"cpu-{i}", leases=i))
        if i % 25 == 0:
            followed += tail.read_new()
    followed += tail.read_new()
    assert [e["leases"] for e in followed] == list(range(400))  # nothing lost or doubled across rotations
    files = [tmp_path / "events.jsonl", rotated_path(tmp_path / "events.jsonl")]
    assert sorted(tmp_path.iterdir()) == sorted(files)
    assert all(f.stat().st_size < 4096 + 200 for f in files)
    kept = [e["leases"] for e in read_events(tmp_path)]
    assert kept == list(range(kept[0], 400))  # the newest events, in order


def test_verbose_is_accepted_after_the_subcommand(tmp_path: Path) -> None:
    quiet = wcache_in_process("key", str(tmp_path / "missing"))
    loud = wcache_in_process("key", str(tmp_path / "missing"), "-v")
    assert quiet.returncode == loud.returncode == 2
    assert "Traceback" not in quiet.stderr and "Traceback" in loud.stderr
    assert "does not exist" in loud.stderr


@pytest.mark.parametrize("json_output", [False, True])
def test_a_reader_that_leaves_early_is_not_an_error(tmp_path: Path, json_output: bool) -> None:
    model = write_checkpoint("tiny", tmp_path / "tiny")
    command = [*WCACHE, "key", str(model), "--tensors", *(["--json"] * json_output)]
    env = {**os.environ, "WCACHE_CACHE_DIR": str(tmp_path / "cache")}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # what `| head -1` does once it has its line; here before any is written
        code = process.wait(timeout=120)
        stderr = process.stderr.read().decode()
    assert code == 0 and stderr == "", stderr


def test_top_raises_a_banner_for_a_fallback_storm_and_for_unverified_hits() -> None:
    from wcache.monitor.collector import STORM_FALLBACKS, alerts, summarize

    now = time.time()
    calm = [summarize({"ts": now - 5, "kind": "fallback", "reason": "r"})] * (STORM_FALLBACKS - 1)
    assert alerts(calm, now) == ()
    old = [summarize({"ts": now - 600, "kind": "fallback", "reason": "r"})] * 10
    assert alerts(old, now) == ()  # a storm that is over is history, not an alert
    storm = [*calm, summarize({"ts": now - 1, "kind": "fallback", "reason": "checkpoint differs"})]
    [banner] = alerts(storm, now)
    assert banner.startswith("FALLBACK STORM") and "checkpoint differs" in banner
    unverified = summarize({"ts": now, "kind": "attach_hit", "daemon": "cpu-x", "mode": "zero_copy",
                            "verified": False, "source": "/m"})
    assert unverified.severity == "warning" and "unverified" in unverified.summary
    assert any("unverified" in a for a in alerts([unverified], now))


@pytest.mark.parametrize("shards", [1, 2])  # model.safetensors alone, and an index naming two shards
def test_a_model_directory_that_cannot_be_listed_is_still_read(shards: int) -> None:
    from as_nobody import nobody_tree, open_to_all, run_as_nobody

    with nobody_tree() as (base, env):
        model = write_checkpoint("tiny", base / "model", num_shards=shards)
        open_to_all(model)
        model.chmod(0o311)  # traversable, not listable: every file in it can still be opened by name
        result = run_as_nobody([*WCACHE, "key", str(model)], env, cwd=base)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("key "), result.stdout


@pytest.fixture
def full_run_dir(tmp_path: Path) -> Iterator[Path]:
    """A run dir on a 64 KiB tmpfs that is already full (mounting needs root, as CI runs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path / "full"
    where.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(where)], check=True)
    try:
        with (where / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_run_dir_is_one_sentence_and_no_daemon(rig: DaemonRig, tiny: Path, full_run_dir: Path) -> None:
    result = rig.cli("preload", str(tiny), "--detach", "--run-dir", str(full_run_dir))
    assert result.returncode == 3, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "no space left" in line and str(full_run_dir) in line and "Traceback" not in line
    assert rig.cli("status", "--json", "--run-dir", str(full_run_dir)).returncode == 0


def test_the_engine_path_without_config_json_is_one_sentence(tmp_path: Path) -> None:
    model = write_checkpoint("tiny", tmp_path / "tiny", num_shards=1)
    (model / "config.json").unlink()
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    result = wcache_in_process("attach", str(model), "--plan", "identity", "--prompt", "hi", "--run-dir",
                               str(run_dir), env={"WCACHE_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "config.json" in line and "Traceback" not in result.stderr


def test_a_trusted_hit_is_recorded_as_unverified_everywhere(rig: DaemonRig, tiny: Path) -> None:
    [daemon] = rig.preload(tiny)
    with attach(tiny, run_dir=rig.run_dir, fallback=False):
        pass
    with attach(tiny, run_dir=rig.run_dir, fallback=False, trust_daemon=True) as trusted:
        assert trusted.report.outcome == "hit"
    verified, unverified = rig.events("attach_hit")
    assert verified["verified"] is True and unverified["verified"] is False
    assert unverified["source"] == str(tiny) and unverified["daemon_source"] == daemon.source
    counters = rig.stats(daemon)["counters"]
    assert counters["hits"] == 2 and counters["hits_unverified"] == 1
    assert "1 unverified hit(s)" in rig.cli("status", "--run-dir", str(rig.run_dir)).stdout
    [health_url] = {d.health_url for d in rig.descriptors()}
    with urllib.request.urlopen(f"{health_url}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert any(line.startswith("wcache_unverified_hits") and line.endswith(" 1.0") for line in metrics.splitlines())


def test_auto_dtype_is_the_same_for_key_attach_and_verify(rig: DaemonRig) -> None:
    # bfloat16 weights and a config.json that names no dtype: "auto" must mean bfloat16 everywhere.
    model = write_checkpoint("small", rig.base / "small")
    config = json.loads((model / "config.json").read_text())
    for name in ("torch_dtype", "dtype"):
        config.pop(name, None)
    (model / "config.json").write_text(json.dumps(config))
    [daemon] = rig.preload(model)
    assert daemon.key_id in json.dumps(rig.cli("key", str(model), "--json", as_json=True))
    with attach(model, run_dir=rig.run_dir, fallback=False) as weights:
        assert weights.report.outcome == "hit"
    # --trust-daemon compares config, plan and format only, with "auto" resolved by the same rule.
    with attach(model, run_dir=rig.run_dir, fallback=False, trust_daemon=True) as trusted:
        assert trusted.report.outcome == "hit"
    verified = rig.cli("verify", str(model), "--content", "--run-dir", str(rig.run_dir))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert daemon.name in verified.stdout


def test_a_busy_served_engine_logs_a_stats_line_like_vllm(tmp_path: Path) -> None:
    model = write_checkpoint("tiny", tmp_path / "tiny")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {**os.environ, "WCACHE_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1", "COLUMNS": "200"}
    with subprocess.Popen(
        [*WCACHE, "attach", str(model), "--serve", "--port", "0",
         "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    ) as server:
        try:
            assert server.stdout is not None and server.stderr is not None
            line = server.stdout.readline()
            assert line.startswith("SERVING "), line
            url = line.split()[1]
            request = urllib.request.Request(url, data=json.dumps({"prompt": "hello", "max_tokens": 4}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
            time.sleep(6)  # one stats interval (5 s) with activity in it
        finally:
            server.send_signal(signal.SIGTERM)
            _, stderr = server.communicate(timeout=30)
    assert "Avg prompt throughput" in stderr and "Avg generation throughput" in stderr, stderr


def test_a_rank_killed_while_loading_is_one_sentence_exit_3_and_leaves_no_files(rig: DaemonRig, tiny: Path) -> None:
    preload = _start_preload(rig, tiny, "--detach", stderr=subprocess.PIPE)
    pid = _loading_rank(rig)
    os.kill(pid, signal.SIGKILL)
    _, stderr = preload.communicate(timeout=60)
    assert preload.returncode == 3, stderr
    [line] = stderr.strip().splitlines()
    assert line.startswith(f"error: rank 0 (pid {pid}) was killed by SIGKILL while loading; its log is "), line
    log = Path(line.removesuffix(".").rsplit("its log is ", 1)[1])
    assert log.is_file() and log.parent == rig.run_dir / "logs"
    left = sorted(p.name for p in rig.run_dir.rglob("*") if p.suffix in (".json", ".sock") and p.is_file()
                  and p.parent.name != "logs")
    assert left == [], left
    assert rig.status()["daemons"] == []


def _ranks_running(rig: DaemonRig) -> list[int]:
    """Pids of the rank daemons of this rig that run (zombies excluded)."""
    found = []
    for process in psutil.process_iter():
        command = " ".join(_cmd(process))
        if "wcache.daemon " in command and str(rig.base) in command:
            with contextlib.suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
    return found


def _replace(rig: DaemonRig, model: str, *options: str, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    return rig.cli("preload", model, "--detach", "--replace", "--run-dir", str(rig.run_dir), *options, env=env)


@pytest.mark.parametrize("spelling", ["symlink", "dotdot"])
def test_replace_through_another_spelling_of_the_path_leaves_one_daemon(rig: DaemonRig, tiny: Path,
                                                                         spelling: str) -> None:
    [old] = rig.preload(tiny)
    if spelling == "symlink":
        other = rig.base / "current"
        other.symlink_to(tiny)
    else:
        (rig.base / "elsewhere").mkdir()
        other = rig.base / "elsewhere" / ".." / tiny.name
    replaced = _replace(rig, str(other))
    assert replaced.returncode == 0, replaced.stderr
    assert f"stopped {old.name} to replace it" in replaced.stderr
    [new] = rig.descriptors()
    assert new.pid != old.pid and _ranks_running(rig) == [new.pid]


def test_replace_of_a_hugging_face_id_whose_main_moved_stops_the_old_revision(rig: DaemonRig) -> None:
    repo = rig.base / "hub" / "models--Org--Tiny"
    revisions = ["1" * 40, "2" * 40]
    for seed, revision in enumerate(revisions):  # two revisions, two different keys
        write_checkpoint("tiny", repo / "snapshots" / revision, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revisions[0])
    env = {"HF_HUB_CACHE": str(rig.base / "hub"), "HF_HUB_OFFLINE": "1"}
    first = rig.cli("preload", "Org/Tiny", "--detach", "--run-dir", str(rig.run_dir), env=env)
    assert first.returncode == 0, first.stderr
    [old] = rig.descriptors()
    (repo / "refs" / "main").write_text(revisions[1])
    replaced = _replace(rig, "Org/Tiny", env=env)
    assert replaced.returncode == 0, replaced.stderr
    assert f"stopped {old.name} to replace it" in replaced.stderr
    [new] = rig.descriptors()
    assert new.source == str(repo / "snapshots" / revisions[1]) and new.key_id != old.key_id
    assert _ranks_running(rig) == [new.pid]


def test_replace_of_a_tp2_group_leaves_one_group(rig: DaemonRig, tiny: Path) -> None:
    old = rig.preload(tiny, "--tp", "2")
    replaced = _replace(rig, str(tiny), "--tp", "2")
    assert replaced.returncode == 0, replaced.stderr
    assert all(f"stopped {d.name} to replace it" in replaced.stderr for d in old)
    new = rig.descriptors()
    assert len(new) == 2 and not {d.pid for d in new} & {d.pid for d in old}
    assert sorted(_ranks_running(rig)) == sorted(d.pid for d in new)


def test_two_replaces_at_once_end_in_one_daemon_and_both_succeed(rig: DaemonRig, tiny: Path) -> None:
    [old] = rig.preload(tiny)
    both = [_start_preload(rig, tiny, "--detach", "--replace", stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], results
    assert all("READY" in stdout for stdout, _ in results), results
    [new] = rig.descriptors()
    assert new.pid != old.pid and _ranks_running(rig) == [new.pid]
