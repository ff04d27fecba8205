"""Exit codes and option names, each owned once: core names options by their API name, and each front end
(`wcache`, vLLM's loader, a Python caller) words them as its user can set them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import wcache_in_process
from wcache.errors import (
    EXIT_BAD_INPUT,
    EXIT_DIFFERENCE,
    EXIT_UNAVAILABLE,
    BadInputError,
    in_words,
    marked,
    option,
)
from wcache.integrations.vllm.words import vllm_words
from wcache.plan.processing import UnsupportedPlanError

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "core" / "wcache").rglob("*.py"), *(ROOT / "cli" / "wcache_cli").rglob("*.py")])
# An exit status written as a number anywhere but errors.py, where each one is defined.
_LITERAL_EXIT = re.compile(r"(sys\.exit|os\._exit|SystemExit|Exit)\(\s*(code\s*=\s*)?\d+|exit_code\s*=\s*\d+")


def test_exit_codes_are_written_only_where_they_are_defined() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in SOURCES if path.name != "errors.py" or path.parent.name != "wcache"
             for n, line in enumerate(path.read_text().splitlines(), 1) if _LITERAL_EXIT.search(line)]
    assert found == []


def test_no_core_message_names_a_flag_of_wcache() -> None:
    """Core's messages mark options; a `--tp`-style flag in a string would reach vLLM users as is."""
    flags = _flags_of_wcache()
    leaks = []
    for path in (ROOT / "core" / "wcache").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("#") or "add_argument" in line or "argv" in path.name:
                continue
            words = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", line.split("#")[0]))
            if words & flags and '"' in line and '"""' not in line and not _COMMAND_WORD.search(line):
                leaks.append(f"{path.relative_to(ROOT)}:{n}: {stripped}")
    assert [leak for leak in leaks if not any(allowed in leak for allowed in _NOT_LEAKS)] == []


# A flag as a word of its own is a command line, no leak: a child's (the supervisor's and the ranks' argparse) or
# the `wcache preload` a miss tells its reader to run (`plan.spec.preload_command`).
_COMMAND_WORD = re.compile(r'"--[a-z-]+",')
# Nor is a `wcache` command a message tells the user to run, the provenance verdict shown in `wcache key`'s and
# `status`'s tables, which only `wcache` words, or vLLM's own --host and --port in `wcache serve`'s refusals.
_NOT_LEAKS = ("wcache key MODEL", "wcache verify --provenance", "with --expected", "wcache delta --apply",
              "vLLM's --host", "vLLM's --port")


def _flags_of_wcache() -> set[str]:
    import typer.main
    from wcache_cli.app import app

    root = typer.main.get_command(app)
    flags: set[str] = set()
    for command in root.commands.values():  # type: ignore[attr-defined]
        for param in command.params:
            flags.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
    return flags


def test_every_option_core_names_is_a_flag_of_wcache() -> None:
    from wcache_cli.words import flag_words

    named = {m.groups() for path in (ROOT / "core" / "wcache").rglob("*.py")
             for m in re.finditer(r"option\(['\"]([a-z_]+)['\"](?:,\s*(True|False))?", path.read_text())}
    assert {"layout", "tp_size", "fallback", "daemon"} <= {name for name, _ in named}
    flags = _flags_of_wcache()
    for name, switch in named:
        shown = flag_words(name, None if switch is None else switch.lower())
        assert shown in flags, (name, shown)


def test_each_front_end_words_an_option_its_own_way() -> None:
    from wcache_cli.words import cli_message

    error = UnsupportedPlanError(f"the fused plan does not know tensor 'x'; use {option('layout', 'identity')} to "
                                 f"load it by name, or {option('tp_size', 1)}, with {option('fallback', False)}.")
    assert cli_message(error) == ("the fused plan does not know tensor 'x'; use --plan identity to load it by name, "
                                  "or --tp 1, with --no-fallback.")
    assert str(error) == ('the fused plan does not know tensor \'x\'; use layout="identity" to load it by name, '
                          "or tp_size=1, with fallback=False.")
    vllm = in_words(marked(error), vllm_words)
    assert "--" not in vllm and "⟨" not in vllm
    assert "tensor_parallel_size=1" in vllm and 'model_loader_extra_config={"fallback": false}' in vllm
    assert "no vLLM argument sets it" in vllm  # the layout: vLLM picks it from the model class


def test_vllm_words_are_what_its_loader_accepts() -> None:
    """Every attach option is worded as an extra-config key the loader takes (AttachOptions.from_mapping)."""
    import json

    from wcache.attach_options import AttachOptions

    assert vllm_words("mode", "copy") == 'model_loader_extra_config={"mode": "copy"}'
    assert vllm_words("daemon", None) == 'model_loader_extra_config key "daemon"'
    for name, value in [("mode", "copy"), ("fallback", "false"), ("trust_daemon", "true"), ("wait_s", "30")]:
        extra = json.loads(vllm_words(name, value).split("=", 1)[1])
        assert AttachOptions.from_mapping(extra, "model_loader_extra_config").to_mapping()[name] == extra[name]


def test_a_rank_error_keeps_its_options_marked_across_processes() -> None:
    """The status line and a TP rank's report carry `marked(error)`: the CLI still names the flag."""
    from wcache.daemon.launch import PreloadFailedError

    error = BadInputError(f"4 attention heads cannot be split evenly across {option('tp_size', 3)}.")
    crossed = PreloadFailedError.of(f"rank 0: {marked(error)}", error.exit_code)
    from wcache_cli.words import cli_message

    assert cli_message(crossed) == "rank 0: 4 attention heads cannot be split evenly across --tp 3."


@pytest.mark.parametrize(("code", "kind"), [(EXIT_BAD_INPUT, "PreloadBadInputError"),
                                            (EXIT_DIFFERENCE, "PreloadRefusedError"),
                                            (EXIT_UNAVAILABLE, "PreloadFailedError"),
                                            (1234, "PreloadFailedError")])
def test_a_preload_failure_has_its_exit_code_by_class(code: int, kind: str) -> None:
    from wcache.daemon import launch

    error = launch.PreloadFailedError.of("rank 0: it failed.", code)
    assert type(error).__name__ == kind and "exit_code" not in vars(error)
    assert error.exit_code == (code if code != 1234 else EXIT_UNAVAILABLE)


def test_the_cli_names_the_flag_a_plan_check_refuses(tiny_template: Path, tmp_path: Path) -> None:
    result = wcache_in_process("attach", str(tiny_template), "--tp", "2", "--plan", "identity", "--prompt", "hi",
                               "--run-dir", str(tmp_path / "run"))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: the identity plan holds unsharded weights; use --tp 1 or --plan fused."], result.stderr


def test_the_scrub_interval_help_states_the_daemons_own_default() -> None:
    """The CLI may not import the daemon package to read it (its start would grow), so a test keeps the two
    equal."""
    import typer.main
    from wcache.daemon.argv import LoadArgs
    from wcache_cli.app import app

    preload = typer.main.get_command(app).commands["preload"]  # type: ignore[attr-defined]
    [param] = [p for p in preload.params if p.name == "scrub_interval"]
    assert f"[default: the daemons' own, {LoadArgs.scrub_interval:g}]" in param.help
