"""A running vLLM engine (the CPU build, offline `LLM`) switches between daemons' checkpoints in place.

One engine start: vLLM loads version 0 of `small` from disk with its own loader (`load_format="auto"`), so
its tokens are a fresh disk load's; `wcache.integrations.vllm.switch.switch` then moves it to version 1's
daemon, back to version 0's (whose tokens must equal the disk load's again, although the prompts' blocks
were cached under version 1: the prefix cache must have been reset), refuses version 2 (no daemon) while
it keeps serving version 0, and moves to version 1 again (the same tokens as the first time).
Run under the vLLM lock (`flock /tmp/wcache-vllm.lock`), as every real-vLLM test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives  # noqa: F401
from helpers import run_python
from wcache_dev.synth import write_checkpoint

# vLLM's engine core in the process that drives it: one interpreter importing vLLM instead of three.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
CHILD = r"""
import json, sys

def main():
    versions, run_dir = sys.argv[1:4], sys.argv[4]
    from vllm import LLM, SamplingParams
    from wcache.integrations.vllm.switch import VllmSwitchError, switch

    shared = "the weights cache keeps processed tensors in a daemon so that "
    prompts = [shared + "one", shared + "two"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(versions[0], load_format="auto", max_model_len=256, enforce_eager=True, enable_prefix_caching=True,
              seed=0)

    def tokens():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    out = {"disk_0": tokens()}
    switch(llm, versions[1], run_dir=run_dir)
    out["switched_1"] = tokens()
    switch(llm, versions[0])
    out["switched_0"] = tokens()
    try:
        switch(llm, versions[2])
        out["refused"] = None
    except VllmSwitchError as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = tokens()
    switch(llm, versions[1])
    out["switched_1_again"] = tokens()
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def versions() -> Iterator[tuple[DaemonRig, list[Path]]]:
    with daemon_rig() as rig:
        paths = [write_checkpoint("small", rig.base / f"v{seed}", seed=seed) for seed in (0, 1, 2)]
        rig.preload(paths[0])
        rig.preload(paths[1])
        yield rig, paths


def test_vllm_switches_in_place_and_refuses_a_checkpoint_no_daemon_holds(
    versions: tuple[DaemonRig, list[Path]],
) -> None:
    rig, paths = versions
    result = run_python(CHILD, *map(str, paths), str(rig.run_dir), env={**rig.env, **ENV}, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-5000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["switched_1"] != out["disk_0"], "the versions must answer differently to tell them apart"
    assert out["switched_0"] == out["disk_0"], "after switching back, vLLM must answer as its disk load did"
    assert out["switched_1_again"] == out["switched_1"]
    assert out["refused"] is not None and "differs in checkpoint" in out["refused"], out["refused"]
    assert out["after_refusal"] == out["disk_0"], "a refused switch must leave the old weights serving"
    key_of = {Path(d.source).name: d.key_id for d in rig.descriptors()}
    hits = [e["key_id"] for e in rig.events("attach_hit") if e.get("engine") == "vllm"]
    assert hits == [key_of["v1"], key_of["v0"], key_of["v1"]], "one hit per switch, on the named version's daemon"
    assert [e for e in rig.events("attach_miss") if e.get("engine") == "vllm"], "the refusal is a miss event"
