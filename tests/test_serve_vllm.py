"""`wcache serve` end to end: real vLLM servers (the CPU build) supervised by the launcher over a real daemon.

One launcher for the module (`served`, following its weights' newest version): its server is killed with SIGKILL
and comes back with the same greedy tokens, restarted by `wcache restart` with another --max-model-len, shown by
`status` and `top`, reloaded in place with a version a trainer publishes (and, killed again, restarted on that
version), and finally stopped with SIGTERM,
leaving no process, socket, record or shared-memory segment behind. A second launcher
whose server fails at every start (a --max-model-len vLLM's parser accepts and its engine refuses) backs off
and says why; a typo is refused before anything starts. A TP 2 launcher follows a version a trainer publishes by
restarting its server on it, each rank attaching its own rank's daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from daemon_fixtures import DaemonRig, copy_checkpoint, daemon_rig, nothing_survives, wait_for  # noqa: F401
from helpers import assert_one_error_sentence, environment, free_port, loaded_of, modules_after_cli, one_sentence
from wcache.integrations.vllm.warm import ZYGOTE_MODULE
from wcache.ipc.run_dir.engine_token import TOKEN_FILE_ENV, read_token_file
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.run_dir.servers import ServerRecord, live_server_records
from wcache_dev.synth import overwrite_tensor_bytes, write_checkpoint
from wcache_dev.vllm_disk_reload import reload_from_disk

pytestmark = pytest.mark.vllm

PROMPT = "the weights cache keeps"
MAX_NEW_TOKENS = 8
START_S = 600.0  # a cold start imports vLLM in three processes; far more than a healthy start needs here
SERVER_ARGS = ("--host", "127.0.0.1", "--enforce-eager", "--served-model-name", "small")
LM_HEAD_BYTES = 320 * 128 * 2  # the small preset's vocab × hidden, bf16


@dataclass
class Launcher:
    rig: DaemonRig
    process: subprocess.Popen[str]
    output: Path
    url: str
    port: int

    def record(self) -> ServerRecord | None:
        records = [r for r in live_server_records(self.rig.run_dir) if r.launcher_pid == self.process.pid]
        return records[0] if records else None

    def serving(self, restarts: int) -> ServerRecord:
        """Wait until the server has been started at least `restarts` times after the first and answers /health.
        At least: a start can fail on its own before the one a test caused (the port, chosen free, taken meanwhile
        by another test's engine; the launcher restarts after its backoff)."""
        def ready() -> ServerRecord | None:
            assert self.process.poll() is None, self.output.read_text()[-3000:]
            record = self.record()
            return record if record and record.state == "serving" and record.restarts >= restarts else None
        return wait_for(ready, timeout=START_S, interval=1.0, what=f"the server, restart {restarts}, to serve")

    def said(self) -> str:
        return self.output.read_text()

    def story(self) -> str:
        """What the launcher said and the end of its server's log: a failed assertion's context."""
        record = self.record()
        log = Path(record.log).read_text()[-6000:] if record is not None and Path(record.log).exists() else ""
        return f"the launcher said:\n{self.said()[-3000:]}\nthe server's log ends:\n{log}"

    def complete(self) -> list[int]:
        body = json.dumps({"model": "small", "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            completion = json.load(response)
        return list(completion["choices"][0]["token_ids"])

    def max_model_len(self) -> int:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as response:
            return int(json.load(response)["data"][0]["max_model_len"])


def _start(rig: DaemonRig, model: Path, *vllm_args: str, name: str, cold: bool = False,
           follow: bool = False, env_extra: dict[str, str] | None = None) -> Launcher:
    port = free_port()
    output = rig.base / f"{name}.out"
    env = environment({**rig.env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(rig.base / "vllm-cache"),
                       **(env_extra or {})})
    with output.open("w") as out:
        process = subprocess.Popen(
            [*_wcache(), "serve", str(model), "--run-dir", str(rig.run_dir), "--stop-grace", "10",
             *(["--cold"] if cold else []), *(["--follow", "--version-pool", "16MiB"] if follow else []), "--",
             "--port", str(port), *SERVER_ARGS, *vllm_args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, text=True)
    return Launcher(rig, process, output, f"http://127.0.0.1:{port}", port)


def _wcache() -> list[str]:
    return [sys.executable, "-m", "wcache_cli.main"]


def _stop(launcher: Launcher) -> int:
    with contextlib.suppress(ProcessLookupError):
        launcher.process.send_signal(signal.SIGTERM)
    try:
        return launcher.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        launcher.process.kill()
        return launcher.process.wait()


def _tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _shared_memory(processes: list[psutil.Process]) -> set[Path]:
    """The /dev/shm files `processes` map (the daemon's arena, vLLM's message queues)."""
    found = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            found |= {Path(m.path) for m in process.memory_maps(grouped=True) if m.path.startswith("/dev/shm/")}
    return found


@pytest.fixture(scope="module")
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        write_checkpoint("small", made.base / "small")
        yield made


@pytest.fixture(scope="module")
def served(rig: DaemonRig) -> Iterator[Launcher]:
    launcher = _start(rig, rig.base / "small", "--max-model-len", "512", name="served", follow=True)
    try:
        launcher.serving(restarts=0)
        yield launcher
    finally:
        _stop(launcher)


def test_a_typo_is_one_sentence_before_anything_starts(rig: DaemonRig, served: Launcher,
                                                        tmp_path: Path) -> None:
    """The option table exists once the module's launcher has started: the check imports neither vLLM nor
    torch (what makes it take well under two seconds: benchmarks/cli_startup.py times it), and starts nothing."""
    untouched = tmp_path / "run"
    began = time.monotonic()
    result, modules = modules_after_cli(tmp_path, "serve", str(rig.base / "small"), "--run-dir", str(untouched),
                                        "--", "--port", "8000", "--max-model-lenn", "512",
                                        env={**rig.env, "WCACHE_RUN_DIR": str(untouched)})
    took = time.monotonic() - began
    assert result.returncode == 2, result.stderr
    said = assert_one_error_sentence(result)
    assert said == "error: vLLM's server has no option --max-model-lenn; the closest is --max-model-len.", said
    assert loaded_of(modules, ("vllm", "torch")) == []
    assert not untouched.exists()  # no run dir made, so no daemon and no server
    print(f"typo refused in {took:.2f} s")


def test_a_killed_server_comes_back_with_the_same_tokens(served: Launcher) -> None:
    before = served.complete()
    record = served.record()
    assert record is not None and record.pid is not None and record.last_ready_s is not None
    hits = Path(record.log).read_text().count("hit from daemon " + record.daemons[0])
    assert record.daemons and hits >= 1
    os.kill(record.pid, signal.SIGKILL)
    again = served.serving(restarts=record.restarts + 1)
    assert again.pid != record.pid
    assert again.last_exit == f"the vLLM server (pid {record.pid}) was killed by SIGKILL", again.last_exit
    assert f"{again.last_exit}; restarting in 1 s." in served.said()
    assert served.complete() == before
    # The restarted server attached to the same daemon again (a hit): the launcher kept the group up.
    assert Path(again.log).read_text().count("hit from daemon " + record.daemons[0]) == hits + 1
    # vLLM's start-up caches went under the weights' key (its CPU build writes its model-class inspection cache
    # there with --enforce-eager); the restart used the same directory. Beside it only the inspection cache of
    # the plan's resolution, which ran before the key was known (and depends on vLLM's code, not the weights).
    key_id = served.rig.descriptors()[0].key_id
    root = served.rig.base / "vllm-cache"
    assert sorted(p.name for p in root.iterdir()) == ["by-weights", "modelinfos"]
    assert [p.name for p in (root / "by-weights").iterdir()] == [key_id]
    assert "modelinfos" in {p.name for p in (root / "by-weights" / key_id).iterdir()}
    # The killed server's ranks announced themselves at the same URL: their announcements went with them.
    announced = [json.loads(p.read_text()) for p in RunPaths(served.rig.run_dir).engines.glob("*.json")]
    assert [a["pid"] for a in announced if a["url"] == served.url and not psutil.pid_exists(a["pid"])] == []


def test_a_restart_by_command_applies_another_max_model_len(rig: DaemonRig, served: Launcher) -> None:
    assert served.max_model_len() == 512
    refused = rig.cli("restart", "--run-dir", str(rig.run_dir), "--", "--port", str(served.port + 1), *SERVER_ARGS)
    assert refused.returncode == 2 and "a restart keeps --port" in refused.stderr, refused.stderr
    before = served.record()
    assert before is not None
    done = rig.cli("restart", "--run-dir", str(rig.run_dir), "--", "--port", str(served.port), *SERVER_ARGS,
                   "--max-model-len", "256")
    assert done.returncode == 0, done.stderr
    after = served.serving(restarts=before.restarts + 1)
    assert after.argv[-2:] == ("--max-model-len", "256")
    assert served.max_model_len() == 256


def test_status_and_top_show_the_server(rig: DaemonRig, served: Launcher) -> None:
    record = served.record()
    assert record is not None
    status = rig.status()
    [shown] = status["servers"]
    assert (shown["url"], shown["pid"], shown["restarts"], shown["state"]) == (
        served.url, record.pid, record.restarts, "serving"), shown
    assert shown["last_ready_s"] == pytest.approx(record.last_ready_s)
    text = rig.cli("status", "--run-dir", str(rig.run_dir)).stdout
    assert "Served by wcache serve" in text and served.url.removeprefix("http://") in text, text
    assert str(record.pid) in text, text
    top = rig.cli("top", "--once", "--json", "--interval", "0.5", "--run-dir", str(rig.run_dir), as_json=True)
    [row] = top["servers"]
    assert (row["url"], row["pid"], row["restarts"]) == (served.url, record.pid, record.restarts), row
    # Its engine announces the server's URL (the launcher tells it), so top scrapes the server's /metrics.
    engines = [e for e in top["engines"] if e["url"] == served.url]
    assert len(engines) == 1, [(e["id"], e["up"], e["weights"], psutil.pid_exists(int(e["id"].split()[-1])) and
                                psutil.Process(int(e["id"].split()[-1])).status()) for e in engines]
    [engine] = engines
    assert engine["kind"] == "vllm" and engine["up"] and engine["weights"] == "hit", engine
    # The launcher holds a lease of its own (the server holds the other): a stop without --force is refused,
    # also between a server's death and its restart, when no engine holds one.
    [daemon] = [d for d in status["daemons"] if d["name"] == record.daemons[0]]
    assert daemon["leases"] == 2, daemon
    refused = rig.cli("stop", "--all", "--run-dir", str(rig.run_dir))
    assert refused.returncode == 2 and "lease" in refused.stderr, refused.stderr


def test_a_server_that_keeps_crashing_backs_off_and_says_why(rig: DaemonRig, served: Launcher) -> None:
    """--max-model-len past the model's 512 positions passes vLLM's parser and fails in its engine config. This
    launcher starts its servers cold (the module's launcher is warm), so both starters are served here."""
    crashing = _start(rig, rig.base / "small", "--max-model-len", "99999", name="crashing", cold=True)
    try:
        wait_for(lambda: "restarting in 2 s." in crashing.said(), timeout=START_S, interval=1.0,
                 what="the second failed start")
        said = crashing.said()
        assert "Daemons: reusing" in said  # the module's launcher's group serves this plan already
        deaths = [line for line in said.splitlines() if line.startswith("the vLLM server (pid ")]
        assert len(deaths) >= 2 and deaths[0].endswith("; restarting in 1 s."), said
        assert "exited with status 1: " in deaths[0] and "max_model_len (99999) is greater" in deaths[0], deaths[0]
        record = crashing.record()
        assert record is not None and record.last_ready_s is None and record.restarts >= 1
    finally:
        assert _stop(crashing) == -signal.SIGTERM
    assert served.record() is not None  # the other launcher and its group were left alone


def _followed(served: Launcher, key_id: str, daemon: str) -> None:
    wait_for(lambda: f"→ {key_id} (daemon {daemon}): vLLM reloaded in place in " in served.said(), timeout=120,
             interval=0.5, what=f"the server to follow {daemon}")


def test_a_following_server_serves_each_published_version(rig: DaemonRig, served: Launcher) -> None:
    """A trainer publishes N+1 from tensors in memory (lm_head changed), then N+2 from N+1; the launcher reloads its
    server in place from each one's daemon: `top` shows the server on it and following, the versions left behind
    (N included: the launcher's leases moved with the server) stop without --force, a restarted server comes back
    on N+2, and the server's tokens are then those of vLLM's own loader reading N+2's checkpoint from disk."""
    record = served.record()
    assert record is not None
    [parent] = [d for d in rig.descriptors() if d.name == record.daemons[0]]
    before = served.complete()
    steps = [copy_checkpoint(rig.base / "small", rig.base / "small-step-1")]
    overwrite_tensor_bytes(steps[0], "lm_head.weight", 1024, bytes(LM_HEAD_BYTES - 1024))
    key_id, daemon = rig.publish_step(parent.name, rig.base / "small", steps[0])
    _followed(served, key_id, daemon)
    assert served.complete() != before, f"the zeroed lm_head must change the tokens; {served.story()}"
    top = rig.cli("top", "--once", "--json", "--interval", "0.5", "--run-dir", str(rig.run_dir), as_json=True)
    [engine] = [e for e in top["engines"] if e["url"] == served.url]
    assert (engine["key_id"], engine["daemon"], engine["follows"]) == (key_id, daemon, True), engine
    steps.append(copy_checkpoint(steps[0], rig.base / "small-step-2"))
    overwrite_tensor_bytes(steps[1], "lm_head.weight", 0, bytes(512))
    next_key_id, next_daemon = rig.publish_step(daemon, steps[0], steps[1])
    _followed(served, next_key_id, next_daemon)
    stopped = rig.cli("stop", daemon, "--run-dir", str(rig.run_dir))
    assert stopped.returncode == 0, stopped.stderr
    # The launcher's leases moved with the server: N stops without --force too (its arena free for the pool), and
    # `status` shows the server on N+2's daemon. Killed, the server comes back on N+2, not on MODEL's N.
    stopped = rig.cli("stop", parent.name, "--run-dir", str(rig.run_dir))
    assert stopped.returncode == 0, stopped.stderr
    on_step_2 = served.complete()
    record = served.record()
    assert record is not None and record.pid is not None and record.daemons == (next_daemon,), record
    os.kill(record.pid, signal.SIGKILL)
    again = served.serving(restarts=record.restarts + 1)
    assert "hit from daemon " + next_daemon in Path(again.log).read_text()
    assert served.complete() == on_step_2
    # No file holds a published version's weights: verify says so rather than compare them with N's.
    unverifiable = rig.cli("verify", served.url, "--greedy")
    assert unverifiable.returncode == 3, unverifiable.stdout + unverifiable.stderr
    assert "a version built from a delta" in one_sentence(unverifiable.stderr)
    # Its development routes take the launcher's control token (0600 in the run dir): not any local user's request.
    refused = urllib.request.Request(f"{served.url}/collective_rpc", method="POST", data=json.dumps(
        {"method": "reload_weights", "kwargs": {"weights_path": str(rig.base / "small")}}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(refused, timeout=30)
    assert unauthorized.value.code == 401
    followed = served.complete()
    token = read_token_file(RunPaths(rig.run_dir).engine_token(served.process.pid))
    reload_from_disk(served.url, steps[1], token)
    assert served.complete() == followed


def test_a_tensor_parallel_server_follows_by_restarting_with_each_rank_on_its_own_daemon(rig: DaemonRig,
                                                                                         served: Launcher) -> None:
    """At TP 2 the launcher follows the version of its rank 0's daemon once the version's whole group runs, by
    restarting the server on it (vLLM's in-place reload takes checkpoint tensors, and a rank's daemon holds its
    shards): each rank attaches its own rank's daemon of that group, and the tokens are then those of vLLM's own
    loader reading the version's checkpoint from disk. An in-place switch at TP 2 is refused in one sentence and
    changes nothing."""
    tp2 = _start(rig, rig.base / "small", "--max-model-len", "512", "--tensor-parallel-size", "2", name="tp2",
                 follow=True, env_extra={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    daemon, shm = None, set()
    try:
        record = tp2.serving(restarts=0)
        group = sorted((d for d in rig.descriptors() if d.name in record.daemons), key=lambda d: d.tp_rank)
        assert [(d.tp_size, d.tp_rank) for d in group] == [(2, 0), (2, 1)], group
        before = tp2.complete()
        # The step changes a tensor each rank holds a shard of, in rows (lm_head) and in columns (a down_proj).
        step = copy_checkpoint(rig.base / "small", rig.base / "small-tp2-step")
        overwrite_tensor_bytes(step, "lm_head.weight", 2048, bytes(LM_HEAD_BYTES - 2048))
        overwrite_tensor_bytes(step, "model.layers.0.mlp.down_proj.weight", 0, bytes(4096))
        since = len(rig.events())
        key_id, daemon = rig.publish_step(group[0].name, rig.base / "small", step)
        wait_for(lambda: f"→ {key_id} (daemon {daemon}): vLLM restarts on it" in tp2.said(), timeout=120,
                 interval=0.5, what=f"the launcher to restart the server on {daemon}")
        again = tp2.serving(restarts=record.restarts + 1)
        version = {d.tp_rank: d.name for d in rig.descriptors() if d.parent in {g.name for g in group}}
        assert again.daemons == (version[0], version[1]) and version[0] == daemon, (again.daemons, version)
        hits = {e["daemon"] for e in rig.events()[since:] if e["kind"] == "attach_hit" and e["engine"] == "vllm"}
        assert hits == set(version.values()), (hits, version)
        followed = tp2.complete()
        assert followed != before, f"the zeroed lm_head must change the tokens; {tp2.story()}"
        token_file = RunPaths(rig.run_dir).engine_token(tp2.process.pid)
        refused = rig.cli("switch", tp2.url, "--daemon", group[0].name, env={TOKEN_FILE_ENV: str(token_file)})
        assert refused.returncode == 3 and "in-place reload cannot take" in one_sentence(refused.stderr), refused.stderr
        assert tp2.complete() == followed, "a refused switch must leave the version's weights serving"
        reload_from_disk(tp2.url, step, read_token_file(token_file))
        assert tp2.complete() == followed, tp2.story()
        # Its workers' shared memory (vLLM's CPU TP2 segments, which vLLM itself leaves behind) goes with the server.
        shm = _shared_memory(_tree(tp2.process.pid))
        assert any(path.name.startswith("vllm_dist_") for path in shm), shm
    finally:
        _stop(tp2)
        # The version's group was started by the trainer's publish, not by the launcher: the trainer stops it (also
        # when the test failed, so the module's last test finds only its own launcher's daemons).
        if daemon is not None:
            stopped = rig.cli("stop", daemon, "--group", "--run-dir", str(rig.run_dir))
            assert stopped.returncode == 0, stopped.stderr
    assert sorted(path for path in shm if path.exists()) == []


def test_follow_is_refused_where_the_server_cannot_switch_safely(rig: DaemonRig, served: Launcher,
                                                                 tmp_path: Path) -> None:
    """Following runs vLLM's development endpoints (which reload weights): only on a loopback address; the refusal
    is one sentence before anything starts."""
    untouched = tmp_path / "run"
    result = rig.cli("serve", str(rig.base / "small"), "--follow", "--run-dir", str(untouched), "--",
                     "--port", "8000", "--host", "0.0.0.0")
    said = "give the server vLLM's --host 127.0.0.1"
    assert result.returncode == 2 and said in assert_one_error_sentence(result), result.stderr
    assert not untouched.exists()


def test_stopping_the_launcher_leaves_nothing_behind(rig: DaemonRig, served: Launcher) -> None:
    record = served.record()
    assert record is not None and record.pid is not None
    tree = _tree(served.process.pid)
    assert any(p.pid == record.pid for p in tree)
    sockets = [RunPaths(rig.run_dir).socket(name) for name in record.daemons]
    assert all(s.exists() for s in sockets)
    shm = _shared_memory(tree)
    assert shm  # at least the daemon's arena
    zygote_socket = next(Path(p.cmdline()[-2]) for p in tree if ZYGOTE_MODULE in p.cmdline())
    assert zygote_socket.exists()
    assert _stop(served) == -signal.SIGTERM
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive
    assert not any(s.exists() for s in sockets)
    assert not RunPaths(rig.run_dir).server(served.process.pid).exists()
    assert not RunPaths(rig.run_dir).engine_token(served.process.pid).exists()
    assert [d.name for d in rig.descriptors()] == []
    assert sorted(path for path in shm if path.exists()) == []
    assert not zygote_socket.parent.exists()  # the warm starter's private directory
