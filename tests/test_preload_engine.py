"""`wcache preload MODEL --engine vllm`: the daemons hold the plan vLLM resolves on this platform, so the
README's vLLM example (a float32 checkpoint on CPU, where vLLM's `auto` is bfloat16) hits as written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives  # noqa: F401
from wcache_dev.synth import write_checkpoint


@pytest.fixture(scope="module")
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def test_engine_vllm_preloads_the_dtype_vllm_resolves_for_a_float32_checkpoint(rig: DaemonRig) -> None:
    model = write_checkpoint("tiny", rig.base / "tiny-float32")  # float32; vLLM's auto on CPU is bfloat16
    [daemon] = rig.preload(model, "--engine", "vllm")
    assert (daemon.plan.dtype, daemon.plan.layout, daemon.plan.tp_size) == ("bfloat16", "fused", 1)


def test_engine_vllm_refuses_a_plan_of_its_own_in_one_sentence(rig: DaemonRig) -> None:
    result = rig.cli("preload", str(rig.base / "tiny-float32"), "--engine", "vllm", "--plan", "identity",
                     "--run-dir", str(rig.run_dir))
    assert result.returncode != 0
    assert "--engine vllm takes its plan from vLLM; drop --quantization and --plan." in result.stderr
    assert "Traceback" not in result.stderr
