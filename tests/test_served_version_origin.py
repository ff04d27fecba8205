"""Whether a served vLLM runs a version built from a delta, which `verify URL --greedy` must refuse to compare with
MODEL's files: from the daemon's descriptor while it runs, and from the READY it announced once it is gone (a server
keeps its arena mapped after a forced stop). The end to end case, with the daemon running, is in
`test_serve_vllm.py`."""

from __future__ import annotations

from pathlib import Path

from wcache.ipc.run_dir.directory import ensure_run_dir
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event
from wcache.vllm_served import built_from_delta_daemon


def test_a_version_built_from_a_delta_is_known_as_such_once_its_daemon_is_gone(tmp_path: Path) -> None:
    run_dir = ensure_run_dir(tmp_path / "run")
    append_event(run_dir, ev.Ready(daemon="cpu-aaaa", key_id="aaaa", parent="cpu-bbbb", parent_key_id="bbbb"))
    append_event(run_dir, ev.Ready(daemon="cpu-cccc", key_id="cccc"))
    assert built_from_delta_daemon(run_dir, "cpu-aaaa")
    assert not built_from_delta_daemon(run_dir, "cpu-cccc")
    assert not built_from_delta_daemon(run_dir, "cpu-dddd")  # never announced: nothing says so
    # The same key preloaded later from its files (it runs under the same name): its last READY names no parent.
    append_event(run_dir, ev.Ready(daemon="cpu-aaaa", key_id="aaaa"))
    assert not built_from_delta_daemon(run_dir, "cpu-aaaa")
    assert not built_from_delta_daemon(tmp_path / "no-run-dir", "cpu-aaaa")
