"""The plan vLLM will ask for, resolved in a child process that imports vLLM, so the launcher never does.

`python -m wcache.serve.plan_child MODEL TP DTYPE` prints one JSON line: `{"plan": …}`, or `{"error": …,
"exit_code": …}` with the sentence that refuses it (a quantization the daemons cannot serve, a bad checkpoint).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from wcache.errors import BadInputError, UnavailableError, WcacheError, marked
from wcache.ipc.interpreter import python_module_argv, safe_path_env
from wcache.plan.spec import PlanSpec

TIMEOUT_S = 600.0


def resolved_plan(model: Path, tp: int, dtype: str, env: Mapping[str, str]) -> PlanSpec:
    """Rank 0's plan of a vLLM server of `model` with `--tensor-parallel-size tp --dtype dtype`, as vLLM resolves
    it on this platform (`integrations.vllm.plan`); raises the child's sentence when vLLM or wcache refuses."""
    try:
        done = subprocess.run(python_module_argv(__name__, str(model), str(tp), dtype), capture_output=True,
                              text=True, env=safe_path_env(dict(env)), timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
                              check=False)
    except subprocess.TimeoutExpired:
        raise UnavailableError(f"resolving vLLM's plan for {model} took more than {TIMEOUT_S:g} s.") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        last = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
        raise UnavailableError(f"vLLM could not resolve the plan for {model} ({last}).")
    answer = json.loads(lines[-1])
    if "error" in answer:
        error = BadInputError if answer.get("exit_code") == BadInputError.exit_code else UnavailableError
        raise error(answer["error"])
    return PlanSpec.from_wire(answer["plan"])


def _main(model: str, tp: str, dtype: str) -> int:
    try:
        from wcache.integrations.vllm.plan import vllm_plan

        plan = vllm_plan(model, tensor_parallel_size=int(tp), dtype=dtype)
    except WcacheError as exc:
        print(json.dumps({"error": marked(exc), "exit_code": exc.exit_code}))
        return 0
    except Exception as exc:  # vLLM's own refusal of the model (an unknown architecture, a bad config)
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        print(json.dumps({"error": f"vLLM cannot serve {model}: {last}", "exit_code": BadInputError.exit_code}))
        return 0
    print(json.dumps({"plan": plan.to_wire()}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:4]))
