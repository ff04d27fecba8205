"""A real vLLM server (the CPU build) stops answering from weights its daemon found changed in memory.

The server starts on good weights, then switches in place (`wcache switch URL`, vLLM's dev endpoints) to a daemon
whose arena holds one flipped bit (WCACHE_FAULT_FLIP, planted after the digests) well before that daemon's
first background re-check. Once the re-check finds the flip, the lease the vLLM worker holds hears of it; the
wcache loader's guard then fails the next step before it samples, so the completion fails instead of answering,
vLLM's engine core dies with the sentence, and /health stops answering 200.
"""

from __future__ import annotations

import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_fixtures import (
    DaemonRig,
    daemon_rig,
    http_status,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    wait_for,
)
from vllm_serving import ServedVllm, serving_vllm
from wcache.vllm_served import server_pids
from wcache_dev.synth import write_checkpoint

FLIPPED = "model.embed_tokens.weight"
AT = 1_000
SCRUB_INTERVAL_S = 30  # the switch attaches the flipped daemon well before its first re-check
PROMPT = "the weights cache keeps"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made, pytest.MonkeyPatch.context() as environment:
        environment.setenv("WCACHE_CACHE_DIR", made.env["WCACHE_CACHE_DIR"])
        yield made


def _not_healthy(server: ServedVllm) -> bool:
    try:
        return http_status(f"{server.url}/health", timeout=5)[0] != 200
    except OSError:  # the server exited after its engine core died (vLLM's default)
        return True


def test_a_vllm_engine_answers_nothing_from_weights_found_corrupt(rig: DaemonRig) -> None:
    good = write_checkpoint("small", rig.base / "good", seed=1)
    flipped = write_checkpoint("small", rig.base / "flipped", seed=0)  # same config and tokenizer, other bytes
    rig.preload(good)
    with serving_vllm(rig, good, {"run_dir": str(rig.run_dir)}) as server:
        assert server.complete(PROMPT, MAX_TOKENS)
        preloaded = rig.cli("preload", str(flipped), "--detach", "--run-dir", str(rig.run_dir), "--scrub-interval",
                            str(SCRUB_INTERVAL_S), env={"WCACHE_FAULT_FLIP": f"{FLIPPED}:{AT}"})
        rig._remember_supervisors()
        assert preloaded.returncode == 0, preloaded.stderr
        switched = rig.cli("switch", server.url, str(flipped), "--json", as_json=True, timeout=300)
        assert switched["attach"]["confirmed"], switched
        assert not rig.events("scrub_failed"), "the engine must hold its lease before the first re-check"
        assert server.complete(PROMPT, MAX_TOKENS), "before the finding, the engine answers"

        pids = server_pids(server.url) or set()
        found = wait_for(lambda: rig.events("scrub_failed"), timeout=SCRUB_INTERVAL_S + 60,
                         what="the flipped daemon's scrub_failed event")[0]
        assert found["tensor"] == FLIPPED and set(found["lease_pids"]) & pids, (found, pids)
        heard = wait_for(lambda: [e for e in rig.events("engine_weights_corrupt") if e["pid"] in pids], timeout=10,
                         what="the vLLM worker's engine_weights_corrupt event")
        assert heard[0]["tensor"] == FLIPPED

        # The next request gets an error, not tokens from the changed bytes; then vLLM is no longer healthy.
        with pytest.raises((urllib.error.HTTPError, urllib.error.URLError, ConnectionError)):
            server.complete(PROMPT, MAX_TOKENS)
        wait_for(lambda: _not_healthy(server), timeout=60, interval=1.0, what="vLLM's /health to stop saying 200")
        log = server.log.read_text()
        assert "WeightsCorruptError" in log and "this engine runs no step on them" in log, log[-3000:]
        assert f"tensor {FLIPPED!r}" in log


def test_the_guard_follows_the_lease_the_model_holds_now(tmp_path: Path) -> None:
    """In-process: the step guard raises while the lease the model holds was told of a change, and stops raising
    once a reload in place gives the model a lease on sound weights."""
    from wcache.attach import AttachedWeights
    from wcache.attach.report import AttachReport
    from wcache.integrations.vllm.loader import WeightsCorruptError, _keep_lease

    class Model(torch.nn.Module):
        def compute_logits(self, hidden: int) -> int:
            return hidden + 1

    def lease() -> AttachedWeights:  # no daemon behind it: the guard reads only its report
        report = AttachReport(outcome="hit", mode="zero_copy", device="cpu", key_id="k", daemon="d")
        return AttachedWeights({}, report, tmp_path, None)  # type: ignore[arg-type]

    model, first = Model(), lease()
    _keep_lease(model, first)
    assert model.compute_logits(1) == 2
    first.report.corrupt.add(FLIPPED, f"tensor {FLIPPED!r} changed in memory at its byte {AT}")
    with pytest.raises(WeightsCorruptError, match="runs no step on them"):
        model.compute_logits(1)
    _keep_lease(model, lease())
    assert model.compute_logits(1) == 2
