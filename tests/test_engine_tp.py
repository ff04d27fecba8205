"""Tensor parallelism on CPU: a TP=2 engine (two processes, gloo, through run_tensor_parallel) against TP=1,
and the launcher's failure handling (a raising, dying or hanging rank stops every rank and names the culprit).

Each launch spawns fresh interpreters that import torch, so this file keeps the number of launches small.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from wcache.engine import Engine, EngineConfig
from wcache.engine.parallel import TensorParallel
from wcache.engine.tp_launch import run_tensor_parallel
from wcache.plan import PlanSpec

WINDOW = 32
NEW_TOKENS = 24
LOGITS_ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The TP=1 baseline runs here: tiny matrices are faster on one thread (the ranks split the cores likewise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


# All longer than the window; the third shares 70 tokens with the first, so the engines also take a prefix hit
# (64 tokens, adopted with a 32-token replay) and must agree on it.
PROMPTS = [_prompt(11, 83), _prompt(12, 120), [*_prompt(11, 83)[:70], *_prompt(13, 30)]]


def _run_engine(engine: Engine) -> list[dict[str, Any]]:
    """Per prompt: cold logits of every position, then the greedy generation through the prefix cache."""
    out = []
    for prompt in PROMPTS:
        logits = engine.prefill_logits(prompt)
        generation = engine.generate(prompt, NEW_TOKENS)
        out.append({"logits": logits, "generation": generation})
    return out


def _tp_rank(tp: TensorParallel, checkpoint: Path) -> dict[str, Any]:
    engine = Engine.from_disk(checkpoint, plan=PlanSpec(tp_size=tp.size, tp_rank=tp.rank), engine_config=EngineConfig(),
                              tp=tp)
    return {
        "rank": tp.rank,
        "pid": os.getpid(),
        "heads": (engine.model.num_heads, engine.model.num_kv_heads),
        "embed_rows": engine.model.embed.shape[0],
        "results": _run_engine(engine),
        "counters": engine.counters.snapshot(),
    }


def _live_children() -> set[int]:
    """This process's live descendants, leaving out multiprocessing's resource tracker (one per parent, idle)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        pids.add(child.pid)
    return pids


def test_tp2_matches_tp1(tiny_template: Path) -> None:
    single = Engine.from_disk(tiny_template, plan=PlanSpec(), engine_config=EngineConfig())
    expected = _run_engine(single)
    ranks = run_tensor_parallel(_tp_rank, 2, tiny_template, timeout=240)

    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["pid"] != ranks[1]["pid"] and os.getpid() not in (ranks[0]["pid"], ranks[1]["pid"])
    # Each rank really holds half the heads and half the (vocab-parallel) embedding rows.
    assert all(r["heads"] == (2, 1) for r in ranks)
    assert all(r["embed_rows"] == 160 for r in ranks)
    for rank in ranks:
        for i, (got, want) in enumerate(zip(rank["results"], expected, strict=True)):
            assert len(PROMPTS[i]) > WINDOW
            torch.testing.assert_close(got["logits"], want["logits"], atol=LOGITS_ATOL, rtol=0,
                                       msg=lambda m, i=i: f"prompt {i}: {m}")
            assert got["generation"].token_ids == want["generation"].token_ids, f"prompt {i}"
            assert len(got["generation"].token_ids) == NEW_TOKENS
            # Same cache decisions: the third prompt's 64-token hit is adopted with a one-window replay.
            assert got["generation"] == want["generation"], f"prompt {i}"
        assert rank["counters"] == single.counters.snapshot()
    third = expected[2]["generation"]
    assert (third.hit_tokens, third.adopted, third.replayed_tokens) == (64, True, WINDOW)


# -- failures ------------------------------------------------------------------------------------------


def _raise_on_rank1(tp: TensorParallel) -> int:
    if tp.rank == 1:
        raise ValueError("rank one refuses")
    # Rank 0 blocks in a collective that rank 1 never joins: it must be stopped, not waited for.
    torch.distributed.barrier()
    return tp.rank


def _exit_on_rank1(tp: TensorParallel) -> int:
    if tp.rank == 1:
        os._exit(7)  # dies without a word, like a segfault or an OOM kill
    torch.distributed.barrier()
    return tp.rank


def _sleep(tp: TensorParallel, seconds: float) -> int:
    time.sleep(seconds)
    return tp.rank


def _no_children_left(before: set[int]) -> None:
    deadline = time.monotonic() + 5
    while (_live_children() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_children() - before == set()


def test_a_raising_rank_stops_all_and_is_named() -> None:
    before = _live_children()
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_tensor_parallel(_raise_on_rank1, 2, timeout=120)
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: rank one refuses" in message
    assert "_raise_on_rank1" in message  # the rank's traceback comes along
    assert time.monotonic() - started < 60  # rank 0's barrier did not hold us to the timeout
    _no_children_left(before)


def test_a_dying_rank_is_named_with_its_exit_code() -> None:
    before = _live_children()
    with pytest.raises(RuntimeError, match=r"rank 1 died without a result \(exit code 7\)"):
        run_tensor_parallel(_exit_on_rank1, 2, timeout=120)
    _no_children_left(before)


def test_timeout_stops_every_rank() -> None:
    before = _live_children()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks 0, 1 did not finish within 3 s"):
        run_tensor_parallel(_sleep, 2, 600.0, timeout=3)
    assert time.monotonic() - started < 3 + 10  # terminate, then kill: never the 600 s sleep
    _no_children_left(before)


def test_bad_arguments_start_nothing() -> None:
    before = _live_children()
    with pytest.raises(ValueError, match="tp_size"):
        run_tensor_parallel(_sleep, 0, 0.0)
    with pytest.raises(ValueError, match="timeout"):
        run_tensor_parallel(_sleep, 2, 0.0, timeout=0)
    assert _live_children() == before
