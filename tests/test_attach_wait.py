"""Attaching with a wait: an engine that starts before its daemon is ready hits once the daemon is up."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import (
    DaemonRig,
    daemon_rig,
    nothing_survives,  # noqa: F401
)
from wcache.attach import AttachedWeights, attach
from wcache.attach_options import AttachOptions
from wcache.errors import BadInputError
from wcache_dev.synth import write_checkpoint


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def test_attach_waits_for_a_daemon_that_comes_up(rig: DaemonRig) -> None:
    model = write_checkpoint("tiny", rig.base / "tiny")
    result: dict[str, AttachedWeights | BaseException] = {}

    def engine() -> None:
        try:
            result["weights"] = attach(model, run_dir=rig.run_dir, fallback=False, wait_s=120)
        except BaseException as exc:  # reported by the assertion below
            result["weights"] = exc

    began = time.monotonic()
    thread = threading.Thread(target=engine)
    thread.start()
    time.sleep(0.5)  # the engine is already looking when the preload starts
    [daemon] = rig.preload(model)
    thread.join(timeout=120)
    weights = result["weights"]
    assert isinstance(weights, AttachedWeights), weights
    with weights:
        assert weights.report.outcome == "hit" and weights.report.daemon == daemon.name
    assert time.monotonic() - began < 120


def test_without_a_wait_the_same_attach_misses_at_once(rig: DaemonRig) -> None:
    model = write_checkpoint("tiny", rig.base / "tiny")
    began = time.monotonic()
    with attach(model, run_dir=rig.run_dir, wait_s=0.5) as weights:
        assert weights.report.outcome == "fallback" and weights.report.reason == "no daemon runs on cpu"
    assert time.monotonic() - began < 30


@pytest.mark.parametrize(("options", "message"), [
    ({"fallbak": True}, "unknown wcache option 'fallbak' in here; the options are fallback, mode"),
    ({"mode": "mmap"}, "mode must be zero_copy or copy, not 'mmap'"),
    ({"wait_s": -1}, "wait_s must be from 0 to 86400 seconds, not -1"),
    ({"wait_s": True}, "wait_s in here cannot be True"),
    ({"fallback": "yes"}, "fallback in here cannot be 'yes'"),
    ({"daemon": 3}, "daemon in here cannot be 3"),
    # A wait that never ends, and one no float holds (float() of it raised OverflowError).
    ({"wait_s": math.nan}, "wait_s must be from 0 to 86400 seconds, not nan"),
    ({"wait_s": math.inf}, "wait_s must be from 0 to 86400 seconds, not inf"),
    ({"wait_s": 10**400}, "wait_s must be from 0 to 86400 seconds, not 1000000000"),
    ({"wait_s": 10**5000}, "not an integer of thousands of digits"),
    # vLLM hands its model_loader_extra_config over as parsed: any JSON value, not only an object.
    ([{"mode": "copy"}], "here must be a JSON object of wcache options, not [{'mode': 'copy'}]"),
    ("mode=copy", "here must be a JSON object of wcache options, not 'mode=copy'"),
    (3, "here must be a JSON object of wcache options, not 3"),
], ids=["unknown", "mode", "negative-wait", "bool-wait", "str-fallback", "int-daemon", "nan-wait", "inf-wait",
        "huge-wait", "huger-wait", "list", "string", "number"])
def test_attach_options_say_what_is_wrong(options: object, message: str) -> None:
    with pytest.raises(BadInputError) as failure:
        AttachOptions.from_mapping(options, "here")  # type: ignore[arg-type]
    assert message in str(failure.value) and len(str(failure.value)) < 200


@pytest.mark.parametrize("wait_s", [math.nan, math.inf, 10**400], ids=["nan", "inf", "huge"])
def test_attach_refuses_a_wait_without_end(wait_s: float, tmp_path: Path) -> None:
    # wcache.attach checks its wait as the integrations do, before it looks for any daemon.
    with pytest.raises(BadInputError, match="wait_s must be from 0 to 86400 seconds"):
        attach(tmp_path / "nowhere", run_dir=tmp_path, wait_s=wait_s)


def test_attach_options_round_trip() -> None:
    options = AttachOptions.from_mapping({"mode": "copy", "wait_s": 3, "run_dir": "/tmp/x"}, "here")
    assert options.wait_s == 3.0 and options.run_dir == "/tmp/x"
    assert AttachOptions.from_mapping(options.to_mapping(), "here") == options
