"""Each documented JSON output (`verify --json`, `top --json`, `status --json`, `doctor --json`) is what its
schema writes: the command's stdout decodes through the schema, strictly, and the schema writes it back byte
for byte. docs/json-outputs.md lists their fields from the same schemas (test_docs_fresh checks it is fresh).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
from helpers import cli_env, wcache_in_process
from wcache.doctor import DoctorOutput
from wcache.monitor.snapshot import Snapshot
from wcache.monitor.status_output import StatusOutput
from wcache.verify import VerifyOutput
from wcache_dev.docgen import json_outputs, json_outputs_page
from wcache_dev.synth import write_checkpoint
from wcache_dev.top_sample import sample_snapshot


def _written_back(kind: type[msgspec.Struct], stdout: str) -> Any:
    """`stdout` (one indented JSON document, as `out.json` prints it) decoded strictly as `kind`, asserting that
    the schema writes it back to the same bytes."""
    decoded = msgspec.json.decode(stdout, type=kind, strict=True)
    assert msgspec.json.format(msgspec.json.encode(decoded), indent=2).decode() + "\n" == stdout
    return decoded


def test_every_documented_output_has_its_schema() -> None:
    assert [command for command, _ in json_outputs()] == ["wcache verify --json", "wcache top --json",
                                                          "wcache status --json", "wcache doctor --json"]
    assert {schema for _, schema in json_outputs()} == {VerifyOutput, Snapshot, StatusOutput, DoctorOutput}


def test_a_fields_words_are_its_schemas_comment() -> None:
    # One owner: the comment beside (or above) a field in its schema is what the page says of it; pragmas for
    # the type checker are left out, and a module's docstring restates none of it.
    import wcache.monitor.snapshot

    page = json_outputs_page()
    assert "- `severity`: string: info | warning | error\n" in page
    assert ('- `rates`: string: "interval": rates are deltas over the last interval; "cumulative": only one sample '
            "yet, so rates are null and totals are since start\n") in page
    assert "- `engines`: list of [StatusEngine](#statusengine): top's engine rows" in page
    assert "type: ignore" not in page
    assert "loaded_fraction" not in (wcache.monitor.snapshot.__doc__ or "")


def test_doctor_json_is_written_by_its_schema(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    result = wcache_in_process("doctor", "--run-dir", str(run_dir), "--json", env=cli_env())
    assert result.returncode in (0, 1), result.stderr
    doctor = _written_back(DoctorOutput, result.stdout)
    assert doctor.findings and doctor.ok == all(f.status != "fail" for f in doctor.findings)


def test_status_and_top_json_are_written_by_their_schemas(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    status = wcache_in_process("status", "--run-dir", str(run_dir), "--json", env=cli_env())
    assert status.returncode == 0, status.stderr
    assert _written_back(StatusOutput, status.stdout).run_dir == str(run_dir)
    top = wcache_in_process("top", "--run-dir", str(run_dir), "--once", "--json", "--interval", "0.1",
                            env=cli_env())
    assert top.returncode == 0, top.stderr
    assert _written_back(Snapshot, top.stdout).schema == "wcache.top/1"


def test_a_full_top_snapshot_reads_back_through_its_schema() -> None:
    """Every kind of row (daemons loading and gone, engines of both kinds, servers, events): the sample feed's
    documents decode strictly and hold the same values (the sample writes whole numbers where rates are due)."""
    for step in range(3):
        document = sample_snapshot(step).to_json()
        decoded = msgspec.convert(document, Snapshot, strict=True)
        assert decoded.daemons and decoded.engines and decoded.servers and decoded.events
        assert msgspec.to_builtins(decoded) == document


def test_verify_json_is_written_by_its_schema(tmp_path: Path) -> None:
    model = write_checkpoint("tiny", tmp_path / "tiny")
    result = wcache_in_process("verify", str(model), "--provenance", "--json", env=cli_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    verify = _written_back(VerifyOutput, result.stdout)
    assert verify.ok and verify.provenance is not None and verify.content is None and verify.greedy is None
    assert {f.name for f in verify.provenance.files} >= {"config.json"}
    assert "content" not in json.loads(result.stdout)  # a report not asked for is left out, not null

