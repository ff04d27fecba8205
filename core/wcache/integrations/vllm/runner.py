"""Greedy generation with real vLLM engines in a child process, for `wcache verify --engine vllm`.

A child of its own (and its own session, so that vLLM's engine and worker processes go with it): vLLM
changes process-wide state (signal handlers, logging, environment), spawns workers that re-import the
parent's main module, and on a failed start leaves the reason only in its workers' log. The child writes
each engine's tokens to a file; on failure the reason is the last wcache error in its log.

Importing vLLM costs a CPU core ~6 s here, more than starting a small engine, so `greedy_runs` starts several
engines one after another in one child, each engine core in that child; `greedy_tokens` starts one in a child
of its own with vLLM's process layout as the environment sets it (a benchmark's cold start). Each engine is
shut down before the next starts (and before the child exits): vLLM's TP workers remove their shared memory
only on a shutdown, never on the SIGKILL that ends whatever is left in the session.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wcache.errors import EXIT_OK, UnavailableError
from wcache.ipc.interpreter import python_module_argv, safe_path_env

# Small enough for the CPU backend on a laptop-sized machine; vLLM's own default takes 92% of RAM.
DEFAULT_KV_CACHE_GIB = "1"
# vLLM gives its TP workers 5 s to exit on a shutdown before it signals them, and a signalled worker leaves
# its shared memory (/dev/shm/vllm_dist_*) behind; on a busy machine a graceful exit takes longer.
WORKER_EXIT_WAIT_S = "120"
_WCACHE_ERROR = re.compile(r"wcache\.[\w.]*Error: (.+)$")
_ANY_ERROR = re.compile(r"\b\w*(?:Error|Exception): .+$")
# The child's line before each engine's start: where one engine's log ends and the next one's begins.
_RUN_MARKER = "wcache-vllm-runner: run {index} starts"
_RUN_MARKER_LINE = re.compile(r"^wcache-vllm-runner: run (\d+) starts\n", re.M)
IN_PROCESS_ENGINE_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass(frozen=True, slots=True)
class VllmRun:
    """One engine start: the model, how vLLM loads it, and the prompts to run greedily."""

    model: str
    prompts: list[str]
    max_new_tokens: int
    load_format: str = "auto"
    extra_config: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int = 1024


@dataclass(frozen=True, slots=True)
class VllmResult:
    """Greedy token ids per prompt, and everything vLLM logged on the way (its load-format lines included)."""

    tokens: list[list[int]]
    log: str
    engine_ready_at: float  # epoch seconds when LLM(...) returned in the child
    generated_at: float  # epoch seconds when the last token was generated
    prompt_tokens: list[list[int]] = field(default_factory=list)  # each prompt as vLLM's tokenizer encoded it
    texts: list[str] = field(default_factory=list)  # each answer as vLLM's tokenizer decoded it


class VllmRunError(UnavailableError):
    """vLLM did not start or did not finish; the message is the reason it gave, `index` the run's place."""

    def __init__(self, message: str, log: str, index: int = 0) -> None:
        super().__init__(message)
        self.log = log
        self.index = index


def greedy_tokens(run: VllmRun, timeout: float | None = None) -> VllmResult:
    """Token ids vLLM generates at temperature 0 for each prompt, in a child of its own with vLLM's process
    layout as the environment sets it; VllmRunError with vLLM's reason otherwise."""
    [result] = _in_child([run], dict(os.environ), timeout)
    return result


def greedy_runs(runs: Sequence[VllmRun], timeout: float | None = None) -> list[VllmResult]:
    """Each run's greedy tokens, the engines started one after another in one child that imports vLLM once,
    each engine core in that child (unless the environment sets VLLM_ENABLE_V1_MULTIPROCESSING). The first
    run that fails raises VllmRunError (its `index` says which) and the runs after it do not start."""
    return _in_child(runs, {**IN_PROCESS_ENGINE_CORE, **os.environ}, timeout)


def _in_child(runs: Sequence[VllmRun], env: dict[str, str], timeout: float | None) -> list[VllmResult]:
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)
    env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", WORKER_EXIT_WAIT_S)
    with tempfile.TemporaryDirectory(prefix="wcache-vllm-") as scratch:
        spec, log_path = Path(scratch) / "runs.json", Path(scratch) / "vllm.log"
        results = [Path(scratch) / f"result-{index}.json" for index in range(len(runs))]
        spec.write_text(json.dumps({"runs": [asdict(run) for run in runs], "results": list(map(str, results))}))
        with log_path.open("w") as log:
            # vLLM's engine core and workers inherit the log, not a pipe: nothing waits on their output.
            process = subprocess.Popen(
                python_module_argv("wcache.integrations.vllm.runner", str(spec)), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=safe_path_env(env), start_new_session=True,
            )
            try:
                code = process.wait(timeout=timeout)
            finally:
                # The engine core and workers share the child's session: whatever is left of them goes too,
                # on success, on a timeout and on Ctrl-C alike.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        logs = _per_run(log_path.read_text(errors="replace"), len(runs))
        done = []
        for index, result in enumerate(results):
            if not result.exists():
                raise VllmRunError(_reason(logs[index], code), logs[index], index)
            out = json.loads(result.read_text())
            done.append(VllmResult([list(map(int, tokens)) for tokens in out["tokens"]], logs[index],
                                   float(out["engine_ready_at"]), float(out["generated_at"]),
                                   [list(map(int, tokens)) for tokens in out["prompt_tokens"]],
                                   [str(text) for text in out["texts"]]))
    return done


def _per_run(log: str, count: int) -> list[str]:
    """The child's log cut at its run markers: run i's part (what came before the first marker, vLLM's import,
    goes to run 0)."""
    parts = [""] * count
    pieces = _RUN_MARKER_LINE.split(log)  # [before run 0, "0", run 0's part, "1", run 1's part, ...]
    parts[0] = pieces[0]
    for index, part in zip(pieces[1::2], pieces[2::2], strict=True):
        parts[int(index)] += part
    return parts


def _reason(log: str, code: int) -> str:
    lines = log.splitlines()
    ours = [m.group(1).strip() for line in lines if (m := _WCACHE_ERROR.search(line))]
    if ours:
        return ours[-1].removeprefix("wcache: ").rstrip(".")
    # The first error a worker or the engine core raised is the root cause; the rest is its echo.
    theirs = [m.group(0).strip() for line in lines if (m := _ANY_ERROR.search(line))]
    if theirs:
        return f"vLLM failed: {theirs[0][-300:]}"
    return f"vLLM exited with code {code} and gave no reason"


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from wcache.integrations.vllm.api import LLM, SamplingParams, shutdown_engine

    for index, (fields, result) in enumerate(zip(spec["runs"], spec["results"], strict=True)):
        run = VllmRun(**fields)
        print(_RUN_MARKER.format(index=index), flush=True)
        llm = LLM(model=run.model, load_format=run.load_format, model_loader_extra_config=run.extra_config,
                  # vLLM types dtype as its Literal of names but checks any string itself; a plan's dtype is one.
                  tensor_parallel_size=run.tensor_parallel_size, dtype=run.dtype,  # type: ignore[arg-type]
                  max_model_len=run.max_model_len, enforce_eager=True, seed=0)
        ready = time.time()
        outputs = llm.generate(run.prompts, SamplingParams(temperature=0.0, max_tokens=run.max_new_tokens),
                               use_tqdm=False)
        # When the tokens were there, for start-up breakdowns: vLLM's shutdown after this is no part of it.
        Path(result).write_text(json.dumps({
            "tokens": [list(output.outputs[0].token_ids) for output in outputs], "engine_ready_at": ready,
            "generated_at": time.time(), "prompt_tokens": [list(output.prompt_token_ids or []) for output in outputs],
            "texts": [output.outputs[0].text for output in outputs]}))
        shutdown_engine(llm)
        del llm, outputs
        gc.collect()  # the engine's weights and KV cache, before the next engine allocates its own


if __name__ == "__main__":
    _child(sys.argv[1])
    # Every engine is shut down; the interpreter's own teardown of torch and vLLM (1.5-2.5 s of a core here)
    # would release nothing more.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_OK)
