"""Every protocol message, status-pipe event and the descriptor round-trip through their wire form, and bad
input is refused with the protocol's own error: frames through a real socketpair and the protocol's own
send/receive, replies through a real client connection."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from wcache.checkpoint.manifest import TensorDigest
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.wire import messages as wire
from wcache.ipc.wire import status_pipe as pipe
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.framing import (
    HEADER,
    PROTOCOL_VERSION,
    REPLY_LIMITS,
    REQUEST_LIMITS,
    Limits,
    ProtocolError,
    receive,
)
from wcache.key.cache_key import WeightCacheKey
from wcache.plan.spec import PlanSpec
from wcache.schema import SchemaError

KEY = WeightCacheKey(checkpoint="c" * 64, config="f" * 64, tokenizer="t" * 64, plan="p" * 64, format=1)
PLAN = PlanSpec(tp_size=2, tp_rank=1, dtype="bfloat16")
RELEASED = wire.ReleasedTo(at="2025-01-01T00:00:00+00:00", client_pid=4242)
SUMMARY = wire.DaemonSummary(name="cpu-abc", key_id="abc", key=KEY, plan=PLAN, config={"model_type": "llama"},
                        source="/models/tiny", device="cpu", state="released", released=RELEASED)
STATS = wire.StatsReply(name="cpu-abc", pid=7, device="cpu", tp_size=2, tp_rank=1, key_id="abc", source="/models/tiny",
                   state="ready", holds_weights=True, weights_bytes=1024, leases=2, uptime_s=1.5, load_s=0.25,
                   counters={"hits": 3, "misses_plan": 1}, connections=4, release_queued=False, released=None)
CUDA = wire.CudaHandle(handle=b"\x01" * 64, storage_size=4096, storage_offset=0, ref_counter_handle=b"r",
                  ref_counter_offset=8, event_handle=b"", event_sync_required=True, total_bytes=4096)

REQUESTS: list[wire.Message] = [
    wire.Hello(key=wire.WantedKey.of(KEY), pid=123, dp_size=2),
    # --trust-daemon: no checkpoint, no pid
    wire.Hello(key=wire.WantedKey(config=KEY.config, tokenizer=KEY.tokenizer, plan=KEY.plan, format=1)),
    wire.Manifest(),
    wire.MapRequest("zero_copy"),
    wire.MapRequest("copy"),
    wire.Release(),
    wire.CheckArena(),
    wire.Stats(),
    wire.Shutdown(force=True),
    wire.Shutdown(),
]
REPLIES: list[wire.Message] = [
    wire.ErrorReply("say hello with a matching key before asking for a map"),
    wire.HelloReply(status="miss", mismatched=("checkpoint", "plan"), daemon=SUMMARY),
    wire.ManifestReply(tensors=(TensorDigest("w", "BF16", (2, 3), 12, "d" * 64),), daemon=SUMMARY),
    wire.MapReply(kind="memfd", total_bytes=64, entries=[("w", "bfloat16", (2, 3), 0, 12)]),
    wire.MapReply(kind="cuda", total_bytes=4096, entries=[], cuda=CUDA),
    wire.ReleaseReply(state="ready", release_queued=True),
    wire.ArenaReport(checked=5, changed=("w",)),
    STATS,
    wire.ShutdownReply(stopping=False, leases=1),
]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    with a, b:
        yield a, b


def through(pair: tuple[socket.socket, socket.socket], message: wire.Message, limits: Limits) -> wire.Message:
    """`message` sent as a frame on one end, received on the other and read back as its own type."""
    a, b = pair
    wire.send(a, message, limits)
    frame = receive(b, limits)
    return wire.read_request(frame) if limits is REQUEST_LIMITS else wire.read_reply(frame)


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_survives_a_real_frame(pair: tuple[socket.socket, socket.socket], message: wire.Message) -> None:
    assert through(pair, message, REQUEST_LIMITS) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_survives_a_real_frame(pair: tuple[socket.socket, socket.socket], message: wire.Message) -> None:
    assert through(pair, message, REPLY_LIMITS) == message


def test_the_wire_form_is_a_tagged_map_of_the_fields() -> None:
    """A frame's body is the message's fields and its tag, `type`; fields at their default are left out."""
    hello = wire.Hello(key=wire.WantedKey(config="f", tokenizer="t", plan="p", format=1), pid=5)
    assert msgpack.unpackb(wire.encode(hello, REQUEST_LIMITS)[HEADER.size:]) == {
        "type": "hello", "key": {"config": "f", "tokenizer": "t", "plan": "p", "format": 1}, "pid": 5}
    assert wire.MapReply(kind="memfd", total_bytes=1, entries=[]).to_wire() == {"kind": "memfd", "total_bytes": 1,
                                                                           "entries": []}
    assert wire.HelloReply("hit", (), SUMMARY).to_wire()["daemon"]["key"] == {
        "checkpoint": KEY.checkpoint, "config": KEY.config, "tokenizer": KEY.tokenizer, "plan": KEY.plan, "format": 1}
    assert wire.HelloReply("hit", (), SUMMARY).to_wire()["daemon"]["plan"] == {"tp_size": 2, "tp_rank": 1,
                                                                          "dtype": "bfloat16"}
    digest = TensorDigest("w", "F32", (1,), 4, "d")
    assert list(wire.ManifestReply((digest,), SUMMARY).to_wire()["tensors"]) == [
        {"name": "w", "dtype": "F32", "shape": (1,), "nbytes": 4, "digest": "d"}]
    assert set(STATS.to_wire()) == {
        "name", "pid", "device", "tp_size", "tp_rank", "key_id", "source", "state", "holds_weights",
        "weights_bytes", "leases", "uptime_s", "load_s", "counters", "connections", "release_queued", "released"}


def test_descriptors_never_travel_in_a_map_replys_fields(pair: tuple[socket.socket, socket.socket]) -> None:
    """`fds` is filled from the frame's SCM_RIGHTS; a reply naming descriptors in its fields is refused."""
    a, b = pair
    a.sendall(raw(msgpack.packb({"type": "map", "kind": "memfd", "total_bytes": 1, "entries": [], "fds": [0]})))
    with pytest.raises(ProtocolError, match=r"MapReply\.fds"):
        wire.MapRequest("copy").reply_from(receive(b, REPLY_LIMITS))


def test_a_map_reply_brings_its_descriptor_through_the_socket(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    read_end, write_end = os.pipe()
    try:
        wire.send(a, wire.MapReply(kind="memfd", total_bytes=3, entries=[]), REPLY_LIMITS, (write_end,))
        reply = wire.MapRequest("copy").reply_from(receive(b, REPLY_LIMITS))
        assert reply.kind == "memfd" and len(reply.fds) == 1
        os.write(reply.fds[0], b"abc")
        os.close(reply.fds[0])
        assert os.read(read_end, 3) == b"abc"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_trusted_hello_compares_every_field_but_the_checkpoint() -> None:
    trusted = wire.WantedKey(config=KEY.config, tokenizer=KEY.tokenizer, plan=KEY.plan, format=KEY.format)
    assert trusted.mismatched_fields(KEY) == []
    other = WeightCacheKey(checkpoint="x" * 64, config=KEY.config, tokenizer=KEY.tokenizer, plan="q" * 64,
                           format=KEY.format)
    assert trusted.mismatched_fields(other) == ["plan"]
    assert wire.WantedKey.of(KEY).mismatched_fields(other) == ["checkpoint", "plan"]


MALFORMED: dict[str, tuple[type[wire.Message], Any, str]] = {
    "not a map": (wire.Stats, [1, 2], "Stats: expected `object`, got `array`"),
    "a missing field": (wire.MapRequest, {}, "missing required field `mode`"),
    "an extra field": (wire.Stats, {"verbose": True}, "unknown field `verbose`"),
    "a mode outside the protocol": (wire.MapRequest, {"mode": "mmap"}, "MapRequest.mode: invalid enum value 'mmap'"),
    "a mode of the wrong type": (wire.MapRequest, {"mode": 1}, "MapRequest.mode: expected `str`, got `int`"),
    "a bool for a pid": (
        wire.Hello, {"key": wire.WantedKey.of(KEY).to_wire(), "pid": True},
        "Hello.pid: expected `int | null`, got `bool`"),
    "a float for a pid": (
        wire.Hello, {"key": wire.WantedKey.of(KEY).to_wire(), "pid": 1.0},
        "Hello.pid: expected `int | null`, got `float`"),
    "a hello without a plan": (
        wire.Hello, {"key": {"config": "f", "tokenizer": "t", "format": 1}},
        "Hello.key: object missing required field `plan`"),
    "an extra field in the key": (
        wire.Hello, {"key": {**wire.WantedKey.of(KEY).to_wire(), "salt": 1}}, "unknown field `salt`"),
    "a key of the wrong type": (wire.Hello, {"key": {"config": 1, "plan": "p", "format": 1}}, "Hello.key.config"),
    "a force that is a number": (wire.Shutdown, {"force": 1}, "Shutdown.force: expected `bool`, got `int`"),
    "a string for a count": (
        wire.ShutdownReply, {"stopping": True, "leases": "1"}, "ShutdownReply.leases: expected `int`, got `str`"),
    "a status outside the protocol": (wire.HelloReply, {**REPLIES[1].to_wire(), "status": "maybe"}, "status"),
    "a plan the plan refuses": (
        wire.HelloReply, {**REPLIES[1].to_wire(), "daemon": {**SUMMARY.to_wire(), "plan": {"tp_size": 0}}},
        "HelloReply.daemon.plan: tp_size must be at least 1"),
    "a manifest entry of the wrong shape": (
        wire.ManifestReply, {"tensors": [{"name": "w"}], "daemon": SUMMARY.to_wire()}, "ManifestReply.tensors[0]"),
    "an extra field in a manifest entry": (
        wire.ManifestReply, {"tensors": [{**REPLIES[2].to_wire()["tensors"][0], "x": 1}], "daemon": SUMMARY.to_wire()},
        "unknown field `x`"),
    "counters that are not counts": (
        wire.StatsReply, {**STATS.to_wire(), "counters": {"hits": "3"}}, "StatsReply.counters[...]: expected `int`"),
    "a list that is not one": (
        wire.ArenaReport, {"checked": 1, "changed": "w"}, "ArenaReport.changed: expected `array`, got `str`"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_malformed_fields_raise_the_protocols_error(case: str) -> None:
    kind, data, words = MALFORMED[case]
    with pytest.raises(ProtocolError) as raised:
        kind.from_wire(data)
    message = str(raised.value)
    assert words in message and "\n" not in message


def test_a_wrong_protocol_version_is_refused_before_any_type(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    body = msgpack.packb({"type": "stats"})
    a.sendall(HEADER.pack(PROTOCOL_VERSION + 1, len(body)) + body)
    with pytest.raises(ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}"):
        receive(b, REQUEST_LIMITS)


def raw(body: bytes) -> bytes:
    return HEADER.pack(PROTOCOL_VERSION, len(body)) + body


def fake_daemon(tmp: Path, answer: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    """A one-connection daemon on a real Unix socket that answers its first request with `answer`."""
    path = str(tmp / "d.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                receive(conn, REQUEST_LIMITS)
                answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return path, thread


MALFORMED_REPLIES: dict[str, dict[str, Any]] = {
    "missing fields": {"type": "stats", "state": "ready"},
    "a field of the wrong type": {"type": "stats", **STATS.to_wire(), "leases": "two"},
    "another reply type": {"type": "map", "kind": "memfd", "total_bytes": 1, "entries": []},
    "an error without its message": {"type": "error"},
    "no reply at all": {"type": "frobnicate"},
}


@pytest.mark.parametrize("case", MALFORMED_REPLIES, ids=str)
def test_a_malformed_reply_is_one_daemon_error_sentence(tmp_path: Path, case: str) -> None:
    body = msgpack.packb(MALFORMED_REPLIES[case], use_bin_type=True)
    path, thread = fake_daemon(tmp_path, lambda conn: conn.sendall(raw(body)))
    with DaemonConnection(path) as connection, pytest.raises(DaemonError) as raised:
        connection.request(wire.Stats())
    thread.join(timeout=5)
    message = str(raised.value)
    assert message.startswith(f"the daemon at {path} ") and message.endswith(".") and "\n" not in message
    assert "malformed reply to stats" in message


def test_an_error_reply_is_the_daemons_sentence(tmp_path: Path) -> None:
    path, thread = fake_daemon(tmp_path, lambda conn: conn.sendall(
        wire.encode(wire.ErrorReply("this daemon holds no weights"), REPLY_LIMITS)))
    with DaemonConnection(path) as connection, pytest.raises(DaemonError, match="refused stats: this daemon holds"):
        connection.request(wire.Stats())
    thread.join(timeout=5)


# -- the status pipe and the descriptor ----------------------------------------------------------------

RANK_READY = pipe.RankReady(rank=1, name="cpu-abc", key_id="abc", socket="/run/x.sock", weights_bytes=9, load_s=0.5)
EVENTS: list[tuple[Any, tuple[Any, ...]]] = [
    (pipe.Progress(done=1, total=10, files=2, rank=0), pipe.FROM_RANK),
    (pipe.Progress(done=5, total=10), pipe.FROM_SUPERVISOR),
    (RANK_READY, pipe.FROM_RANK),
    (pipe.GroupReady(seconds=1.25, health_url="http://127.0.0.1:1", ranks=(RANK_READY,)), pipe.FROM_SUPERVISOR),
    (pipe.Exists(reason="daemon x already serves this key."), pipe.FROM_SUPERVISOR),
    (pipe.Failed(reason="rank 0: no such file.", exit_code=2, rank=0), pipe.FROM_RANK),
]


@pytest.mark.parametrize("event,kinds", EVENTS, ids=lambda e: type(e).__name__ if not isinstance(e, tuple) else "")
def test_every_status_event_survives_a_real_pipe(event: Any, kinds: tuple[Any, ...]) -> None:
    read_end, write_end = os.pipe()
    with os.fdopen(read_end) as reader, os.fdopen(write_end, "w") as writer:
        pipe.StatusWriter(writer).emit(event)
        writer.close()
        assert pipe.parse_line(reader.readline(), kinds) == event


def test_status_lines_that_are_no_event_are_skipped_and_bad_events_refused() -> None:
    assert pipe.parse_line("Loading weights...\n", pipe.FROM_RANK) is None
    assert pipe.parse_line("[1, 2]\n", pipe.FROM_RANK) is None
    with pytest.raises(ProtocolError, match="RankReady: object missing required field"):
        pipe.parse_line(json.dumps({"event": "ready", "rank": 0}), pipe.FROM_RANK)
    with pytest.raises(ProtocolError, match="'hello' is not one of"):
        pipe.parse_line(json.dumps({"event": "hello"}), pipe.FROM_SUPERVISOR)


DESCRIPTOR = DaemonDescriptor(
    name="cpu-abc", pid=7, pid_created=1.5, device="cpu", tp_size=2, tp_rank=1, key_id="abc", key=KEY, plan=PLAN,
    config=None, source="/models/tiny", socket="/run/x.sock", health_url=None, supervisor_pid=6,
    started="2025-01-01T00:00:00+00:00", weights_bytes=9,
)


def test_the_descriptor_round_trips_through_json_with_its_key_typed() -> None:
    again = DaemonDescriptor.from_wire(json.loads(json.dumps(DESCRIPTOR.to_wire())))
    assert again == DESCRIPTOR and isinstance(again.key, WeightCacheKey) and again.plan == PLAN
    assert DESCRIPTOR.to_wire()["key"] == {"checkpoint": KEY.checkpoint, "config": KEY.config,
                                           "tokenizer": KEY.tokenizer, "plan": KEY.plan,
                                           "format": 1}


@pytest.mark.parametrize("change,words", [
    ({"pid": 0}, "not a process id"),
    ({"pid": True}, "DaemonDescriptor.pid: expected `int`, got `bool`"),
    ({"key": {"checkpoint": "c"}}, "DaemonDescriptor.key: object missing required field `config`"),
    ({"health_url": 5}, "DaemonDescriptor.health_url: expected `str | null`, got `int`"),
    ({"salt": 1}, "unknown field `salt`"),
], ids=str)
def test_a_bad_descriptor_is_refused(change: dict[str, Any], words: str) -> None:
    with pytest.raises(SchemaError, match=words):
        DaemonDescriptor.from_wire({**DESCRIPTOR.to_wire(), **change})
