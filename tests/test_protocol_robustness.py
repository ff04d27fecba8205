"""One live daemon against raw socket clients: malformed, oversized, truncated and vanishing clients never stop
it from serving everyone else, and its counters say what happened."""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import psutil
import pytest
from daemon_fixtures import (
    LENGTH,
    DaemonRig,
    copy_checkpoint,
    daemon_rig,
    msg,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    open_fds,
    raw_connect,
    raw_frame,
    read_reply,
    read_until_closed,
    request_frame,
    wait_for,
)
from wcache.client import request_once
from wcache.protocol import MAX_FDS, MAX_FRAME_BYTES
from wcache.rundir import DaemonDescriptor


@pytest.fixture(scope="module")
def live(tiny_template: Path) -> Iterator[tuple[DaemonRig, DaemonDescriptor]]:
    with daemon_rig() as rig:
        model = copy_checkpoint(tiny_template, rig.base / "tiny")
        (daemon,) = rig.preload(model)
        yield rig, daemon


def counters(daemon: DaemonDescriptor) -> dict[str, int]:
    return dict(request_once(daemon.socket, "stats").fields["counters"])


def assert_still_serving(daemon: DaemonDescriptor) -> dict[str, int]:
    """A fresh client gets a normal `stats` reply and the daemon's pid is the same live process."""
    assert psutil.Process(daemon.pid).is_running(), "the daemon died"
    stats = request_once(daemon.socket, "stats").fields
    assert stats["pid"] == daemon.pid and stats["state"] == "ready"
    return dict(stats["counters"])


def wait_counter(daemon: DaemonDescriptor, name: str, value: int) -> None:
    try:
        wait_for(lambda: counters(daemon).get(name, 0) == value, timeout=10, what=f"counter {name} to reach {value}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; it is {counters(daemon).get(name, 0)}") from None


# -- frames that must close the connection without a reply ---------------------------------------------------

CLOSING_FRAMES: dict[str, bytes] = {
    "garbage bytes": b"\xde\xad\xbe\xef" * 8,
    "garbage with a small length": b"\x00\x00\x00\x05hello",
    "length prefix 0": LENGTH.pack(0),
    "length one past 16 MiB": LENGTH.pack(MAX_FRAME_BYTES + 1) + b"\x80",
    "length 4 GiB - 1": LENGTH.pack(0xFFFFFFFF),
    "valid length, non-msgpack body": raw_frame(b"\xc1"),
    "valid length, truncated msgpack body": raw_frame(msgpack.packb({"v": 1, "type": "stats"})[:-2]),
    "msgpack followed by extra bytes": raw_frame(msgpack.packb({"v": 1, "type": "stats"}) + b"\x01"),
    "msgpack list, not a map": msg([1, "stats"]),
    "msgpack string, not a map": msg("stats"),
    "msgpack nil": msg(None),
    "map with an integer key": msg({1: 1, "v": 1, "type": "stats"}),
    "protocol version 2": msg({"v": 2, "type": "stats"}),
    "protocol version 0": msg({"v": 0, "type": "stats"}),
    "version missing": msg({"type": "stats"}),
    "version as a string": msg({"v": "1", "type": "stats"}),
    "type missing": msg({"v": 1}),
    "type not a string": msg({"v": 1, "type": 7}),
}


@pytest.mark.parametrize("payload", list(CLOSING_FRAMES.values()), ids=list(CLOSING_FRAMES))
def test_a_bad_frame_closes_only_that_connection(live: tuple[DaemonRig, DaemonDescriptor], payload: bytes) -> None:
    _, daemon = live
    before = assert_still_serving(daemon).get("bad_frames", 0)
    bystander = raw_connect(daemon.socket)  # another client, connected all along
    with raw_connect(daemon.socket) as sock:
        sock.sendall(payload)
        assert read_until_closed(sock) == b"", "a bad frame gets no reply"
    wait_counter(daemon, "bad_frames", before + 1)
    with bystander:
        bystander.sendall(request_frame("stats"))
        assert read_reply(bystander)["type"] == "stats"
    assert_still_serving(daemon)


def test_version_must_be_the_integer_1(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    """`True == 1 == 1.0` in Python: a version check by equality accepts a boolean or a float as version 1."""
    _, daemon = live
    for version in (True, 1.0):
        before = counters(daemon).get("bad_frames", 0)
        with raw_connect(daemon.socket) as sock:
            sock.sendall(msg({"v": version, "type": "stats"}))
            answer = read_until_closed(sock, stop_at_data=True)
            assert answer == b"", f"v={version!r} was accepted as protocol version 1 (the daemon answered)"
        wait_counter(daemon, "bad_frames", before + 1)


# -- requests that get an error reply and leave the connection usable ----------------------------------------------

GOOD_KEY: dict[str, object] = {"config": "0" * 64, "plan": "0" * 64, "format": 1}
ERROR_REQUESTS: dict[str, tuple[bytes, str | None]] = {
    "unknown request type": (request_frame("frobnicate"), "unknown_requests"),
    "reply type sent as a request": (request_frame("error", message="hi"), "unknown_requests"),
    "hello without key": (request_frame("hello"), "bad_requests"),
    "hello with key as a list": (request_frame("hello", key=["config", "plan"]), "bad_requests"),
    "hello with key as a string": (request_frame("hello", key="abc"), "bad_requests"),
    "hello with a key missing plan": (request_frame("hello", key={"config": "x", "format": 1}), "bad_requests"),
    "map before hello": (request_frame("map", mode="zero_copy"), None),
    "map without mode": (request_frame("map"), "bad_requests"),
    "map with an unknown mode": (request_frame("map", mode="steal"), "bad_requests"),
    "map with mode of the wrong type": (request_frame("map", mode=1), "bad_requests"),
    "unknown request with a large body": (request_frame("frobnicate", pad=b"\0" * (8 << 20)), "unknown_requests"),
}


@pytest.mark.parametrize(("payload", "counter"), list(ERROR_REQUESTS.values()), ids=list(ERROR_REQUESTS))
def test_a_bad_request_gets_an_error_and_the_connection_stays_usable(
    live: tuple[DaemonRig, DaemonDescriptor], payload: bytes, counter: str | None
) -> None:
    _, daemon = live
    before = assert_still_serving(daemon)
    with raw_connect(daemon.socket) as sock:
        sock.sendall(payload)
        reply = read_reply(sock)
        assert reply["type"] == "error" and reply["v"] == 1
        assert isinstance(reply["message"], str) and reply["message"]
        # Same connection, next request: served normally.
        sock.sendall(request_frame("stats"))
        assert read_reply(sock)["type"] == "stats"
    after = assert_still_serving(daemon)
    if counter is not None:
        assert after.get(counter, 0) == before.get(counter, 0) + 1
    assert after.get("bad_frames", 0) == before.get("bad_frames", 0)


def test_a_hello_with_a_foreign_key_is_a_miss_not_a_map(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    _, daemon = live
    with raw_connect(daemon.socket) as sock:
        sock.sendall(request_frame("hello", key=GOOD_KEY, pid=1))
        hello = read_reply(sock)
        assert hello["type"] == "hello" and hello["status"] == "miss"
        assert set(hello["mismatched"]) == {"config", "plan"}  # format 1 is the daemon's too
        sock.sendall(request_frame("map", mode="zero_copy"))
        refused = read_reply(sock)
        assert refused["type"] == "error" and "hello" in refused["message"]
    assert_still_serving(daemon)


# -- clients that stop or vanish in the middle ------------------------------------------------------------------------

HALF = request_frame("stats")[:-3]


def _truncated_then_closed(path: str) -> None:
    with raw_connect(path) as sock:
        sock.sendall(HALF)


def _half_header_then_closed(path: str) -> None:
    with raw_connect(path) as sock:
        sock.sendall(b"\x00\x00")


def _killed_mid_frame(path: str) -> None:
    # A separate process sends half a frame and dies by SIGKILL, leaving the daemon mid-read.
    code = (
        "import os, signal, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(bytes.fromhex(sys.argv[2]))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, path, HALF.hex()], timeout=60)
    assert result.returncode == -9


VANISHING: dict[str, Callable[[str], None]] = {
    "truncated frame, then close": _truncated_then_closed,
    "half a length prefix, then close": _half_header_then_closed,
    "half a frame, then killed": _killed_mid_frame,
}


@pytest.mark.parametrize("vanish", list(VANISHING.values()), ids=list(VANISHING))
def test_a_client_vanishing_mid_frame_is_dropped_alone(
    live: tuple[DaemonRig, DaemonDescriptor], vanish: Callable[[str], None]
) -> None:
    _, daemon = live
    before = assert_still_serving(daemon).get("bad_frames", 0)
    vanish(daemon.socket)
    wait_counter(daemon, "bad_frames", before + 1)
    assert_still_serving(daemon)


def test_a_stalled_client_does_not_block_others(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    _, daemon = live
    before = assert_still_serving(daemon).get("bad_frames", 0)
    stalled = [raw_connect(daemon.socket) for _ in range(20)]
    try:
        for sock in stalled:
            sock.sendall(HALF)
        for _ in range(3):
            assert_still_serving(daemon)
    finally:
        for sock in stalled:
            sock.close()
    wait_counter(daemon, "bad_frames", before + len(stalled))


def test_a_client_that_leaves_before_its_reply(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    _, daemon = live
    for _ in range(10):
        with raw_connect(daemon.socket) as sock:
            sock.sendall(request_frame("hello", key=GOOD_KEY) + request_frame("manifest") + request_frame("stats"))
    assert_still_serving(daemon)


# -- descriptors sent to the daemon ----------------------------------------------------------------------------------


def test_descriptors_a_client_sends_are_closed_not_kept(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    _, daemon = live
    baseline = open_fds(daemon.pid)
    bad_before = counters(daemon).get("bad_frames", 0)
    with open("/dev/null") as null:
        # Up to MAX_FDS with a valid request: the daemon closes them and answers.
        with raw_connect(daemon.socket) as sock:
            socket.send_fds(sock, [request_frame("stats")], [null.fileno()] * MAX_FDS)
            assert read_reply(sock)["type"] == "stats"
        # More than MAX_FDS: the frame is refused and the connection closed.
        with raw_connect(daemon.socket) as sock:
            socket.send_fds(sock, [request_frame("stats")], [null.fileno()] * (MAX_FDS + 4))
            assert read_until_closed(sock) == b""
    wait_counter(daemon, "bad_frames", bad_before + 1)
    wait_for(lambda: open_fds(daemon.pid) <= baseline, what=f"the daemon's descriptors to return to {baseline}")


def test_many_bad_clients_leak_no_descriptors(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    _, daemon = live
    baseline = open_fds(daemon.pid)
    for payload in list(CLOSING_FRAMES.values())[:8] * 3:
        with raw_connect(daemon.socket) as sock:
            sock.sendall(payload)
            read_until_closed(sock)
    wait_for(lambda: open_fds(daemon.pid) <= baseline, what=f"the daemon's descriptors to return to {baseline}")
    assert_still_serving(daemon)


# -- too many connections ----------------------------------------------------------------------------------------------


@pytest.fixture
def flood_rig(tiny_template: Path) -> Iterator[tuple[DaemonRig, DaemonDescriptor]]:
    """A daemon of its own: this test squeezes its descriptor limit."""
    with daemon_rig() as rig:
        model = copy_checkpoint(tiny_template, rig.base / "tiny")
        (daemon,) = rig.preload(model)
        yield rig, daemon


def test_running_out_of_descriptors_does_not_kill_the_daemon(flood_rig: tuple[DaemonRig, DaemonDescriptor]) -> None:
    """A client that opens more connections than the daemon has descriptors must not take it down."""
    _, daemon = flood_rig
    process = psutil.Process(daemon.pid)
    limit = open_fds(daemon.pid) + 16
    process.rlimit(psutil.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    flood: list[socket.socket] = []
    try:
        for _ in range(limit + 32):
            with contextlib.suppress(OSError):
                flood.append(raw_connect(daemon.socket, timeout=2))
        # Give the accept loop time to hit EMFILE on the connections beyond the limit.
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not process.is_running(), timeout=2, what="")
    finally:
        for sock in flood:
            sock.close()
    assert process.is_running() and process.status() != psutil.STATUS_ZOMBIE, (
        "the daemon exited when accept() ran out of descriptors"
    )
    wait_for(lambda: open_fds(daemon.pid) < limit, what="the flood's descriptors to be closed")
    assert_still_serving(daemon)
