"""Run an engine behind its HTTP API until stopped; with TP, rank 0 serves and drives the other ranks.

Every rank runs the same generate() calls in the same order, because the model's collectives must line up:
rank 0 broadcasts each request before running it, and a stop message ends the others' loops.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from wcache.engine.config import EngineConfig
from wcache.engine.engine import Engine, Generation
from wcache.engine.parallel import TensorParallel
from wcache.engine.server import CounterEvents, ServedEngine, make_server, write_engine_descriptor
from wcache.plan import PlanSpec
from wcache.rundir import ensure_run_dir

_STOP = "stop"


def _lockstep(engine: Engine, tp: TensorParallel) -> Callable[[list[int], int], Generation]:
    if tp.size == 1:
        return engine.generate

    def generate(token_ids: list[int], max_new_tokens: int) -> Generation:
        with engine.lock:
            dist.broadcast_object_list([("generate", token_ids, max_new_tokens)], src=0)
        return engine.generate(token_ids, max_new_tokens)

    return generate


def _follow_rank0(engine: Engine) -> None:
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] == _STOP:
            return
        _, token_ids, max_new_tokens = message[0]
        engine.generate(token_ids, max_new_tokens)


def serve_rank(tp: TensorParallel, model: Path, plan: dict[str, Any], engine_config: EngineConfig,
               attach_options: dict[str, Any], host: str, port: int, run_dir: Path,
               on_ready: Callable[[str, Engine], None] | None = None) -> None:
    """One rank's life: attach, build the engine, then serve (rank 0) or follow rank 0 (others)."""
    spec = PlanSpec.from_json({**plan, "tp_rank": tp.rank})
    engine = Engine.from_attach(model, spec, engine_config, tp, run_dir=run_dir, **attach_options)
    try:
        if tp.rank != 0:
            _follow_rank0(engine)
            return
        served = ServedEngine(engine, model.name, _lockstep(engine, tp))
        server = make_server(served, host, port)
        url = f"http://{host}:{server.server_address[1]}"
        ensure_run_dir(run_dir)
        descriptor = write_engine_descriptor(run_dir, url, served, str(model))
        counters = CounterEvents(served, run_dir, url)
        counters.start()
        stop = threading.Event()
        # SIGTERM and SIGINT end serve_forever from another thread (it cannot be interrupted in place).
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        threading.Thread(target=lambda: (stop.wait(), server.shutdown()), daemon=True).start()
        if on_ready is not None:
            on_ready(url, engine)
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            counters.stop()
            descriptor.unlink(missing_ok=True)
            server.server_close()
            if tp.size > 1:
                with engine.lock:
                    dist.broadcast_object_list([_STOP], src=0)
    finally:
        engine.close()
