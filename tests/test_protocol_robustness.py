"""One live daemon against raw socket clients: malformed, oversized, truncated and vanishing clients never stop
it from serving everyone else, and its counters say what happened."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import psutil
import pytest
from as_nobody import run_as_nobody
from daemon_fixtures import (
    DaemonRig,
    msg,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    open_fds,
    preloaded_tiny,
    raw_connect,
    raw_frame,
    read_reply,
    read_until_closed,
    request_frame,
    wait_for,
)
from wcache.attach import attach
from wcache.daemon.server import MAX_CLIENTS
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.wire.client import DaemonConnection, DaemonError, request_once
from wcache.ipc.wire.framing import HEADER, MAX_FDS, PROTOCOL_VERSION, REQUEST_LIMITS
from wcache.ipc.wire.messages import Hello, MapRequest, Stats, WantedKey
from wcache.key.cache_key import FORMAT_VERSION


@pytest.fixture(scope="module")
def live(tiny_template: Path) -> Iterator[tuple[DaemonRig, DaemonDescriptor]]:
    with preloaded_tiny(tiny_template) as (rig, _, daemon):
        yield rig, daemon


def counters(daemon: DaemonDescriptor) -> dict[str, int]:
    return dict(request_once(daemon.socket, Stats()).counters)


def assert_still_serving(daemon: DaemonDescriptor) -> dict[str, int]:
    """A fresh client gets a normal `stats` reply and the daemon's pid is the same live process."""
    assert psutil.Process(daemon.pid).is_running(), "the daemon died"
    stats = request_once(daemon.socket, Stats()).to_wire()
    assert stats["pid"] == daemon.pid and stats["state"] == "ready"
    return dict(stats["counters"])


def wait_counter(daemon: DaemonDescriptor, name: str, value: int) -> None:
    try:
        wait_for(lambda: counters(daemon).get(name, 0) == value, timeout=10, what=f"counter {name} to reach {value}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; it is {counters(daemon).get(name, 0)}") from None


# -- frames that must close the connection without a reply ---------------------------------------------------

V = PROTOCOL_VERSION
# What the previous protocol (1) wrote: a 4-byte length, then a map with its version in "v".
_PREVIOUS_BODY = msgpack.packb({"v": 1, "type": "stats"})
PREVIOUS_VERSION_FRAME = struct.pack("!I", len(_PREVIOUS_BODY)) + _PREVIOUS_BODY
CLOSING_FRAMES: dict[str, bytes] = {
    "garbage bytes": b"\xde\xad\xbe\xef" * 8,
    "garbage with a small length": b"\x00\x00\x00\x05hello",
    "length 0": HEADER.pack(V, 0),
    "length one past the request limit": HEADER.pack(V, REQUEST_LIMITS.frame_bytes + 1) + b"\x80",
    "a 16 MiB length, once legal": HEADER.pack(V, 16 << 20) + b"\x90" * 64,
    "a request too large": request_frame("frobnicate", pad=b"\0" * REQUEST_LIMITS.frame_bytes),
    "length 4 GiB - 1": HEADER.pack(V, 0xFFFFFFFF),
    "valid length, non-msgpack body": raw_frame(b"\xc1"),
    "valid length, truncated msgpack body": raw_frame(msgpack.packb({"type": "stats"})[:-2]),
    "msgpack followed by extra bytes": raw_frame(msgpack.packb({"type": "stats"}) + b"\x01"),
    "msgpack list, not a map": msg([1, "stats"]),
    "msgpack string, not a map": msg("stats"),
    "msgpack nil": msg(None),
    "map with an integer key": msg({1: 1, "type": "stats"}),
    "protocol version 3": msg({"type": "stats"}, version=3),
    "protocol version 0": msg({"type": "stats"}, version=0),
    "a frame of protocol version 1": PREVIOUS_VERSION_FRAME,
    "type missing": msg({}),
    "type not a string": msg({"type": 7}),
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


# -- requests that get an error reply and leave the connection usable ----------------------------------------------

GOOD_KEY: dict[str, object] = {"config": "0" * 64, "tokenizer": "0" * 64, "plan": "0" * 64, "format": FORMAT_VERSION}
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
    "unknown request with a body near the limit": (request_frame("frobnicate", pad=b"\0" * 1000), "unknown_requests"),
    # A body is decoded straight into its request type: a field no request has is refused, never built.
    "a field no request has": (request_frame("stats", verbose=True), "bad_requests"),
    "a list longer than any request holds": (request_frame("stats", x=[0] * 1000), "bad_requests"),
    "a map larger than any request holds": (request_frame("stats", x={str(i): 0 for i in range(200)}), "bad_requests"),
    "many lists and maps": (request_frame("stats", x=[[]] * 1000), "bad_requests"),
    "a string longer than any request holds": (request_frame("stats", x="a" * 4000), "bad_requests"),
    "an extension type": (msg({"type": "stats", "x": msgpack.ExtType(1, b"ab")}), "bad_requests"),
    "a bool for a pid": (request_frame("hello", key=GOOD_KEY, pid=True), "bad_requests"),
    "a float for a pid": (request_frame("hello", key=GOOD_KEY, pid=1.0), "bad_requests"),
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
        assert reply["type"] == "error" and reply["v"] == PROTOCOL_VERSION
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
        assert set(hello["mismatched"]) == {"config", "tokenizer", "plan"}  # its format is the daemon's too
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
    with preloaded_tiny(tiny_template) as (rig, _, daemon):
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


# -- slow, huge and numerous clients ----------------------------------------------------------------------------------


def test_a_slow_drip_is_dropped_at_the_frame_deadline_while_an_idle_lease_lives_on(
    live: tuple[DaemonRig, DaemonDescriptor],
) -> None:
    """1 byte every half second never trips a per-recv timeout; the frame's deadline, from its first byte, does.
    A zero-copy lease silent for longer than that deadline is idle between frames, not slow within one."""
    _, daemon = live
    deadline = REQUEST_LIMITS.deadline_s
    before = counters(daemon).get("bad_frames", 0)
    with DaemonConnection(daemon.socket) as lease:
        assert lease.request(Hello.mine(WantedKey.of(daemon.key))).status == "hit"
        for fd in lease.request(MapRequest("zero_copy")).fds:
            os.close(fd)
        frame = request_frame("stats", pad=b"\0" * 200)  # would take minutes to arrive at this pace
        with raw_connect(daemon.socket) as drip:
            began = time.monotonic()
            for byte in frame:
                assert time.monotonic() - began < deadline + 10, "the dripping client was never dropped"
                try:
                    drip.send(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    break
                if select.select([drip], [], [], 0.5)[0]:
                    assert read_until_closed(drip) == b"", "a dripped frame was answered"
                    break
            dropped_after = time.monotonic() - began
        assert deadline - 0.5 <= dropped_after <= deadline + 5, dropped_after
        wait_counter(daemon, "bad_frames", before + 1)
        # The lease has now been silent for longer than a frame may take, and serves on.
        assert lease.request(Stats()).leases >= 1


def _largest_request() -> bytes:
    """A frame at the request limit that would decode to as many objects as it can hold: lists of short strings
    (3 bytes each on the wire, ~50 as Python objects) in fields no stats request has. The daemon refuses it with
    an error reply at its first unknown field, building none of it."""
    fields: dict[str, list[str]] = {}
    while len(request_frame("stats", **fields, x=[f"{j:02d}" for j in range(64)])) <= REQUEST_LIMITS.frame_bytes:
        fields[f"x{len(fields)}"] = [f"{j:02d}" for j in range(64)]
    return request_frame("stats", **fields)


def peak_rss_since_reset(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


MEMORY_BOUND_BYTES = 200 * 1024 * 1024


def test_hostile_frames_cost_the_daemon_bounded_memory(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    """16 MiB of empty arrays was a legal frame and decoded to +1.2 GB; now requests are bounded before and
    while decoding. Four such frames and 60 of the largest legal requests at once stay far under the bound."""
    _, daemon = live
    count = 16 * 1024 * 1024 - 8
    flood = HEADER.pack(V, count + 5) + b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    largest = _largest_request()
    assert len(largest) - HEADER.size <= REQUEST_LIMITS.frame_bytes
    before = psutil.Process(daemon.pid).memory_info().rss
    Path(f"/proc/{daemon.pid}/clear_refs").write_text("5")  # the peak RSS starts again from here
    payloads = [flood] * 4 + [largest] * 60
    sockets = [raw_connect(daemon.socket, timeout=30) for _ in payloads]
    start = threading.Barrier(len(payloads))
    answers: list[str] = [""] * len(payloads)

    def send(i: int) -> None:
        start.wait()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused at the length prefix
            sockets[i].sendall(payloads[i])
        if payloads[i] is largest:
            answers[i] = read_reply(sockets[i], timeout=30)["type"]
        else:  # closed only once the daemon is done with the frame, whatever it cost
            answers[i] = "closed" if read_until_closed(sockets[i], timeout=30) == b"" else "answered"

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(payloads))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        for sock in sockets:
            sock.close()
    growth = peak_rss_since_reset(daemon.pid) - before
    assert growth < MEMORY_BOUND_BYTES, f"the daemon's RSS grew by {growth / 2**20:.0f} MiB"
    assert answers == ["closed"] * 4 + ["error"] * 60
    assert_still_serving(daemon)


def test_200_simultaneous_connects_are_all_served(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    _, daemon = live
    clients = 200
    start = threading.Barrier(clients)
    failures: list[str] = []

    def client() -> None:
        start.wait()
        try:
            request_once(daemon.socket, Stats())
        except DaemonError as exc:
            failures.append(str(exc))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, f"{len(failures)} of {clients} were not served, e.g. {failures[0]}"


def test_a_client_retries_while_the_listen_queue_is_full() -> None:
    """A listener whose queue is full answers a non-blocking connect with EAGAIN; the client waits its turn."""
    base = Path(tempfile.mkdtemp(prefix="wc-q-", dir="/tmp"))
    path = str(base / "q.sock")
    queued: list[socket.socket] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(0)  # room for one connection waiting to be accepted
            queued.append(raw_connect(path))
            with pytest.raises(BlockingIOError):  # the queue is full: what a burst of engines meets
                queued.append(raw_connect(path))
            outcome: list[DaemonConnection | DaemonError] = []

            def connect() -> None:
                try:
                    outcome.append(DaemonConnection(path, timeout=10))
                except DaemonError as exc:
                    outcome.append(exc)

            began = time.monotonic()
            waiter = threading.Thread(target=connect)
            waiter.start()
            time.sleep(0.5)
            assert not outcome, f"the client gave up at once: {outcome}"
            accepted, _ = listener.accept()  # the daemon's accept loop catches up
            queued.append(accepted)
            waiter.join(timeout=10)
            (connection,) = outcome
            assert isinstance(connection, DaemonConnection), connection
            assert time.monotonic() - began >= 0.5
            connection.close()
    finally:
        for sock in queued:
            sock.close()
        shutil.rmtree(base)


def test_connections_beyond_the_limit_get_a_clear_refusal(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    _, daemon = live
    before = counters(daemon).get("refused_busy", 0)
    idle: list[socket.socket] = []
    try:
        for _ in range(MAX_CLIENTS):
            idle.append(raw_connect(daemon.socket))
        with pytest.raises(DaemonError, match=f"refused stats: this daemon already serves {MAX_CLIENTS} connections"):
            request_once(daemon.socket, Stats())
    finally:
        for sock in idle:
            sock.close()

    def served() -> bool:
        with contextlib.suppress(DaemonError):
            return request_once(daemon.socket, Stats()).TYPE == "stats"
        return False

    wait_for(served, what="the daemon to serve again once the idle connections closed")
    assert counters(daemon).get("refused_busy", 0) >= before + 1
    assert_still_serving(daemon)


# -- another uid ---------------------------------------------------------------------------------------------------

OTHER_UID_PEER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
sock.connect(sys.argv[1])
try:
    sock.sendall(bytes.fromhex(sys.argv[2]))
    print(len(sock.recv(65536)))
except (BrokenPipeError, ConnectionResetError):
    print(0)
"""


def test_after_another_uid_is_refused_a_same_uid_attach_hits(live: tuple[DaemonRig, DaemonDescriptor]) -> None:
    """Refusing a peer of another uid (reached through a hard link of the socket, opened up for the test)
    changes nothing for our own engines: each refusal is followed by an attach that hits."""
    if os.geteuid() != 0:
        pytest.skip("a peer of another uid needs root to start")
    rig, daemon = live
    model = Path(daemon.source)
    refused_before = counters(daemon).get("refused_peers", 0)
    outside = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    rig.extra_paths.append(outside)
    outside.chmod(0o711)
    link = outside / "s.sock"
    os.link(daemon.socket, link)
    os.chmod(daemon.socket, 0o666)
    try:
        for _ in range(3):
            peer = run_as_nobody([sys.executable, "-c", OTHER_UID_PEER, str(link), request_frame("stats").hex()],
                                 dict(os.environ), cwd=Path("/"))
            assert (peer.returncode, peer.stdout.strip()) == (0, "0"), peer.stderr
            with attach(model, run_dir=rig.run_dir, fallback=False) as weights:
                assert weights.report.outcome == "hit"
    finally:
        os.chmod(daemon.socket, 0o600)
        link.unlink()
    result = rig.cli("attach", str(model), "--json", "--no-fallback", "--run-dir", str(rig.run_dir))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outcome"] == "hit"
    wait_counter(daemon, "refused_peers", refused_before + 3)
