"""Run an engine behind its HTTP API until stopped; with TP, rank 0 serves and drives the other ranks.

Every rank runs the same generate() calls in the same order, because the model's collectives must line up:
rank 0 broadcasts each request before running it, and a stop message ends the others' loops.

Requests travel as int64 tensors only (a fixed-size header, then the token ids), never as pickled objects:
gloo's TCP ports on loopback are open to every local user, and a rank that unpickled what it received there
could be made to run anything. A header outside the protocol ends the rank instead of being guessed at.

Each rank holds its own daemon's lease, and only that daemon tells it when its weights changed in memory. The
other ranks pass what theirs say to rank 0 at once over a channel the parent made before they started
(`corrupt_channel`: an anonymous pipe only the ranks hold, carrying `RankCorrupt` as JSON, one write under
PIPE_BUF each so ranks writing together never interleave): rank 0 serves for all of them, so it turns not-ready
and refuses completions whichever rank's weights changed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TextIO

import msgspec
import torch

from wcache.attach_options import AttachOptions
from wcache.engine.config import EngineConfig
from wcache.engine.engine import Engine, Generation
from wcache.engine.parallel import TensorParallel
from wcache.errors import option
from wcache.ipc.http.server import http_url
from wcache.ipc.run_dir.directory import ensure_run_dir
from wcache.ipc.run_dir.engine_token import engine_token, write_engine_token
from wcache.plan.spec import PlanSpec
from wcache.schema import Schema, SchemaError
from wcache.serving.follow import Follower, check_followable
from wcache.serving.server import (
    MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT,
    CounterEvents,
    ServedEngine,
    announce_engine,
    corrupt_weights,
    make_server,
    switch_served,
)

log = logging.getLogger("wcache.engine")
NOTICE_MAX = 4096 - 4  # a follower's notice and its length prefix in one write no larger than Linux's PIPE_BUF

# Every request starts with the header [opcode, prompt length, max new tokens].
_GENERATE, _STOP = 1, 2
_HEADER_LEN = 3
# A prompt cannot hold more tokens than the request body that carried it had bytes.
MAX_PROMPT_TOKENS = MAX_BODY_BYTES


class RankCorrupt(Schema, frozen=True):
    """What a follower rank tells rank 0: its daemon found a tensor of its weights changed in memory."""

    rank: int
    daemon: str
    tensor: str
    reason: str


def corrupt_channel() -> tuple[Connection, Connection]:
    """The pipe follower ranks tell rank 0 their daemons' findings over (its reading end, its writing end); made
    by the parent before it spawns the ranks, and handed to each rank's serve_rank."""
    reader, writer = torch.multiprocessing.get_context("spawn").Pipe(duplex=False)
    return reader, writer


def _notice(found: RankCorrupt) -> bytes:
    """`found` as one pipe write of at most NOTICE_MAX bytes (the reason shortened when it must be)."""
    data = msgspec.json.encode(found)
    if len(data) > NOTICE_MAX:
        cut = len(found.reason) - (len(data) - NOTICE_MAX) - 8  # JSON escapes make the reason's bytes no fewer
        data = msgspec.json.encode(msgspec.structs.replace(found, reason=found.reason[:max(0, cut)] + "…"))
    return data


def _tell_rank0(engine: Engine, tp: TensorParallel, channel: tuple[Connection, Connection]) -> None:
    """On a follower rank: pass each tensor its daemon reports changed to rank 0, once."""
    report = engine.attach_report
    if report is None:
        return  # loaded from disk: no daemon to hear from
    told: set[str] = set()
    lock = threading.Lock()

    def tell() -> None:
        with lock:
            for found in report.corrupt.tensors:
                if found.tensor not in told:
                    told.add(found.tensor)
                    channel[1].send_bytes(_notice(RankCorrupt(tp.rank, report.daemon or "unknown", found.tensor,
                                                              found.reason)))

    report.corrupt.listen(tell)
    tell()  # what the lease heard before the listener was there


def _hear_ranks(engine: Engine, channel: tuple[Connection, Connection]) -> None:
    """On rank 0: add what the other ranks' daemons report to the weights this engine serves (its `/health`,
    `/v1/weights`, completions and announcement read them there)."""
    def hear() -> None:
        while True:
            try:
                data = channel[0].recv_bytes(NOTICE_MAX)
            except (EOFError, OSError):
                return  # the ranks went away, or one sent more than a notice
            try:
                found = RankCorrupt.from_wire(msgspec.json.decode(data))
            except (msgspec.DecodeError, SchemaError, TypeError) as exc:
                log.error("wcache: a tensor-parallel rank sent a corruption notice wcache does not read (%s).", exc)
                continue
            report = engine.attach_report
            if report is None:
                log.error("wcache: rank %d's daemon %s found its weights changed in memory: %s.", found.rank,
                          found.daemon, found.reason)
                continue
            report.corrupt.add(found.tensor, found.reason, rank=found.rank, daemon=found.daemon)

    threading.Thread(target=hear, name="wcache-rank-corrupt", daemon=True).start()


class LockstepError(RuntimeError):
    """The ranks are no longer running the same requests; the rank that notices stops rather than drift."""


class Driver:
    """Rank 0's side: tells the other ranks each request, then runs it with them, one request at a time."""

    def __init__(self, engine: Engine, tp: TensorParallel) -> None:
        self.engine, self.tp = engine, tp
        # Held from the header to the end of the generation: two HTTP threads interleaving their broadcasts
        # with each other's generations would pair one request's collectives with another's.
        self.lock = threading.Lock()

    def generate(self, token_ids: list[int], max_new_tokens: int) -> Generation:
        # Refused here, before any rank hears of it, so a served request never trips the followers' checks.
        if not 0 < len(token_ids) <= MAX_PROMPT_TOKENS:
            raise ValueError(f"the prompt must hold 1 to {MAX_PROMPT_TOKENS} tokens")
        if not 1 <= max_new_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens must be an integer between 1 and {MAX_TOKENS_LIMIT}")
        with self.lock:
            self.tp.broadcast_ints([_GENERATE, len(token_ids), max_new_tokens])
            self.tp.broadcast_ints(token_ids)
            try:
                generation = self.engine.generate(token_ids, max_new_tokens)
            except Exception:
                _check_agreement(self.tp, failed=True)
                raise
            _check_agreement(self.tp, failed=False)
            return generation

    def stop_followers(self) -> None:
        with self.lock:
            self.tp.broadcast_ints([_STOP, 0, 0])


def _check_agreement(tp: TensorParallel, failed: bool) -> None:
    """Every rank says whether this request failed; a request that failed on some ranks only desynchronized them."""
    failures = int(tp.all_reduce(torch.tensor([1.0 if failed else 0.0]))[0])
    if failures not in (0, tp.size):
        raise LockstepError(f"a request failed on {failures} of {tp.size} tensor-parallel ranks; stopping rank "
                            f"{tp.rank} rather than run out of step")


def _next_request(tp: TensorParallel, vocab_size: int) -> tuple[list[int], int] | None:
    """Rank 0's next request (prompt, max new tokens), or None when it says stop."""
    opcode, length, max_new_tokens = tp.broadcast_ints([0] * _HEADER_LEN)
    if opcode == _STOP:
        return None
    if opcode != _GENERATE or not 0 < length <= MAX_PROMPT_TOKENS or not 1 <= max_new_tokens <= MAX_TOKENS_LIMIT:
        raise LockstepError(f"rank 0 sent the request header {[opcode, length, max_new_tokens]}, which is neither "
                            "a stop nor a generate request within the server's limits")
    token_ids = tp.broadcast_ints([0] * length)
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise LockstepError("rank 0 sent token ids outside the vocabulary")
    return token_ids, max_new_tokens


def follow_rank0(engine: Engine, tp: TensorParallel) -> None:
    """A rank other than 0: run every request rank 0's Driver sends, until it says stop."""
    while (request := _next_request(tp, engine.model_config.vocab_size)) is not None:
        # A request that fails on rank 0 (a full KV cache) fails here at the same step: rank 0's server lives
        # on and answers the next request, so this rank must too, once both agree that it failed everywhere.
        try:
            engine.generate(*request)
        except Exception:
            _check_agreement(tp, failed=True)
            continue
        _check_agreement(tp, failed=False)


class _StatsLines(logging.StreamHandler[TextIO]):
    """The handler that prints the engine's stats lines; one per process."""


def _stats_lines_to_stderr() -> None:
    """The served engine's periodic INFO stats line on stderr, as vLLM prints its own; warnings are left to the
    handlers the process already has (the CLI's one-sentence warnings)."""
    stats = logging.getLogger("wcache.engine")
    if any(isinstance(h, _StatsLines) for h in stats.handlers):
        return
    handler = _StatsLines(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s wcache engine: %(message)s"))
    handler.addFilter(lambda record: record.levelno == logging.INFO)
    stats.addHandler(handler)
    stats.setLevel(logging.INFO)


def _follower(served: ServedEngine, daemons: Path) -> Follower:
    """The started thread that switches `served` to its weights' newest version in `daemons` (a run dir)."""
    engine = served.engine
    follower = Follower(daemons, engine.device, lambda: engine.served.key_id,
                        lambda: corrupt_weights(engine) is not None,
                        lambda daemon: switch_served(served, None, daemon))
    follower.start()
    return follower


def serve_rank(tp: TensorParallel, model: Path, plan: PlanSpec, engine_config: EngineConfig,
               options: AttachOptions, device: str, host: str, port: int, run_dir: Path,
               on_ready: Callable[[str, Engine], None] | None = None,
               corrupt: tuple[Connection, Connection] | None = None, follow: bool = False) -> None:
    """One rank's life: attach, build the engine, then serve (rank 0) or follow rank 0 (others). The engine
    publishes itself in `run_dir`, where `options` look for daemons unless they name another. With TP > 1,
    `corrupt` is the `corrupt_channel()` the parent made for these ranks. With `follow` (TP 1), the engine moves
    to its weights' newest version by itself (`serving.follow`)."""
    if follow:
        check_followable(tp.size)
    # Read first: an operator's token file that cannot serve fails before the attach, not after it.
    token = engine_token() if tp.rank == 0 else None
    spec = plan.for_rank(tp.rank)
    options = options if options.run_dir is not None else msgspec.structs.replace(options, run_dir=str(run_dir))
    engine = Engine.from_attach(model, spec, engine_config, tp, options=options, device=device)
    try:
        if tp.rank != 0:
            if corrupt is not None:
                _tell_rank0(engine, tp, corrupt)
            follow_rank0(engine, tp)
            return
        if corrupt is not None:
            _hear_ranks(engine, corrupt)
        driver = Driver(engine, tp) if tp.size > 1 else None
        _stats_lines_to_stderr()
        served = ServedEngine(engine, driver.generate if driver is not None else engine.generate,
                              lambda switched: announce_engine(run_dir, url, switched), follows=follow)
        server = make_server(served, host, port, (option("host"), option("port")), control_token=token)
        url = http_url(host, server.server_address[1])
        ensure_run_dir(run_dir)
        # The token before the announcement: a client that finds the engine finds its token too.
        assert token is not None
        token_file = write_engine_token(run_dir, os.getpid(), token)
        descriptor = announce_engine(run_dir, url, served)
        counters = CounterEvents(served, run_dir, url)
        counters.start()
        follower = _follower(served, Path(options.run_dir or run_dir)) if follow else None
        stop = threading.Event()
        # SIGTERM and SIGINT end serve_forever from another thread (it cannot be interrupted in place); the
        # handlers they replace come back after, for a caller that goes on (rank 0 runs in it).
        previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}

        def shut_down_on_signal() -> None:
            stop.wait()
            server.shutdown()

        threading.Thread(target=shut_down_on_signal, daemon=True).start()
        if on_ready is not None:
            on_ready(url, engine)
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            try:
                if follower is not None:
                    follower.stop()
                counters.stop()
                descriptor.unlink(missing_ok=True)
                token_file.unlink(missing_ok=True)
                server.server_close()
                if driver is not None:
                    driver.stop_followers()
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
    finally:
        engine.close()
