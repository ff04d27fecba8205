"""`wcache demo`, the README's first command, runs end to end and leaves no daemon behind."""

from __future__ import annotations

from pathlib import Path

import psutil
from conftest import run_cli
from wcache_cli.commands.demo import MARKER, _fresh_dir


def _demo_processes() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "wcache.daemon" in cmdline and "wcache-demo-" in cmdline:
            found.append(process)
    return found


def test_demo_walks_the_whole_flow(tmp_path: Path) -> None:
    before = {p.pid for p in _demo_processes()}
    result = run_cli("demo", "--dir", str(tmp_path / "demo"))
    try:
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert "vLLM 0.31 header-only fingerprint" in out
        assert out.count("same key: would serve the wrong") == 2  # header-only and sampled both miss it
        assert "model.embed_tokens.weight" in out
        assert "READY" in out and "HIT" in out and "MISS" in out and "FALLBACK" in out
        assert "attach_hit" in out and "attach_miss" in out and "fallback" in out
        assert "VERIFIED" in out and "MISMATCH" in out and "SOURCE DIFFERS" in out
    finally:
        leftovers = [p for p in _demo_processes() if p.pid not in before]
        for process in leftovers:
            process.kill()
    assert not leftovers, "the demo left daemons running"
    # A second run may reuse the directory: it carries the demo's marker, so it is emptied, not refused.
    _fresh_dir(tmp_path / "demo")
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [MARKER]


def test_demo_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    result = run_cli("demo", "--dir", str(foreign))
    assert result.returncode == 2
    assert (foreign / "precious.txt").read_text() == "keep me"
    assert result.stderr.count("\n") == 1 and "was not made by wcache demo" in result.stderr
