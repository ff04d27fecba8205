"""Resident weights re-checked: a daemon's background re-hash finds a bit flipped in its arena and says so
everywhere (event, metric, readiness probe, stats, `top`), refusing new attaches; a clean arena stays clean."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import DaemonRig, daemon_rig, http_status, nothing_survives, wait_for  # noqa: F401

FLIPPED = "model.embed_tokens.weight"  # 80 KiB in the tiny checkpoint
AT = 70_000  # past the first 64 KiB block


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def test_a_clean_arena_passes_its_rechecks(rig: DaemonRig, tiny_template: Path) -> None:
    daemon = rig.preload(tiny_template, "--scrub-interval", "0.2")[0]
    stats = wait_for(lambda: (s := rig.stats(daemon))["counters"].get("scrub_passes", 0) >= 2 and s,
                     timeout=30, what="two scrub passes")
    assert "corrupt" not in stats and stats["counters"]["scrub_bytes"] >= 2 * daemon.weights_bytes * 0.9
    assert not rig.events("scrub_failed")
    code, _ = http_status(f"{daemon.health_url}/readyz")
    assert code == 200


def test_a_flipped_bit_is_found_named_and_refused(rig: DaemonRig, tiny_template: Path) -> None:
    flip = {"WCACHE_FAULT_FLIP": f"{FLIPPED}:{AT}"}
    result = rig.cli("preload", str(tiny_template), "--detach", "--json", "--run-dir", str(rig.run_dir),
                     "--scrub-interval", "0.3", env=flip)
    rig._remember_supervisors()
    assert result.returncode == 0, result.stderr
    daemon = rig.descriptors()[0]
    event = wait_for(lambda: rig.events("scrub_failed"), timeout=30, what="the scrub_failed event")[0]
    assert event["tensor"] == FLIPPED and event["daemon"] == daemon.name
    assert event["arena_offset"] >= 0 and FLIPPED in event["reason"]
    assert event["byte"] == AT and f"at its byte {AT}" in event["reason"]  # located against the checkpoint
    # Readiness fails, naming the tensor; the metric counts it; stats carry it.
    code, body = http_status(f"{daemon.health_url}/readyz")
    assert code == 503 and FLIPPED in json.dumps(body)
    with urllib.request.urlopen(f"{daemon.health_url}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert any(line.startswith("wcache_daemon_corrupt_tensors{") and line.endswith(" 1.0")
               for line in metrics.splitlines())
    assert FLIPPED in rig.stats(daemon)["corrupt"][0]
    # A new attach is refused with the reason and falls back to disk; status --check and top say so.
    attached = rig.cli("attach", str(tiny_template), "--json", "--run-dir", str(rig.run_dir))
    report = json.loads(attached.stdout)
    assert report["outcome"] == "fallback" and "changed in memory" in report["reason"]
    checked = rig.cli("status", "--check", "--run-dir", str(rig.run_dir))
    assert checked.returncode == 3 and FLIPPED in checked.stderr
    top = rig.cli("top", "--once", "--run-dir", str(rig.run_dir))
    assert "CORRUPT WEIGHTS" in top.stdout and FLIPPED in top.stdout
