"""Engines announced in the run dir show in `wcache status` and `wcache top` without flags: a fallback with its
reason, a stale announcement dropped, an unanswered --scrape URL shown as unreachable; a vLLM rank finds its
server's URL from the server's command line; checkpoints are named as people know them.

The announcements here are written as a vLLM rank writes them (`EngineDescriptor`), for real processes (a
`sleep` child that runs, one that has exited); tests/test_vllm.py checks that real vLLM ranks write them.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import cli_env, wcache_in_process
from wcache.checkpoint.display_name import display_name, display_names
from wcache.integrations.vllm.announce import server_url_from_argv
from wcache.ipc.attach_summary import AttachSummary
from wcache.ipc.run_dir.engines import VLLM_ENGINE, EngineDescriptor, write_engine_descriptor

REASON = "no daemon holds key 1a2b3c4d5e6f for this checkpoint: lm_head.weight changed"


def _fallback() -> AttachSummary:
    return AttachSummary(outcome="fallback", mode="zero_copy", device="cpu", key_id="1a2b3c4d5e6f", daemon=None,
                         daemon_key_id=None, reason=REASON, mismatched=(), diff=None, timings_ms={}, bytes_mapped=0,
                         num_tensors=0, daemon_lost=False)


def _announce(run_dir: Path, pid: int, model: str) -> None:
    write_engine_descriptor(run_dir, EngineDescriptor(
        pid=pid, url=None, model=model, source=f"/models/{model}", attach=_fallback(), key_id="1a2b3c4d5e6f",
        started=time.time(), engine=VLLM_ENGINE))


@pytest.fixture(scope="module")
def announced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A run dir with a running rank that fell back, and the announcement of a rank that has exited."""
    run_dir = tmp_path_factory.mktemp("run")
    run_dir.chmod(0o700)
    exited = subprocess.Popen(["true"])
    exited.wait()
    running = subprocess.Popen(["sleep", "600"])
    try:
        _announce(run_dir, running.pid, "running-model")
        _announce(run_dir, exited.pid, "exited-model")
        yield run_dir
    finally:
        running.kill()
        running.wait()


def test_status_lists_a_fallback_with_its_reason_and_drops_an_exited_rank(announced: Path) -> None:
    result = wcache_in_process("status", "--run-dir", str(announced), "--json", env=cli_env())
    assert result.returncode == 0, result.stderr
    [engine] = json.loads(result.stdout)["engines"]
    assert (engine["kind"], engine["model"], engine["weights"], engine["up"]) == ("vllm", "running-model",
                                                                                 "fallback", True)
    assert engine["reason"] == REASON and engine["key_id"] == "1a2b3c4d5e6f"
    table = wcache_in_process("status", "--run-dir", str(announced), env=cli_env())
    assert "running-model" in table.stdout and REASON in table.stdout and "exited-model" not in table.stdout


def test_top_shows_the_fallback_row_and_an_unreachable_scrape_as_unreachable(announced: Path) -> None:
    result = wcache_in_process("top", "--once", "--json", "--interval", "0.1", "--run-dir", str(announced),
                               "--scrape", "http://127.0.0.1:1", env=cli_env())
    assert result.returncode == 0, result.stderr
    engines = {e["model"]: e for e in json.loads(result.stdout)["engines"]}
    assert set(engines) == {"running-model", "?"}, engines
    assert engines["running-model"]["reason"] == REASON
    unreachable = engines["?"]
    assert unreachable["kind"] == "unreachable" and not unreachable["up"], unreachable


def test_a_fallback_row_is_red_with_its_reason() -> None:
    from wcache.monitor.snapshot import EngineRow
    from wcache_cli.top.view import ENGINE_COLUMNS

    row = EngineRow(id="pid 1", url="", kind="vllm", model="m", up=True, weights="fallback", mode="zero_copy",
                    daemon=None, attach_ms=None, prefix_queries_total=None, prefix_hits_total=None,
                    hit_rate_interval=None, hit_rate_overall=None, adopted_hits_total=None,
                    replayed_tokens_total=None, prefill_saved_total=None, swa_cached_bytes=None, reason=REASON)
    cells = {c.label: c.cell(row, 0.0) for c in ENGINE_COLUMNS}
    assert "red" in str(cells["weights"].style) and cells["why disk"].plain == REASON
    assert "red" in str(cells["why disk"].style)


@pytest.mark.parametrize(("argv", "url"), [
    (["/venv/bin/vllm", "serve", "Org/Name", "--port", "8123"], "http://127.0.0.1:8123"),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--host", "10.0.0.5", "--port=9000"],
     "http://10.0.0.5:9000"),
    (["vllm", "serve", "m", "--host", "0.0.0.0"], "http://127.0.0.1:8000"),
    (["vllm", "serve", "m", "--uds", "/run/v.sock"], None),
    (["vllm", "serve", "m", "--config", "c.yaml"], None),
    (["python", "-c", "from multiprocessing.spawn import spawn_main"], None),
])
def test_a_rank_finds_its_servers_url_in_the_servers_command_line(argv: list[str], url: str | None) -> None:
    assert server_url_from_argv(argv) == url


def test_hub_snapshots_are_named_org_name_with_a_revision_where_two_differ() -> None:
    one = "/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/" + "a" * 40
    two = "/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/" + "b" * 40
    assert display_name(one) == "Qwen/Qwen3-0.6B" and display_name(f"{one}/model.safetensors") == "Qwen/Qwen3-0.6B"
    assert display_name("/models/small") == "small" and display_name("Org/Name") == "Org/Name"
    assert display_names([one, two, "/models/small"]) == {
        one: "Qwen/Qwen3-0.6B@aaaaaaa", two: "Qwen/Qwen3-0.6B@bbbbbbb", "/models/small": "small"}
