"""Greedy generation with a real vLLM engine in a child process, for `wcache verify --engine vllm`.

A child of its own (and its own session, so that vLLM's engine and worker processes go with it): vLLM
changes process-wide state (signal handlers, logging, environment), spawns workers that re-import the
parent's main module, and on a failed start leaves the reason only in its workers' log. The child writes
the tokens to a file; on failure the reason is the last wcache error in its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wcache.errors import UnavailableError
from wcache.ipc.interpreter import python_module_argv

# Small enough for the CPU backend on a laptop-sized machine; vLLM's own default takes 92% of RAM.
DEFAULT_KV_CACHE_GIB = "1"
_WCACHE_ERROR = re.compile(r"wcache\.[\w.]*Error: (.+)$")
_ANY_ERROR = re.compile(r"\b\w*(?:Error|Exception): .+$")


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


class VllmRunError(UnavailableError):
    """vLLM did not start or did not finish; the message is the reason it gave."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


def greedy_tokens(run: VllmRun, timeout: float | None = None) -> VllmResult:
    """Token ids vLLM generates at temperature 0 for each prompt; VllmRunError with vLLM's reason otherwise."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)
    with tempfile.TemporaryDirectory(prefix="wcache-vllm-") as scratch:
        spec, result, log_path = (Path(scratch) / name for name in ("run.json", "result.json", "vllm.log"))
        spec.write_text(json.dumps({"run": asdict(run), "result": str(result)}))
        with log_path.open("w") as log:
            # vLLM's engine core and workers inherit the log, not a pipe: nothing waits on their output.
            process = subprocess.Popen(
                python_module_argv("wcache.integrations.vllm_runner", str(spec)), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
            try:
                code = process.wait(timeout=timeout)
            finally:
                # The engine core and workers share the child's session: whatever is left of them goes too,
                # on success, on a timeout and on Ctrl-C alike.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        text = log_path.read_text(errors="replace")
        if result.exists():
            done = json.loads(result.read_text())
            return VllmResult([list(map(int, tokens)) for tokens in done["tokens"]], text,
                              float(done["engine_ready_at"]), float(done["generated_at"]))
    raise VllmRunError(_reason(text, code), text)


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
    run = VllmRun(**spec["run"])
    from wcache.integrations.vllm_api import LLM, SamplingParams

    llm = LLM(model=run.model, load_format=run.load_format, model_loader_extra_config=run.extra_config,
              # vLLM types dtype as its Literal of names but checks any string itself; a plan's dtype is one.
              tensor_parallel_size=run.tensor_parallel_size, dtype=run.dtype,  # type: ignore[arg-type]
              max_model_len=run.max_model_len,
              enforce_eager=True, seed=0)
    ready = time.time()
    outputs = llm.generate(run.prompts, SamplingParams(temperature=0.0, max_tokens=run.max_new_tokens),
                           use_tqdm=False)
    # When the tokens were there, for start-up breakdowns: vLLM's shutdown after this is no part of it.
    Path(spec["result"]).write_text(json.dumps({
        "tokens": [list(output.outputs[0].token_ids) for output in outputs], "engine_ready_at": ready,
        "generated_at": time.time()}))


if __name__ == "__main__":
    _child(sys.argv[1])
