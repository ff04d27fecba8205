"""Small hostile inputs, each one sentence and a non-zero exit, never a traceback: a scrub interval that is no
interval, a version pool that is no size, a Hub id the Hub refuses, a run dir no directory can be, and a plan flag
given with `preload --from`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import assert_one_error_sentence, cli_env, wcache_in_process
from wcache.daemon.__main__ import _arguments
from wcache.daemon.argv import LoadArgs
from wcache.daemon.scrub import MAX_INTERVAL_S
from wcache.errors import BadInputError

# Preload's numbers that are no number of their kind: each refused in one sentence before anything is made.
PRELOAD_REFUSALS = [
    *(("--scrub-interval", value, "a year")
      for value in ["inf", "1e300", "nan", "-1", "-inf", str(MAX_INTERVAL_S * 2)]),
    *(("--version-pool", value, "such as 3GiB") for value in ["-1", "3 apples", "1e9", "GiB", ""]),
]


@pytest.mark.parametrize(("option", "value", "words"), PRELOAD_REFUSALS)
def test_a_preload_number_that_is_none_is_refused(option: str, value: str, words: str, tmp_path: Path,
                                                  tiny_template: Path) -> None:
    run_dir = tmp_path / "run"
    result = wcache_in_process("preload", str(tiny_template), option, value, "--detach",
                               "--run-dir", str(run_dir), env=cli_env(tmp_path / "cache"))
    assert words in assert_one_error_sentence(result, option)
    assert not run_dir.exists()  # refused before anything was made


def test_the_python_api_refuses_a_negative_version_pool(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="version_pool"):
        LoadArgs(model=tmp_path, run_dir=tmp_path, version_pool=-1)


@pytest.mark.parametrize("value", [math.inf, 1e300, math.nan, -1.0])
def test_the_python_api_and_the_daemons_refuse_it_too(value: float, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BadInputError, match="scrub_interval"):
        LoadArgs(model=tmp_path, run_dir=tmp_path, scrub_interval=value)
    # The rank's own command line: a usage error, not a daemon whose scrub thread dies of OverflowError.
    with pytest.raises(SystemExit) as exited:
        _arguments(["--model", str(tmp_path), "--run-dir", str(tmp_path), "--scrub-interval", str(value)])
    assert exited.value.code == 2
    assert "--scrub-interval" in capsys.readouterr().err


def test_the_bounds_themselves_are_intervals(tmp_path: Path) -> None:
    for value in (0.0, 0.2, MAX_INTERVAL_S):
        assert LoadArgs(model=tmp_path, run_dir=tmp_path, scrub_interval=value).scrub_interval == value


@pytest.mark.parametrize("repo_id", ["org/m.", "org/go--od", "org/go..od", "org/" + "a" * 97])
def test_a_hub_id_the_hub_refuses_is_one_sentence(repo_id: str, tmp_path: Path) -> None:
    result = wcache_in_process("key", repo_id, env={**cli_env(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")})
    assert "is neither a path nor a Hugging Face repo id" in assert_one_error_sentence(result)


def test_a_run_dir_under_a_regular_file_is_one_sentence(tmp_path: Path, tiny_template: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    run_dir = plain / "run"
    env = cli_env(tmp_path / "cache")
    result = wcache_in_process("preload", str(tiny_template), "--detach", "--run-dir", str(run_dir), env=env)
    assert "Not a directory" in assert_one_error_sentence(result, str(run_dir), "--run-dir")
    # What only reads the run dir finds nothing there, and says so without a traceback.
    for command in (("status",), ("stop", "--all"), ("top", "--once", "--interval", "0.1")):
        shown = wcache_in_process(*command, "--run-dir", str(run_dir), env=env)
        assert shown.returncode == 0 and "Traceback" not in shown.stderr + shown.stdout, shown.stderr


@pytest.mark.parametrize("command", [("preload", "MODEL", "--detach"), ("status",), ("stop", "--all"),
                                     ("top", "--once", "--interval", "0.1"), ("attach", "MODEL"), ("doctor",)])
def test_a_run_dir_with_a_nul_byte_is_one_sentence(command: tuple[str, ...], tmp_path: Path,
                                                   tiny_template: Path) -> None:
    args = [str(tiny_template) if a == "MODEL" else a for a in command]
    result = wcache_in_process(*args, "--run-dir", f"{tmp_path}/a\0b", env=cli_env(tmp_path / "cache"))
    assert result.returncode == 2, result.stderr
    assert assert_one_error_sentence(result) == (f"error: --run-dir '{tmp_path}/a\\x00b' holds a NUL byte, which no "
                                                 "path can hold.")


def test_a_path_argument_with_a_nul_byte_is_the_same_sentence(tmp_path: Path) -> None:
    result = wcache_in_process("key", f"{tmp_path}/m\0", env=cli_env(tmp_path / "cache"))
    assert result.returncode == 2, result.stderr
    assert assert_one_error_sentence(result) == (f"error: PATH '{tmp_path}/m\\x00' holds a NUL byte, which no path "
                                                 "can hold.")


def test_the_library_refuses_a_run_dir_with_a_nul_byte(tmp_path: Path) -> None:
    from wcache.ipc.run_dir.directory import RunDirError, check_run_dir, ensure_run_dir

    for check in (ensure_run_dir, check_run_dir):
        with pytest.raises(RunDirError, match="NUL byte"):
            check(tmp_path / "a\0b")


@pytest.mark.parametrize("flag", [("--tp", "2"), ("--dtype", "bfloat16"), ("--quantization", "int8"),
                                  ("--plan", "identity"), ("--device", "cpu"), ("--expected", "/dev/null"),
                                  ("--require-provenance",)])
def test_a_plan_flag_with_from_is_refused(flag: tuple[str, ...], tmp_path: Path) -> None:
    delta = tmp_path / "step.safetensors"
    result = wcache_in_process("preload", "--from", "cpu-0", "--delta", str(delta), *flag,
                               "--run-dir", str(tmp_path / "run"), env=cli_env(tmp_path / "cache"))
    assert "does not apply with --from" in assert_one_error_sentence(result, flag[0])
