"""Tensor parallelism on CPU: a TP=2 engine (rank 0 in this process, rank 1 spawned, gloo, through
run_tensor_parallel) against TP=1,
TP=2 serving over HTTP against TP=1 with unpickling switched off in the ranks, and the launcher's failure
handling (a raising, dying or hanging rank stops every rank and names the culprit; a rank's wcache error
arrives as itself, so the CLI prints one sentence with the error's exit code).

Each launch spawns fresh interpreters that import torch, so this file keeps the number of launches small.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers import wcache_in_process
from wcache.attach_options import AttachOptions
from wcache.engine import Engine, EngineConfig
from wcache.engine.block_manager import KVCacheFullError
from wcache.engine.parallel import TensorParallel
from wcache.errors import EXIT_BAD_INPUT, EXIT_UNAVAILABLE, CheckpointError, UnavailableError
from wcache.plan.spec import PlanSpec
from wcache.serving.ranks import Driver, follow_rank0, serve_rank
from wcache.tp_launch import TensorParallelError, run_tensor_parallel

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
    # Rank 0 ran here, rank 1 in a process of its own; the group rank 0 joined here is gone again.
    assert ranks[0]["pid"] == os.getpid() != ranks[1]["pid"]
    assert not torch.distributed.is_initialized()
    assert torch.get_num_threads() == 1  # the thread count rank 0 set here is put back
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
            # Same cache decisions: the third prompt's 64-token hit is adopted with a one-window replay. (Each
            # rank's weights are its own shard, so the key they ran under is not TP 1's.)
            assert got["generation"].weights_key != want["generation"].weights_key
            same_key = dataclasses.replace(got["generation"], weights_key=want["generation"].weights_key)
            assert same_key == want["generation"], f"prompt {i}"
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
    with pytest.raises(TensorParallelError) as info:
        run_tensor_parallel(_raise_on_rank1, 2, timeout=120)
    message = str(info.value)
    # One sentence naming the rank and its error, which the CLI prints as is (exit 3, no traceback)...
    assert message.startswith("tensor-parallel rank 1 failed: ValueError: rank one refuses")
    assert "\n" not in message and "Traceback" not in message
    assert info.value.exit_code == EXIT_UNAVAILABLE
    # ...and the rank's traceback as a note, for `wcache -v`.
    assert "_raise_on_rank1" in "".join(getattr(info.value, "__notes__", []))
    assert time.monotonic() - started < 60  # rank 0's barrier did not hold us to the timeout
    _no_children_left(before)


class _OutsideError(UnavailableError):
    """A wcache error subclass from outside wcache's package: the parent does not rebuild classes it does not own."""


def _raise_typed_on_rank1(tp: TensorParallel, kind: str) -> int:
    if tp.rank == 1:
        if kind == "checkpoint":
            raise CheckpointError("/models/m/model-00002.safetensors is truncated: 4 of 16 bytes.")
        raise _OutsideError("a daemon went away.")
    torch.distributed.barrier()
    return tp.rank


@pytest.mark.parametrize(("kind", "arrives_as", "message"), [
    ("checkpoint", CheckpointError, "/models/m/model-00002.safetensors is truncated: 4 of 16 bytes."),
    ("outside", UnavailableError, "a daemon went away."),
])
def test_a_rank_wcache_error_arrives_as_its_class(kind: str, arrives_as: type[Exception], message: str) -> None:
    before = _live_children()
    with pytest.raises(arrives_as) as info:
        run_tensor_parallel(_raise_typed_on_rank1, 2, kind, timeout=120)
    # The class itself (for an outside subclass, its nearest wcache base), with the rank's message unchanged.
    assert type(info.value) is arrives_as
    assert str(info.value) == message
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "rank 1" in notes and "_raise_typed_on_rank1" in notes
    _no_children_left(before)


def test_cli_tp_the_model_cannot_take_is_one_sentence(tiny_template: Path, tmp_path: Path) -> None:
    """tiny has 4 heads: --tp 3 is refused up front, as one sentence with exit 2, before any rank starts."""
    result = wcache_in_process("attach", str(tiny_template), "--tp", "3", "--prompt", "hi",
                               "--run-dir", str(tmp_path / "run"))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: 4 attention heads cannot be split evenly across --tp 3."
    ], result.stderr


def test_cli_an_error_only_the_ranks_find_is_one_sentence(tiny_template: Path, tmp_path: Path) -> None:
    """No daemon and no fallback: each rank misses, and the miss reaches the CLI as itself (exit 3, one line)."""
    result = wcache_in_process("attach", str(tiny_template), "--tp", "2", "--prompt", "hi", "--no-fallback",
                               "--run-dir", str(tmp_path / "run"))
    assert result.returncode == EXIT_UNAVAILABLE, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not falling back to disk" in lines[0], result.stderr


def test_a_dying_rank_is_named_with_its_exit_code() -> None:
    before = _live_children()
    with pytest.raises(TensorParallelError, match=r"^tensor-parallel rank 1 died without a result \(exit code 7\)"):
        run_tensor_parallel(_exit_on_rank1, 2, timeout=120)
    _no_children_left(before)


def test_timeout_stops_every_rank() -> None:
    before = _live_children()
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"^tensor-parallel ranks 0, 1 did not finish within 3 s\.$"):
        run_tensor_parallel(_sleep, 2, 600.0, timeout=3)
    assert time.monotonic() - started < 3 + 10  # terminate, then kill: never the 600 s sleep
    _no_children_left(before)


def _where(tp: TensorParallel) -> tuple[int, int, str]:
    return tp.rank, os.getpid(), threading.current_thread().name


def test_tp1_runs_here_and_spawns_nothing() -> None:
    before = _live_children()
    assert run_tensor_parallel(_where, 1) == [(0, os.getpid(), "MainThread")]
    assert _live_children() == before


def test_rank0_here_needs_the_main_thread() -> None:
    """Only the main thread can be stopped by a signal; a caller on another thread isolates rank 0 instead."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["here"] = run_tensor_parallel(_where, 2)
        except ValueError as exc:
            outcome["refused"] = str(exc)
        outcome["isolated"] = run_tensor_parallel(_where, 2, timeout=120, isolate_rank0=True)

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(180)
    assert "isolate_rank0=True" in outcome["refused"] and "here" not in outcome
    assert [rank for rank, _, _ in outcome["isolated"]] == [0, 1]
    assert os.getpid() not in {pid for _, pid, _ in outcome["isolated"]}


def test_bad_arguments_start_nothing() -> None:
    before = _live_children()
    with pytest.raises(ValueError, match="tp_size"):
        run_tensor_parallel(_sleep, 0, 0.0)
    with pytest.raises(ValueError, match="timeout"):
        run_tensor_parallel(_sleep, 2, 0.0, timeout=0)
    assert _live_children() == before


# -- serving ---------------------------------------------------------------------------------------------


class _RefusedUnpickler(pickle.Unpickler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a tensor-parallel rank unpickled data while serving")


def _refused(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a tensor-parallel rank unpickled data while serving")


def _serve_without_unpickling(tp: TensorParallel, checkpoint: Path, run_dir: Path, ready_file: Path) -> None:
    """serve_rank on this rank, with every unpickling entry point (pickle's and torch.distributed's) refusing."""
    import torch.distributed.distributed_c10d as c10d

    c10d._unpickler = _RefusedUnpickler  # what broadcast_object_list and the other *_object calls unpickle with
    pickle.Unpickler = _RefusedUnpickler  # type: ignore[misc]
    pickle.loads = pickle.load = _refused
    plan = PlanSpec(tp_size=tp.size)
    serve_rank(tp, checkpoint, plan, EngineConfig(), AttachOptions(), "cpu", "127.0.0.1", 0, run_dir,
               functools.partial(_announce, ready_file))


def _announce(ready_file: Path, url: str, engine: Engine) -> None:
    temporary = ready_file.with_suffix(".tmp")
    temporary.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    temporary.replace(ready_file)


def _complete(url: str, token_ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"prompt": token_ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _served(answer: dict[str, Any]) -> tuple[list[int], int, bool, int, int]:
    extra = answer["wcache"]
    return (answer["choices"][0]["token_ids"], extra["hit_tokens"], extra["adopted"], extra["replayed_tokens"],
            extra["prefill_tokens"])


def _generated(generation: Any) -> tuple[list[int], int, bool, int, int]:
    return (generation.token_ids, generation.hit_tokens, generation.adopted, generation.replayed_tokens,
            generation.prefill_tokens)


def test_tp2_serving_matches_tp1_without_unpickling(tiny_template: Path, tmp_path: Path) -> None:
    """Rank 0 serves HTTP and sends each request to rank 1 as tensors; neither rank may unpickle anything.

    Concurrent requests must not interleave one request's broadcasts with another's generation.
    """
    single = Engine.from_disk(tiny_template, plan=PlanSpec(), engine_config=EngineConfig())
    concurrent = [_prompt(20 + i, 40 + 7 * i) for i in range(4)]  # no shared first block: order cannot matter
    expected_first = _generated(single.generate(PROMPTS[0], 8))
    expected_concurrent = [single.generate(prompt, 6).token_ids for prompt in concurrent]
    expected_hit = _generated(single.generate(PROMPTS[2], 8))  # a prefix hit on PROMPTS[0], replayed
    assert expected_hit[1:4] == (64, True, WINDOW)

    before = _live_children()
    ready_file = tmp_path / "ready.json"
    outcome: dict[str, Any] = {}

    def launch() -> None:
        try:
            # Rank 0 spawned too: this test serves from a thread and stops rank 0 by its pid, as a service
            # manager would, which must not stop the test's own process.
            outcome["result"] = run_tensor_parallel(_serve_without_unpickling, 2, tiny_template, tmp_path / "run",
                                                    ready_file, timeout=240, isolate_rank0=True)
        except BaseException as exc:  # handed to the test thread below
            outcome["error"] = exc

    launcher = threading.Thread(target=launch)
    launcher.start()
    rank0: int | None = None
    try:
        deadline = time.monotonic() + 120
        while not ready_file.exists() and launcher.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready_file.exists(), f"rank 0 never served: {outcome.get('error')!r}"
        ready = json.loads(ready_file.read_text())
        url, rank0 = ready["url"], ready["pid"]

        assert _served(_complete(url, PROMPTS[0], 8)) == expected_first
        with ThreadPoolExecutor(len(concurrent)) as pool:
            answers = list(pool.map(lambda prompt: _complete(url, prompt, 6), concurrent))
        assert [a["choices"][0]["token_ids"] for a in answers] == expected_concurrent
        assert _served(_complete(url, PROMPTS[2], 8)) == expected_hit
        assert launcher.is_alive(), f"a rank stopped: {outcome.get('error')!r}"
    finally:
        if rank0 is not None and launcher.is_alive():
            os.kill(rank0, signal.SIGTERM)  # what a service manager sends: rank 0 stops rank 1, then both exit
        launcher.join(240)
    assert "error" not in outcome, f"the TP server failed: {outcome['error']!r}"
    assert outcome["result"] == [None, None]
    _no_children_left(before)


def _drive(tp: TensorParallel, checkpoint: Path, too_long: list[int]) -> list[Any] | None:
    """Rank 0 drives three requests, the middle one too large for the KV cache; the others follow."""
    engine = Engine.from_disk(checkpoint, plan=PlanSpec(tp_size=tp.size, tp_rank=tp.rank),
                              engine_config=EngineConfig(), tp=tp)
    if tp.rank != 0:
        follow_rank0(engine, tp)
        return None
    driver = Driver(engine, tp)
    answers: list[Any] = [_generated(driver.generate(PROMPTS[0], 8))]
    try:
        driver.generate(too_long, 4)
    except KVCacheFullError as exc:
        answers.append(type(exc).__name__)
    answers.append(_generated(driver.generate(PROMPTS[2], 8)))
    driver.stop_followers()
    return answers


def test_a_request_failing_on_every_rank_leaves_them_in_step(tiny_template: Path) -> None:
    """The followers survive what rank 0's server survives (it answers the client and serves on)."""
    single = Engine.from_disk(tiny_template, plan=PlanSpec(), engine_config=EngineConfig())
    too_long = [5] * (single.config.num_blocks * single.config.block_size + 16)
    expected: list[Any] = [_generated(single.generate(PROMPTS[0], 8))]
    with pytest.raises(KVCacheFullError):
        single.generate(too_long, 4)
    expected += ["KVCacheFullError", _generated(single.generate(PROMPTS[2], 8))]
    before = _live_children()
    assert run_tensor_parallel(_drive, 2, tiny_template, too_long, timeout=240) == [expected, None]
    _no_children_left(before)


def test_cli_tp2_server_is_the_command_and_stops_on_sigterm(tiny_template: Path) -> None:
    """`wcache attach --serve --tp 2`: rank 0 serves in the command's own process (its pid names the engine and
    its token), rank 1 is its only child; SIGTERM stops both gracefully, exit 0, as with --tp 1."""
    from daemon_fixtures import daemon_rig
    from engine_serving import serving

    with daemon_rig() as rig, serving(rig, tiny_template, "--tp", "2") as server:
        pid = server.process.pid
        descriptor = rig.run_dir / "engines" / f"{pid}.json"
        assert json.loads(descriptor.read_text())["url"] == server.url
        assert server.token()  # written under the command's pid
        ranks = [child for child in psutil.Process(pid).children()
                 if not any("resource_tracker" in part for part in child.cmdline())]
        assert len(ranks) == 1
        assert _served(_complete(server.url, PROMPTS[0], 8))[0]
        assert server.stop() == 0, server.stderr.read_text()
        assert not descriptor.exists() and not (rig.run_dir / "engines" / f"{pid}.token").exists()
        assert not any(rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE for rank in ranks)


def _barrier_while_rank1_sleeps(tp: TensorParallel, started: str) -> int:
    if tp.rank == 1:
        Path(started).write_text("asleep")
        time.sleep(600)
    torch.distributed.barrier()  # rank 0 waits here, where no signal reaches it, for a rank that never comes
    return tp.rank


def test_ctrl_c_stops_every_rank_while_rank0_waits_in_a_collective(tmp_path: Path) -> None:
    """SIGINT to the caller: rank 0 is in a barrier no signal interrupts, so the other ranks are stopped for it;
    the caller sees KeyboardInterrupt (the CLI's "interrupted."), and no rank is left."""
    started = tmp_path / "started"
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import test_engine_tp as t\n"
              "from wcache.tp_launch import run_tensor_parallel\n"
              "if __name__ == '__main__':\n"
              "    try:\n"
              "        run_tensor_parallel(t._barrier_while_rank1_sleeps, 2, sys.argv[2])\n"
              "    except KeyboardInterrupt:\n"
              "        print('interrupted', flush=True)\n")
    caller = psutil.Popen([sys.executable, "-c", script, str(Path(__file__).parent), str(started)],
                          stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists()
        time.sleep(1)  # rank 0 into its barrier
        ranks = [child for child in caller.children(recursive=True)
                 if not any("resource_tracker" in part for part in child.cmdline())]
        assert len(ranks) == 1
        caller.send_signal(signal.SIGINT)
        out, _ = caller.communicate(timeout=60)
    finally:
        if caller.poll() is None:
            caller.kill()
    assert out.strip() == "interrupted"
    assert not any(rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE for rank in ranks)
