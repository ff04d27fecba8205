"""The leases a following `wcache serve` launcher holds move with its server (`serve.follow.server_switch`), over
real daemons: a version published from the one served, and vLLM's switch stood in for (tests/test_serve_vllm.py
drives a real server through the whole of it)."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import pytest
from daemon_fixtures import DaemonRig, copy_checkpoint, preloaded_tiny, wait_for
from wcache.errors import UnavailableError
from wcache.integrations.vllm.switch import VllmSwitchError
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.serve import follow
from wcache.serve.daemons import ServedDaemons
from wcache_dev.synth import overwrite_tensor_bytes

URL = "http://127.0.0.1:9"  # never reached: the switch is stood in for


def _leases_become(rig: DaemonRig, parent: DaemonDescriptor, version: DaemonDescriptor,
                   counts: tuple[int, int]) -> None:
    """Wait until the parent and the version hold `counts` leases: a lease ends when its daemon reads the closed
    connection, a moment after the launcher closed it."""
    wait_for(lambda: (int(rig.stats(parent)["leases"]), int(rig.stats(version)["leases"])) == counts,
             timeout=10.0, what=f"the leases to become {counts}")


def test_the_leases_go_back_when_the_switch_is_refused_and_stay_when_the_server_moved(
        tiny_template: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with preloaded_tiny(tiny_template) as (rig, model, parent):
        step = copy_checkpoint(model, rig.base / "step")
        overwrite_tensor_bytes(step, "model.norm.weight", 0, bytes(8))
        _, name = rig.publish_step(parent.name, model, step)
        [version] = [d for d in rig.descriptors() if d.name == name]
        daemons = ServedDaemons([parent], None)
        daemons.hold_leases()
        said: list[str] = []
        recorded: list[tuple[str, ...]] = []
        restarts: list[None] = []  # a TP 1 server is moved in place, never restarted
        switch = follow.server_switch(URL, rig.run_dir, daemons, said.append, lambda: recorded.append(daemons.names),
                                      lambda: restarts.append(None))
        announced = [parent.key_id]  # what the server's rank 0 announces it serves
        monkeypatch.setattr(follow, "vllm_version", lambda url: "0.32.0")
        monkeypatch.setattr(follow, "served_key", lambda run_dir, url: announced[-1])
        try:
            def refused(*args: object) -> NoReturn:
                raise VllmSwitchError("vLLM keeps serving N")

            monkeypatch.setattr(follow, "switch_served", refused)
            with pytest.raises(VllmSwitchError):
                switch(version.name)
            assert daemons.names == (parent.name,) and recorded == [(parent.name,)]
            _leases_become(rig, parent, version, (1, 0))

            def failed_late(*args: object) -> NoReturn:
                announced.append(version.key_id)  # rank 0 reloaded before the switch failed
                raise UnavailableError("vLLM did not reset its prefix cache")

            monkeypatch.setattr(follow, "switch_served", failed_late)
            with pytest.raises(UnavailableError):
                switch(version.name)
            assert daemons.names == (version.name,) and recorded[-1] == (version.name,)
            _leases_become(rig, parent, version, (0, 1))
            # Nothing here holds N now: a loop stops it without --force.
            stopped = rig.cli("stop", parent.name, "--run-dir", str(rig.run_dir))
            assert stopped.returncode == 0, stopped.stderr
            assert said == [] and restarts == []
        finally:
            daemons.stop()
