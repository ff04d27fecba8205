"""Corruption reaches the engines: a served reference engine whose daemon's background re-check finds a bit
flipped in the arena it maps hears so over its lease at once, turns not-ready, says which tensor in
`/v1/weights`, `/metrics`, its announcement in the run dir and `top`, and answers completions with an error
until it switches to good weights.

The flip is planted with WCACHE_FAULT_FLIP (after the digests, before the seal: the sealed arena cannot be
written afterwards). The engine starts on good weights and switches to the flipped daemon's as soon as that
daemon is ready, well before its first re-check an interval later.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import DaemonRig, daemon_rig, http_status, nothing_survives, wait_for  # noqa: F401
from engine_serving import Server, metrics, post, serving
from wcache_dev.synth import write_checkpoint

FLIPPED = "model.embed_tokens.weight"
AT = 70_000
SCRUB_INTERVAL_S = "3"
PROMPT = "The weights"


class Flipped:
    def __init__(self, rig: DaemonRig, server: Server, flipped: Path, good: Path) -> None:
        self.rig, self.server, self.flipped, self.good = rig, server, flipped, good


@pytest.fixture(scope="module")
def flipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flipped]:
    with daemon_rig() as rig:
        bad = write_checkpoint("tiny", rig.base / "flipped", seed=0)
        good = write_checkpoint("tiny", rig.base / "good", seed=1)  # same config, other bytes
        rig.preload(good)
        with serving(rig, good) as server:
            preloaded = rig.cli("preload", str(bad), "--detach", "--run-dir", str(rig.run_dir), "--scrub-interval",
                                SCRUB_INTERVAL_S, env={"WCACHE_FAULT_FLIP": f"{FLIPPED}:{AT}"})
            rig._remember_supervisors()
            assert preloaded.returncode == 0, preloaded.stderr
            code, switched = _switch(server, bad)
            assert code == 200, switched
            assert not rig.events("scrub_failed"), "the engine must hold a lease before the first re-check"
            yield Flipped(rig, server, bad, good)


def _switch(server: Server, model: Path) -> tuple[int, Any]:
    return post(server.url, json.dumps({"model": str(model)}).encode(), "/v1/weights", server.token())


def _weights(server: Server) -> dict[str, Any] | None:
    code, body = http_status(f"{server.url}/v1/weights")
    return body if code == 200 and isinstance(body, dict) else None


def _announced(rig: DaemonRig, pid: int) -> Any:
    """The engine's announcement in the run dir, as `top` and `status` read it."""
    return json.loads((rig.run_dir / "engines" / f"{pid}.json").read_text())


def _complete(server: Server) -> tuple[int, Any]:
    return post(server.url, json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode())


def test_a_corrupt_daemon_stops_its_engine_until_it_switches(flipped: Flipped) -> None:
    rig, server = flipped.rig, flipped.server
    engine_pid = server.process.pid
    # Within moments of the daemon's finding, the engine says it is not ready, naming the tensor.
    found = wait_for(lambda: rig.events("scrub_failed"), timeout=60, what="the daemon's scrub_failed event")[0]
    assert found["tensor"] == FLIPPED and engine_pid in found["lease_pids"]
    code, health = wait_for(lambda: (h := http_status(f"{server.url}/health"))[0] == 503 and h, timeout=5,
                            what="/health to turn 503")
    assert isinstance(health, dict) and health["status"] == "weights corrupt" and FLIPPED in health["corrupt"]
    assert health["daemon_lost"] is False, "the daemon's notice is not its going away"
    weights = _weights(server)
    assert weights is not None and FLIPPED in weights["corrupt"]
    assert [t["tensor"] for t in weights["attach"]["corrupt"]] == [FLIPPED]
    assert f"at its byte {AT}" in weights["attach"]["corrupt"][0]["reason"]
    # Completions are refused with the reason, not answered from the changed bytes.
    code, answer = _complete(server)
    assert code == 503 and FLIPPED in answer["error"]["message"] and "choices" not in answer
    assert metrics(server.url)["wcache:weights_corrupt_tensors"] == 1
    # The engine announced it; top shows the engine as corrupt.
    said = wait_for(lambda: rig.events("engine_weights_corrupt"), timeout=5, what="the engine's event")[0]
    assert (said["pid"], said["tensor"]) == (engine_pid, FLIPPED)
    assert not rig.events("daemon_lost")
    said_so = [line for line in server.stderr.read_text().splitlines() if "changed in memory" in line]
    assert len(said_so) == 1 and FLIPPED in said_so[0], said_so
    assert [t["tensor"] for t in _announced(rig, engine_pid)["attach"]["corrupt"]] == [FLIPPED]
    top = rig.cli("top", "--json", "--once", "--run-dir", str(rig.run_dir), "--interval", "0.3", as_json=True)
    (row,) = [e for e in top["engines"] if e["url"] == server.url]
    assert row["weights"] == "corrupt"
    # Switching back to the corrupt daemon is refused (it turns new attaches away); to good weights, service returns.
    code, refused = _switch(server, flipped.flipped)
    assert code == 409 and "changed in memory" in refused["error"]["message"]
    assert _complete(server)[0] == 503
    code, switched = _switch(server, flipped.good)
    assert code == 200, switched
    code, health = http_status(f"{server.url}/health")
    assert code == 200 and isinstance(health, dict) and health["corrupt"] is None
    weights = _weights(server)
    assert weights is not None and weights["corrupt"] is None and "corrupt" not in weights["attach"]
    code, answer = _complete(server)
    assert code == 200 and answer["wcache"]["weights_key"] == switched["current"]["key_id"]
    assert metrics(server.url)["wcache:weights_corrupt_tensors"] == 0
    assert "corrupt" not in _announced(rig, engine_pid)["attach"]


def test_the_lease_watcher_records_notices_and_takes_anything_else_for_the_end(tmp_path: Path) -> None:
    """In-process, over a socket pair: a notice marks the weights corrupt and keeps the lease; a frame no daemon
    sends ends it as a lost daemon with unexpected data, as before notices existed."""
    from wcache.attach.lease import _watch_lease
    from wcache.attach.report import AttachReport
    from wcache.ipc.wire.framing import NOTICE_LIMITS
    from wcache.ipc.wire.messages import CorruptNotice, encode

    engine_end, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    report = AttachReport(outcome="hit", mode="zero_copy", device="cpu", key_id="k", daemon="d")
    watcher = threading.Thread(target=_watch_lease, args=(engine_end, threading.Event(), report, tmp_path))
    watcher.start()
    try:
        daemon_end.sendall(encode(CorruptNotice(tensor=FLIPPED, reason="it changed"), NOTICE_LIMITS))
        wait_for(lambda: report.corrupt, timeout=5, what="the notice")
        assert not report.daemon_lost and report.corrupt_sentence() is not None
        daemon_end.sendall(b"\x00\x07garbage")
        watcher.join(timeout=5)
        assert not watcher.is_alive() and report.daemon_lost
    finally:
        engine_end.close()
        daemon_end.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e.get("tensor"), e.get("unexpected_data")) for e in lines] == [
        ("engine_weights_corrupt", FLIPPED, None), ("daemon_lost", None, True)]


# -- tensor parallel: a flip under rank 1 stops the engine rank 0 serves --------------------------------------

TP_SCRUB_INTERVAL_S = 20  # the TP 2 engine attaches both ranks' daemons well before their first re-check
TP_AT = 1_000  # within rank 1's half of the embedding


def test_a_flip_under_rank_1_stops_a_tp2_engine(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Only rank 1's daemon holds the flipped byte and only rank 1's lease hears of it; rank 0, which serves
    HTTP for both, must turn not-ready and refuse completions all the same, naming rank 1."""
    with daemon_rig() as rig:
        bad = write_checkpoint("tiny", rig.base / "flipped-tp2", seed=0)
        preloaded = rig.cli("preload", str(bad), "--tp", "2", "--detach", "--json", "--run-dir", str(rig.run_dir),
                            "--scrub-interval", str(TP_SCRUB_INTERVAL_S),
                            env={"WCACHE_FAULT_FLIP": f"{FLIPPED}:{TP_AT}@1"})
        rig._remember_supervisors()
        assert preloaded.returncode == 0, preloaded.stderr
        rank_1 = next(r["name"] for r in json.loads(preloaded.stdout)["ranks"] if r["rank"] == 1)
        with serving(rig, bad, "--tp", "2") as server:
            assert not rig.events("scrub_failed"), "the engine must hold its leases before the first re-check"
            # Rank 1 appends its event once attached; rank 0 may say SERVING a moment before it lands.
            wait_for(lambda: len(rig.events("attach_hit")) == 2, timeout=10, what="both ranks' attach_hit events")
            assert http_status(f"{server.url}/health")[0] == 200
            found = wait_for(lambda: rig.events("scrub_failed"), timeout=TP_SCRUB_INTERVAL_S + 40,
                             what="rank 1's daemon's scrub_failed event")
            assert [(e["tensor"], e["daemon"]) for e in found] == [(FLIPPED, rank_1)], found
            code, health = wait_for(lambda: (h := http_status(f"{server.url}/health"))[0] == 503 and h, timeout=5,
                                    what="/health to turn 503")
            assert isinstance(health, dict) and health["status"] == "weights corrupt"
            assert f"on rank 1 (daemon {rank_1})" in health["corrupt"] and FLIPPED in health["corrupt"], health
            code, answer = _complete(server)
            assert code == 503 and "on rank 1" in answer["error"]["message"] and "choices" not in answer
            weights = _weights(server)
            assert weights is not None
            assert [(t["tensor"], t["rank"]) for t in weights["attach"]["corrupt"]] == [(FLIPPED, 1)]
            assert metrics(server.url)["wcache:weights_corrupt_tensors"] == 1
            # Rank 0, the command itself, announces the engine under its pid.
            (rank_0,) = [path for path in (rig.run_dir / "engines").glob("*.json")
                         if json.loads(path.read_text())["url"] == server.url]
            announced = wait_for(lambda: json.loads(rank_0.read_text())["attach"].get("corrupt"), timeout=5,
                                 what="the engine's announcement to name the tensor")
            assert [t["rank"] for t in announced] == [1]
