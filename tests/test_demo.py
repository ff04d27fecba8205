"""`wcache demo`, the README's first command, runs end to end; what it leaves running stops cleanly."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from helpers import processes_mentioning, wcache_in_process, wcache_process
from wcache_cli.commands.demo import MARKER, _fresh_dir


def test_demo_walks_the_whole_flow_and_leaves_something_for_top(tmp_path: Path) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="wc-demo-", dir="/tmp"))  # short: AF_UNIX paths are limited
    demo_dir = tmp_path / "demo"
    before = {p.pid for p in processes_mentioning("wcache-demo-", str(run_dir))}
    try:
        result = wcache_process("demo", "--dir", str(demo_dir), "--run-dir", str(run_dir), timeout=300)
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert "vLLM 0.31 header-only fingerprint" in out
        assert out.count("same key: would serve the wrong") == 2  # header-only and sampled both miss it
        assert "model.embed_tokens.weight" in out
        assert "READY" in out and "HIT" in out and "MISS" in out and "FALLBACK" in out
        # The trained original speaks; the zeroed copy does not, and a header-only key would have hidden that.
        assert "the processed weights" in out and "the zeroed copy's own weights" in out
        assert "would have been served the original's ' the processed weights" in out
        assert "attach_hit" in out and "attach_miss" in out and "fallback" in out
        assert "VERIFIED" in out and "MISMATCH" in out and "SOURCE DIFFERS" in out
        assert f"wcache top --run-dir {run_dir}" in out and "wcache demo --stop" in out
        (events_line,) = [line for line in out.splitlines() if line.startswith("Events written")]
        kept = Path(events_line.split("kept in ", 1)[1].split(")", 1)[0])
        assert [json.loads(line)["kind"] for line in kept.read_text().splitlines()][:1] == ["preload"]

        top = wcache_in_process("top", "--once", "--json", "--interval", "0.5", "--run-dir", str(run_dir))
        assert top.returncode == 0, top.stderr
        snapshot = json.loads(top.stdout)
        assert [d["state"] for d in snapshot["daemons"]] == ["ready"]
        [engine] = snapshot["engines"]
        assert engine["weights"] == "hit" and engine["hit_rate_overall"] > 0 and engine["replayed_tokens_total"] > 0
        assert any(e["kind"] == "fallback" and "model.embed_tokens.weight" in e["summary"]
                   for e in snapshot["events"])

        stopped = wcache_process("demo", "--stop", "--dir", str(demo_dir))
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped" in stopped.stdout
    finally:
        leftovers = [p for p in processes_mentioning("wcache-demo-", str(run_dir)) if p.pid not in before]
        for process in leftovers:
            process.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert not leftovers, "the demo (or its --stop) left processes running"
    # A second run may reuse the directory: it carries the demo's marker, so it is emptied, not refused.
    _fresh_dir(demo_dir)
    assert [p.name for p in demo_dir.iterdir()] == [MARKER]


def test_demo_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    result = wcache_in_process("demo", "--dir", str(foreign))
    assert result.returncode == 2
    assert (foreign / "precious.txt").read_text() == "keep me"
    assert result.stderr.count("\n") == 1 and "was not made by wcache demo" in result.stderr
