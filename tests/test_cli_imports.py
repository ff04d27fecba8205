"""Short commands start fast because they import only what they use (issue 11).

Each case runs the real CLI entry point (`wcache_cli.main:main`, what the console script calls) in a fresh
interpreter and records `sys.modules` when that interpreter exits: `--help` and `status` must not load torch,
the daemon or engine packages, Textual, prometheus-client or psutil, and `key` must not load torch. None of them may
load pydantic, which Typer would import to convert option values (see wcache_cli.coercion); that converter is
also checked against Typer's own, value by value. No timings are asserted here: benchmarks/cli_startup.py
measures them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer.main
from helpers import loaded_of, modules_after_cli
from typer._coercion import build_runtime_param
from wcache_cli.app import app
from wcache_cli.coercion import _PlainFirst
from wcache_dev.synth import write_checkpoint

NOT_FOR_HELP_OR_STATUS = (
    "torch", "wcache.daemon", "wcache.engine", "textual", "prometheus_client", "pydantic", "psutil",
)
# A command imports its own module, not every command's (the app's command table is lazy); with no daemon in the
# run dir, status needs no wire client, no engine registry and no digest store.
NOT_FOR_EMPTY_STATUS = (
    *NOT_FOR_HELP_OR_STATUS, "wcache_cli.commands.attach", "wcache_cli.commands.preload", "wcache.integrations",
    "wcache.ipc.wire.client", "wcache.ipc.wire.framing", "wcache.key.digest_store", "wcache.monitor.snapshot",
)
# With a daemon, status reads its descriptor, asks it over the wire and probes its health server, and needs no
# more: not the checkpoint's file rules or provenance checks behind the descriptor's key type, not http.client
# (ssl, email) or the idna codec for the probe, not the plan and attach options that other commands' choices are
# made of, nor a thread pool for one daemon; its table (no --json) needs none of `top`'s rows, nor the key
# renderings, either.
NOT_FOR_STATUS_WITH_A_DAEMON = (
    *NOT_FOR_HELP_OR_STATUS, "wcache_cli.commands.attach", "wcache_cli.commands.preload", "wcache_cli.choices",
    "wcache.attach_options", "wcache.monitor.logs", "wcache.checkpoint.files", "wcache.checkpoint.companions",
    "wcache.checkpoint.provenance", "wcache.key.digest_store", "http.client", "ssl", "email", "encodings.idna",
    "concurrent.futures",
)
NOT_FOR_KEY = ("torch", "wcache.daemon", "wcache.engine", "pydantic")
# A shell completing a daemon id runs `wcache` on every TAB: the run dir census (psutil), nothing more.
NOT_FOR_COMPLETION = ("torch", "wcache.daemon", "wcache.engine", "textual", "prometheus_client", "pydantic")


def test_help_imports_no_machinery(tmp_path: Path) -> None:
    result, modules = modules_after_cli(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    assert "status" in result.stdout
    assert loaded_of(modules, NOT_FOR_HELP_OR_STATUS) == []


def test_status_of_an_empty_run_dir_imports_no_machinery(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    result, modules = modules_after_cli(tmp_path, "status", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "No daemons" in result.stdout
    assert loaded_of(modules, NOT_FOR_EMPTY_STATUS) == []


def test_status_with_a_daemon_imports_only_what_it_shows(tmp_path: Path, tiny_template: Path) -> None:
    from daemon_fixtures import preloaded_tiny

    with preloaded_tiny(tiny_template) as (rig, _, daemon):
        result, modules = modules_after_cli(tmp_path, "status", "--json", env=rig.env)
        table, table_modules = modules_after_cli(tmp_path, "status", env=rig.env)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["daemons"]
    assert (row["name"], row["state"], row["health_status"]) == (daemon.name, "ready", 200)
    assert loaded_of(modules, NOT_FOR_STATUS_WITH_A_DAEMON) == []
    assert table.returncode == 0 and daemon.name in table.stdout, table.stderr
    table_only = ("wcache.monitor.snapshot", "wcache_cli.render")
    assert loaded_of(table_modules, (*NOT_FOR_STATUS_WITH_A_DAEMON, *table_only)) == []


def test_completing_a_daemon_id_imports_no_torch(tmp_path: Path) -> None:
    from daemon_fixtures import daemon_rig

    with daemon_rig() as rig:
        daemon = rig.publish_stand_in()
        shell = {"_WCACHE_COMPLETE": "complete_bash", "COMP_WORDS": "wcache stop ", "COMP_CWORD": "2"}
        result, modules = modules_after_cli(tmp_path, env={**rig.env, **shell})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [daemon.name]
    assert loaded_of(modules, NOT_FOR_COMPLETION) == []


def test_key_imports_no_torch(tmp_path: Path) -> None:
    model = write_checkpoint("tiny", tmp_path / "tiny")
    for _ in range(2):  # cold (hashes every shard), then from the digest store
        result, modules = modules_after_cli(tmp_path, "key", str(model), "--tp", "1", "--dtype", "float32")
        assert result.returncode == 0, result.stderr
        assert "checkpoint" in result.stdout
        assert loaded_of(modules, NOT_FOR_KEY) == []


# Values a user or a default may hand an option: plain ones and every kind Typer has to refuse or re-read.
VALUES: tuple[Any, ...] = (
    None, "", "0", "1", "2", "-1", "+1", " 1", "01", "1_0", "1.5", ".5", "5.", "1e3", "inf", "nan", "१", "abc",
    "auto", "AUTO", "float16", "bfloat16", "zero_copy", "copy", "fused", "identity", "none", "int8", "info", "json",
    "text", "vllm", "/", "/nonexistent/x", "~/x", "a\x00b", "0.1", "100000000000000000000", b"x", 0, 1, 2.5, True,
    Path("p"),
)


def _outcome(converter: Any, value: Any, param: Any, ctx: Any) -> tuple[Any, ...]:
    try:
        converted = converter.coerce(value, param=param, ctx=ctx)
    except Exception as exc:  # the comparison is the point: same exception, same words
        return ("error", type(exc).__name__, str(getattr(exc, "message", exc)))
    return ("value", type(converted), converted)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_plain_value_converter_agrees_with_typer(value: Any) -> None:
    group = typer.main.get_command(app)
    ctx = group.make_context("wcache", ["status"], resilient_parsing=True)
    commands = [group, *group.commands.values()]
    params = [p for command in commands for p in command.params if hasattr(p, "type_descriptor")]
    assert params and all(isinstance(p._runtime_param, _PlainFirst) for p in params)
    for param in params:
        ours = _outcome(param._runtime_param, value, param, ctx)
        typers = _outcome(build_runtime_param(param.type_descriptor), value, param, ctx)
        if ours[:2] == ("error", "BadInputError"):  # the one error worded here: a path holding a NUL byte
            assert value == "a\x00b" and "holds a NUL byte" in ours[2] and "null byte" in typers[2], (ours, typers)
            continue
        # repr: a float option's "nan" converts to nan on both sides, and nan equals nothing, not even itself.
        assert ours == typers or repr(ours) == repr(typers), (param.name, value)


def test_attach_that_only_reports_imports_no_torch(tmp_path: Path) -> None:
    from daemon_fixtures import daemon_rig

    with daemon_rig() as rig:
        model = write_checkpoint("tiny", rig.base / "tiny")
        rig.preload(model)
        for mode in ("zero_copy", "copy"):  # a hit maps nothing and makes no tensor when only the report is asked
            result, modules = modules_after_cli(tmp_path, "attach", str(model), "--mode", mode, "--no-fallback",
                                             "--json", "--run-dir", str(rig.run_dir))
            assert result.returncode == 0, result.stderr
            report = json.loads(result.stdout)
            assert (report["outcome"], report["num_tensors"]) == ("hit", 35)
            assert loaded_of(modules, ("torch",)) == []
