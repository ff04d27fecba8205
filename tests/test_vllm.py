"""Real vLLM engines (the CPU build) attach through the load format `wcache`.

One module-wide rig: the `small` checkpoint (head_dim 64, which vLLM's CPU attention accepts) with a daemon,
a copy whose lm_head differs under an unchanged header with a daemon of its own (for the planted wrong
hit), and a second such copy that no daemon holds (for the miss). Importing vLLM costs more than starting
an engine here, so the greedy runs whose subject is the tokens and the attach (not vLLM's process layout)
start their engines one after another in one child with each engine core in it (`greedy_runs`, as `wcache
verify` does). The wcache loader still runs in a child of its own, never in pytest. The OpenAI server keeps
vLLM's multi-process layout: it loads through the entry-point plugin in a spawned engine core. One server
for the module (`served_vllm`, with vLLM's dev endpoints) answers completions, shows in `wcache top`, then
switches to the copy's daemon in place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_fixtures import (
    DaemonRig,
    copy_checkpoint,
    daemon_rig,
    nothing_survives,  # noqa: F401
    )
from helpers import VLLM_IN_PYTEST, plant_wcache
from vllm_serving import ServedVllm, serving_vllm
from wcache.errors import BadInputError
from wcache.integrations.vllm.runner import VllmRun, VllmRunError, greedy_runs
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache_dev.synth import overwrite_tensor_bytes, write_checkpoint

PROMPTS = ["the weights cache keeps", "a daemon holds the shard and"]
MAX_NEW_TOKENS = 8
VICTIM = "lm_head.weight"  # zeroed past its first rows: greedy tokens change, the header does not
VICTIM_BYTES = 320 * 128 * 2  # the small preset's vocab × hidden, bf16


@dataclass
class VllmRig:
    rig: DaemonRig
    original: Path
    served_copy: Path  # a zeroed copy that a daemon holds (the planted wrong hit)
    unserved_copy: Path  # a differently zeroed copy that no daemon holds (the miss)
    daemon: DaemonDescriptor
    copy_daemon: DaemonDescriptor

    def run(self, model: Path, **fields: object) -> VllmRun:
        return VllmRun(str(model), PROMPTS, MAX_NEW_TOKENS, **fields)  # type: ignore[arg-type]

    def extra(self, **options: object) -> dict[str, object]:
        return {"run_dir": str(self.rig.run_dir), **options}


@pytest.fixture(scope="module")
def vllm_rig() -> Iterator[VllmRig]:
    with daemon_rig() as rig, pytest.MonkeyPatch.context() as environment:
        original = write_checkpoint("small", rig.base / "small")
        served = copy_checkpoint(original, rig.base / "small-zeroed")
        overwrite_tensor_bytes(served, VICTIM, 1024, bytes(VICTIM_BYTES - 1024))
        unserved = copy_checkpoint(original, rig.base / "small-zeroed-2")
        overwrite_tensor_bytes(unserved, VICTIM, 2048, bytes(VICTIM_BYTES - 2048))
        [daemon] = rig.preload(original)
        [copy_daemon] = rig.preload(served)
        # greedy_runs passes this process's environment on to vLLM: keep its digest store private too.
        environment.setenv("WCACHE_CACHE_DIR", rig.env["WCACHE_CACHE_DIR"])
        yield VllmRig(rig, original, served, unserved, daemon, copy_daemon)


def test_hit_gives_the_greedy_tokens_of_vllms_own_disk_load(vllm_rig: VllmRig) -> None:
    rig = vllm_rig.rig
    result = rig.cli("verify", str(vllm_rig.original), "--greedy", "--engine", "vllm", "--num-prompts", "2",
                     "--max-new-tokens", str(MAX_NEW_TOKENS), "--run-dir", str(rig.run_dir), "--json",
                     timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    greedy = json.loads(result.stdout)["greedy"]
    assert greedy["all_match"] and all(p["cached_tokens"] for p in greedy["prompts"])
    assert greedy["attach"]["outcome"] == "hit" and greedy["attach"]["daemon"] == vllm_rig.daemon.name
    [hit] = [e for e in rig.events("attach_hit") if e.get("engine") == "vllm"]
    assert hit["daemon"] == vllm_rig.daemon.name and hit["mode"] == "zero_copy" and hit["pid"] != os.getpid()
    # vLLM attached in its own process: the report is that process's hit, as the run dir's events tell it.
    assert greedy["attach"]["hits"] == [{"daemon": hit["daemon"], "pid": hit["pid"], "timings_ms": hit["timings_ms"]}]
    assert (greedy["attach"]["engine"], greedy["attach"]["key_id"]) == ("vllm", hit["key_id"])


@pytest.mark.xdist_group("test_vllm-wrong-hit")  # its engines overlap the others (tests/conftest.py)
def test_planted_wrong_hit_fails_verify_with_vllm(vllm_rig: VllmRig) -> None:
    rig = vllm_rig.rig
    result = rig.cli("verify", str(vllm_rig.original), "--greedy", "--engine", "vllm", "--trust-daemon",
                     "--daemon", vllm_rig.copy_daemon.name, "--num-prompts", "2", "--max-new-tokens",
                     str(MAX_NEW_TOKENS), "--run-dir", str(rig.run_dir), "--json", timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    greedy = json.loads(result.stdout)["greedy"]
    assert greedy["attach"]["daemon"] == vllm_rig.copy_daemon.name
    assert not greedy["all_match"]
    assert all(p["first_divergence"] is not None for p in greedy["prompts"] if not p["match"])


@pytest.mark.xdist_group("test_vllm-changed-copy")
def test_changed_copy_misses_and_serves_its_own_tokens(vllm_rig: VllmRig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = vllm_rig.rig
    # Run from a directory holding a `wcache/` package: the runner must import the installed one, and so must
    # the interpreters vLLM starts itself: with no model info cached, its registry inspects the model class in
    # `python -m vllm.model_executor.models.registry`, which loads the plugins, wcache's among them.
    marker = rig.base / "planted-code-ran"
    monkeypatch.chdir(plant_wcache(rig.base / "cwd", marker))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(rig.base / "vllm-cache"))
    runs = [
        vllm_rig.run(vllm_rig.unserved_copy, load_format="wcache", extra_config=vllm_rig.extra()),
        vllm_rig.run(vllm_rig.unserved_copy),
        vllm_rig.run(vllm_rig.original, load_format="wcache", extra_config=vllm_rig.extra()),
    ]
    cached, disk, original = greedy_runs(runs)
    assert not marker.exists(), marker.read_text()
    assert cached.tokens == disk.tokens, "the fallback must serve the copy's own weights"
    assert cached.tokens != original.tokens, "the zeroed lm_head must change the tokens"
    [warning] = [line for line in cached.log.splitlines() if "wcache: weight cache miss" in line]
    assert "WARNING" in warning and VICTIM in warning and "falling back to disk loading" in warning
    [miss] = [e for e in rig.events("attach_miss") if e.get("engine") == "vllm"]
    assert miss["source"] == str(vllm_rig.unserved_copy) and miss["diff"]["changed"] == [VICTIM]
    [fallback] = [e for e in rig.events("fallback") if e.get("engine") == "vllm"]
    assert VICTIM in fallback["reason"]


def test_fallback_false_refuses_to_start_and_names_the_tensor(vllm_rig: VllmRig) -> None:
    run = vllm_rig.run(vllm_rig.unserved_copy, load_format="wcache", extra_config=vllm_rig.extra(fallback=False))
    with pytest.raises(VllmRunError) as failure:
        greedy_runs([run])
    message = str(failure.value)
    assert VICTIM in message and "fallback is false" in message, message
    assert "\n" not in message


@VLLM_IN_PYTEST
def test_unknown_extra_config_key_is_one_clear_error() -> None:
    from vllm.config.load import LoadConfig
    from wcache.integrations.vllm.loader import WcacheModelLoader

    with pytest.raises(BadInputError, match=r"unknown wcache option 'fallbak'.*the options are fallback, mode"):
        WcacheModelLoader(LoadConfig(load_format="wcache", model_loader_extra_config={"fallbak": False}))
    with pytest.raises(BadInputError, match="mode must be zero_copy or copy"):
        WcacheModelLoader(LoadConfig(load_format="wcache", model_loader_extra_config={"mode": "mmap"}))
    loader = WcacheModelLoader(LoadConfig(load_format="wcache", model_loader_extra_config={"mode": "copy"}))
    assert loader.options.mode == "copy" and loader.options.fallback


@VLLM_IN_PYTEST
def test_the_plugin_is_found_through_vllms_entry_point() -> None:
    from importlib.metadata import entry_points

    [plugin] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "wcache"]
    plugin.load()()
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(LoadConfig(load_format="wcache"))
    assert type(loader).__name__ == "WcacheModelLoader"
    # vLLM's own weight cache loader is untouched.
    assert type(get_model_loader(LoadConfig(load_format="ipc_cache"))).__name__ != "WcacheModelLoader"


@pytest.fixture(scope="module")
def served_vllm(vllm_rig: VllmRig) -> Iterator[ServedVllm]:
    """One OpenAI server for the module, on the original's daemon, with vLLM's dev endpoints (a switch's)."""
    with serving_vllm(vllm_rig.rig, vllm_rig.original, vllm_rig.extra()) as server:
        yield server


def _complete(server: ServedVllm, prompt: str) -> list[int]:
    return server.complete(prompt, MAX_NEW_TOKENS)


@pytest.mark.xdist_group("test_vllm-served")  # one server for both (tests/conftest.py)
def test_served_vllm_answers_completions_and_shows_in_top(vllm_rig: VllmRig, served_vllm: ServedVllm) -> None:
    rig = vllm_rig.rig
    assert _complete(served_vllm, PROMPTS[0])
    text = served_vllm.log.read_text()
    assert "wcache: weight cache hit from daemon " + vllm_rig.daemon.name in text
    # No --scrape: the rank announced itself, with its server's URL read from the server's command line.
    top = rig.cli("top", "--once", "--json", "--interval", "0.5", "--run-dir", str(rig.run_dir), as_json=True)
    [engine] = [e for e in top["engines"] if e["url"] == served_vllm.url]
    assert engine["kind"] == "vllm" and engine["up"] and engine["model"] == "small", engine
    assert (engine["weights"], engine["daemon"], engine["key_id"]) == ("hit", vllm_rig.daemon.name,
                                                                      vllm_rig.daemon.key_id), engine
    assert engine["kv_usage"] is not None and engine["requests_done"] >= 1, engine
    status = rig.cli("status", "--json", "--run-dir", str(rig.run_dir), as_json=True)
    assert served_vllm.url in {e["url"] for e in status["engines"]}, status["engines"]
    assert {d["plan"] for d in status["daemons"]} == {"bfloat16 tp1"}, status["daemons"]
    assert vllm_rig.daemon.name in {d["name"] for d in top["daemons"]}
    # The zero-copy engine holds a lease on the daemon it maps.
    assert rig.stats(vllm_rig.daemon)["leases"] >= 1


@pytest.mark.xdist_group("test_vllm-served")
def test_served_vllm_switches_in_place_and_verifies(vllm_rig: VllmRig, served_vllm: ServedVllm) -> None:
    """`wcache switch URL` moves the served engine to the copy's daemon: its tokens are then a fresh disk load's
    of the copy (`wcache verify URL --greedy`); a switch no daemon serves is refused and changes nothing."""
    rig, url = vllm_rig.rig, served_vllm.url
    before = _complete(served_vllm, PROMPTS[0])
    refused = rig.cli("switch", url, str(vllm_rig.unserved_copy))
    assert refused.returncode == 3 and "vLLM keeps serving" in refused.stderr, refused.stderr
    assert VICTIM in refused.stderr and "\n" not in refused.stderr.strip(), refused.stderr
    assert _complete(served_vllm, PROMPTS[0]) == before, "a refused switch must leave the old weights serving"
    result = rig.cli("switch", url, "--daemon", vllm_rig.copy_daemon.name, "--json", as_json=True)
    assert result["current"]["key_id"] == vllm_rig.copy_daemon.key_id, result
    assert result["current"]["model"] == str(vllm_rig.served_copy) and result["attach"]["confirmed"], result
    assert result["previous"]["key_id"] == vllm_rig.daemon.key_id, result
    assert _complete(served_vllm, PROMPTS[0]) != before, "the copy's zeroed lm_head must change the tokens"
    verified = rig.cli("verify", url, "--greedy", "--num-prompts", "2", "--max-new-tokens", str(MAX_NEW_TOKENS),
                       "--json", timeout=600)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    greedy = json.loads(verified.stdout)["greedy"]
    assert greedy["all_match"] and greedy["attach"]["model"] == str(vllm_rig.served_copy), greedy
    served = greedy["attach"]
    assert (served["outcome"], served["key_id"], served["url"]) == ("hit", vllm_rig.copy_daemon.key_id, url), served
    back = rig.cli("switch", url, str(vllm_rig.original), "--json", as_json=True)
    assert back["current"]["key_id"] == vllm_rig.daemon.key_id
    assert _complete(served_vllm, PROMPTS[0]) == before, "back on the original, with a reset prefix cache"


@pytest.mark.xdist_group("test_vllm-served")
def test_verify_names_a_tokenizer_the_served_vllm_holds_but_its_files_do_not(vllm_rig: VllmRig,
                                                                           served_vllm: ServedVllm) -> None:
    """vLLM read its tokenizer at start; the checkpoint's tokenizer.json rewritten since (the ids of "a" and "c"
    swapped) is what a disk load reads. `verify URL --greedy` encodes each prompt through the server's own
    POST /tokenize too, so the difference is named, whatever the greedy tokens say."""
    rig = vllm_rig.rig
    tokenizer = vllm_rig.original / "tokenizer.json"  # what the server serves (the switch test switches back)
    saved = tokenizer.read_bytes()
    document = json.loads(saved)
    vocab = document["model"]["vocab"]
    vocab["a"], vocab["c"] = vocab["c"], vocab["a"]
    prompts = rig.base / "tokenizer-prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n")
    tokenizer.write_text(json.dumps(document))
    try:
        verified = rig.cli("verify", served_vllm.url, "--greedy", "--prompts", str(prompts), "--max-new-tokens",
                           str(MAX_NEW_TOKENS), "--json", timeout=600)
    finally:
        tokenizer.write_bytes(saved)
    assert verified.returncode == 1, verified.stdout + verified.stderr
    problem = json.loads(verified.stdout)["greedy"]["problem"]
    assert problem.startswith("the engine's own tokenizer encodes prompt 0 otherwise than the tokenizer files of "
                              f"{vllm_rig.original} (from token "), problem
    assert f"{ord('a')}" in problem and "so it serves with another tokenizer than the checkpoint it claims" in problem

