"""`wcache serve`'s argument check, backoff and death line, in-process: a parser shaped like vLLM's (the real one
is checked end to end in tests/test_serve_vllm.py, where the table is built from vLLM itself)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
from pathlib import Path

import pytest
from wcache.errors import BadInputError
from wcache.integrations.vllm.dev_guard import guarded
from wcache.serve.backoff import Backoff
from wcache.serve.exit_reason import death_line, how_it_ended
from wcache.serve.follow import check_follow
from wcache.serve.option_table import OptionTable, table_of
from wcache.serve.server_args import (
    EXTRA_CONFIG,
    check_port_free,
    check_restart,
    check_server_args,
    pinned_restart,
)


def union_dict_and_str(value: str) -> object:  # named as vLLM names the type it keeps bad JSON as text with
    return value


@pytest.fixture(scope="module")
def table() -> OptionTable:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--model")
    parser.add_argument("--load-format")
    parser.add_argument("--config")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host")
    parser.add_argument("--max-model-len")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--model-loader-extra-config", type=union_dict_and_str)
    parser.add_argument("--compilation-config", type=json.loads)
    table = table_of(parser, "0.32.0")
    # What the saved table holds survives its JSON round trip.
    import msgspec

    return msgspec.json.decode(msgspec.json.encode(table), type=OptionTable)


def refusal(argv: list[str], table: OptionTable) -> str:
    with pytest.raises(BadInputError) as caught:
        check_server_args(argv, table)
    return str(caught.value)


def test_good_arguments_pass_with_their_values(table: OptionTable) -> None:
    args = check_server_args(["--port", "8011", "--enforce-eager", "--max_model_len=512", "-tp", "2",
                              "--served-model-name", "a", "b", "--compilation-config.mode", "3", "-O3",
                              "--no-enforce-eager", "--model-loader-extra-config", '{"mode": "copy"}'], table)
    assert args.values == {"port": 8011, "enforce_eager": False, "max_model_len": "512", "tensor_parallel_size": 2,
                           "served_model_name": ["a", "b"], "model_loader_extra_config": {"mode": "copy",
                           "fallback": True, "trust_daemon": False, "wait_s": 0.0}}


@pytest.mark.parametrize(("argv", "sentence"), [
    (["--max-model-lenn", "5"], "vLLM's server has no option --max-model-lenn; the closest is --max-model-len."),
    (["--dtype", "bf16"], "--dtype cannot be 'bf16'; the closest is bfloat16."),
    (["--port", "80a"], "--port takes an integer, not '80a'."),
    (["--gpu-memory-utilization", "most"], "--gpu-memory-utilization takes a number, not 'most'."),
    (["--enforce-eager=1"], "--enforce-eager is a switch and takes no value (drop =1)."),
    (["--port"], "--port needs a value."),
    (["--max-num"], "--max-num needs a value."),
    (["--ma", "1"], "--ma is ambiguous among vLLM's options (--max-model-len, --max-num-seqs)."),
    (["my-model"], "'my-model' is not an option of vLLM's server"),
    (["--model", "m"], "--model is set by wcache serve: give the model as wcache serve's MODEL, before --."),
    (["--load-format=auto"], "--load-format is set by wcache serve: wcache serve always loads with --load-format "
                             "wcache."),
    (["--config", "c.yaml"], "--config is set by wcache serve"),
    (["--model-loader-extra-config", "{mode: copy}"], "--model-loader-extra-config must be a JSON object of wcache "
                                                      "options, and '{mode: copy}' is not JSON"),
    (["--model-loader-extra-config", '{"mode": "cpy"}'], "wcache option mode must be zero_copy or copy, not 'cpy'."),
    (["--model-loader-extra-config", '{"wait": 3}'], "unknown wcache option 'wait' in model_loader_extra_config"),
    (["--model-loader-extra-config.mode", "copy"], "give wcache's loader options as one JSON object "
                                                   "(--model-loader-extra-config '{\"mode\": \"copy\"}'), not one key "
                                                   "at a time (--model-loader-extra-config.mode)."),
])
def test_a_mistake_is_one_sentence(argv: list[str], sentence: str, table: OptionTable) -> None:
    said = refusal(argv, table)
    assert said.startswith(sentence), said
    assert "\n" not in said


def test_an_unknown_option_far_from_any_names_where_the_list_is(table: OptionTable) -> None:
    assert refusal(["--zzzz"], table).endswith("--help` lists them.")


def test_a_restart_keeps_the_plan_and_the_address(table: OptionTable) -> None:
    before = check_server_args(["--port", "8011", "--max-model-len", "512"], table)
    check_restart(before, check_server_args(["--port", "8011", "--max-model-len", "256"], table))
    for changed in (["--port", "8012"], ["--port", "8011", "--dtype", "float16"], ["--port", "8011", "-tp", "2"]):
        with pytest.raises(BadInputError, match="a restart keeps --"):
            check_restart(before, check_server_args(changed, table))


def test_a_restart_pinned_to_a_followed_version_keeps_the_users_loader_options(table: OptionTable) -> None:
    """A following server restarts on the version its launcher was last moved to: the loader option naming its
    daemon (trusted by config, tokenizer and plan) comes last, and passes the same check as the user's."""
    user = ["--port", "8011", "--model-loader-extra-config", '{"mode": "copy", "wait_s": 5}']
    first = check_server_args(user, table)
    argv = [*user, *pinned_restart(first.value(EXTRA_CONFIG), "cpu-0123456789ab")]
    options = check_server_args(argv, table).value(EXTRA_CONFIG)
    assert isinstance(options, dict)
    assert (options["daemon"], options["trust_daemon"], options["mode"], options["wait_s"]) == (
        "cpu-0123456789ab", True, "copy", 5.0)
    bare = check_server_args(pinned_restart(None, "cpu-0123456789ab"), table).value(EXTRA_CONFIG)
    assert isinstance(bare, dict) and (bare["daemon"], bare["mode"]) == ("cpu-0123456789ab", "zero_copy")


def test_an_address_another_process_listens_on_is_refused_before_anything_starts(table: OptionTable) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = check_server_args(["--host", "127.0.0.1", "--port", str(port)], table)
        with pytest.raises(BadInputError) as caught:
            check_port_free(args)
        assert str(caught.value) == (f"another process listens on 127.0.0.1 port {port} already; stop it or give "
                                     "the server another port (vLLM's --port).")
    check_port_free(args)  # free again


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_healthy_run() -> None:
    backoff = Backoff(first_s=1, longest_s=30, healthy_s=60)
    assert [backoff.next_delay(None) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.next_delay(5.0) == 30  # served 5 s: not healthy, still backing off
    assert backoff.next_delay(61.0) == 1  # served a minute: the series starts over
    assert backoff.next_delay(None) == 2
    backoff.reset()
    assert backoff.next_delay(None) == 1


def test_the_death_line_names_the_exit_and_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    earlier = "(APIServer pid=1) ValueError: an older server's failure\n"
    log.write_text(earlier + (
        "(EngineCore pid=12) INFO 12-05 08:07:01 [core.py:1] starting\n"
        "(EngineCore pid=12) Traceback (most recent call last):\n"
        '(EngineCore pid=12)   File "x.py", line 1, in f\n'
        "(EngineCore pid=12) ValueError: max_model_len 99999 is larger than the model's 512\n"
        "(APIServer pid=11) RuntimeError: Engine core initialization failed. See root cause above.\n"))
    start, end = len(earlier), log.stat().st_size
    assert death_line(11, 1, log, start, end) == ("the vLLM server (pid 11) exited with status 1: ValueError: "
                                                  "max_model_len 99999 is larger than the model's 512")
    log.write_text(log.read_text() + "INFO 12-05 08:07:01 [api.py:1] GET /health 200\n")
    # Killed from outside: its last lines are no reason, and only an exception would be.
    assert death_line(11, -signal.SIGKILL, log, log.stat().st_size - 10, log.stat().st_size) == (
        "the vLLM server (pid 11) was killed by SIGKILL")
    log.write_text("INFO 12-05 08:07:01 [api.py:1] address already in use\n")
    assert death_line(11, 2, log, 0, log.stat().st_size).endswith("status 2: address already in use")
    assert how_it_ended(-signal.SIGTERM) == "was killed by SIGTERM"


def test_a_validation_error_brings_the_line_that_says_what_was_wrong(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text(
        "(APIServer pid=5) Traceback (most recent call last):\n"
        '(APIServer pid=5)   File "x.py", line 3, in <module>\n'
        "(APIServer pid=5) pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "(APIServer pid=5)   Value error, max_model_len (99999) is greater than 512. [type=value_error, "
        "input_value=ArgsKwargs((), {'model': 'x'}), input_type=ArgsKwargs]\n"
        "(APIServer pid=5)     For further information visit https://errors.pydantic.dev/2.11/v/value_error\n")
    assert death_line(5, 1, log, 0, log.stat().st_size) == (
        "the vLLM server (pid 5) exited with status 1: pydantic_core._pydantic_core.ValidationError: 1 validation "
        "error for ModelConfig Value error, max_model_len (99999) is greater than 512.")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"])
def test_following_serves_on_a_loopback_host(host: str) -> None:
    check_follow(host)


@pytest.mark.parametrize(("host", "said"), [
    (None, "any of its interfaces (without vLLM's --host)"),
    ("0.0.0.0", "vLLM's --host 0.0.0.0"),
    ("::", "vLLM's --host ::"),
    ("10.1.2.3", "vLLM's --host 10.1.2.3"),
    ("example.com", "vLLM's --host example.com"),
])
def test_following_is_refused_where_others_could_switch_the_server(host: str | None, said: str) -> None:
    """--follow runs vLLM's development endpoints (a reload of any weights, for whoever reaches them)."""
    with pytest.raises(BadInputError, match=re.escape(said)):
        check_follow(host)


@pytest.mark.parametrize(("method", "path", "needs_token"), [
    ("POST", "/pause", True), ("POST", "/collective_rpc", True), ("POST", "/update_weight_version", True),
    ("POST", "/reset_prefix_cache", True), ("POST", "/some_route_a_later_vllm_adds", True), ("PUT", "/sleep", True),
    ("GET", "/health", False), ("GET", "/metrics", False), ("POST", "/v1/completions", False),
    ("POST", "/tokenize", False), ("POST", "/detokenize", False), ("HEAD", "/pause", False),
])
def test_a_following_servers_routes_that_change_its_weights_take_the_control_token(
        method: str, path: str, needs_token: bool) -> None:
    assert guarded(method, path) is needs_token
