"""A served reference engine switches to another daemon's weights between requests (`wcache switch`, POST
/v1/weights), refuses a switch nothing serves while it keeps serving, and `wcache verify URL` checks what it
serves against a disk load of the checkpoint it claims.

One path, two contents: `m/` holds version 0 or version 1 of tiny (other random weights, same config), its
shards rewritten in place between switches; two daemons, preloaded from that same path, hold one version
each. Expected tokens come from disk engines of each version in this process.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import stat
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from as_nobody import nobody_tree, run_as_nobody
from daemon_fixtures import (
    DaemonRig,
    daemon_rig,
    http_status,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
)
from engine_serving import Server, post, serving
from helpers import WCACHE
from prometheus_client.parser import text_string_to_metric_families
from wcache.engine import Engine, EngineConfig
from wcache.serving.api import SwitchAnswer, WeightsSwitched
from wcache_dev.synth import PRESETS, write_byte_tokenizer, write_checkpoint, write_training_step

# Four prompts sharing 64 tokens (four blocks of 16, past tiny's 32-token window), then their own tails.
SHARED = "Weights change between requests; the cache must not remember them. "[:64]
PROMPTS = [SHARED + tail for tail in ("one tail.", "another tail!", "a third, longer tail here", "4")]
MAX_TOKENS = 3
SWITCHES = 100


@dataclass
class Versions:
    rig: DaemonRig
    path: Path  # the one checkpoint path every version is written to
    sources: list[Path]  # each version's files, to copy into `path`
    keys: list[str]  # short key of each version
    expected: dict[str, list[list[int]]]  # short key → greedy tokens of each prompt, loaded from disk

    def become(self, version: int) -> None:
        """Rewrite the checkpoint's shards in place with another version's bytes (each replaced atomically)."""
        for shard in sorted(self.sources[version].glob("*.safetensors")):
            temporary = self.path / f".{shard.name}.tmp"
            shutil.copyfile(shard, temporary)
            os.replace(temporary, self.path / shard.name)


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Versions]:
    with daemon_rig() as rig:
        sources = [write_checkpoint("tiny", rig.base / f"v{seed}", seed=seed) for seed in (0, 1, 2)]
        path = rig.base / "m"
        shutil.copytree(sources[0], path)
        keys, expected = [], {}
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("WCACHE_CACHE_DIR", str(rig.cache_dir))
            for source in sources:
                disk = Engine.from_disk(source, engine_config=EngineConfig(enable_prefix_caching=False))
                assert disk.tokenizer is not None and disk.served.key_id is not None
                keys.append(disk.served.key_id)
                expected[disk.served.key_id] = [disk.generate(disk.tokenizer.encode(p), MAX_TOKENS).token_ids
                                                for p in PROMPTS]
        assert expected[keys[0]] != expected[keys[1]], "the versions must answer differently to tell them apart"
        found = Versions(rig, path, sources, keys, expected)
        (daemon_0,) = rig.preload(path)
        found.become(1)
        (daemon_1,) = rig.preload(path)
        assert [daemon_0.key_id, daemon_1.key_id] == keys[:2] and daemon_0.source == daemon_1.source
        found.become(0)
        yield found


@pytest.fixture(autouse=True)
def at_version_0(versions: Versions) -> None:
    """Every test starts with version 0 on disk, whatever the one before left there."""
    versions.become(0)


@pytest.fixture(scope="module")
def server(versions: Versions) -> Iterator[Server]:
    """One engine for every test. Without bounded replay: an adopted hit then reuses stored KV exactly, so every
    answer, hit or not, must equal its version's cold tokens (a replayed window may differ by design; the
    in-process tests/test_prefix_cache_by_weights.py covers replay)."""
    with serving(versions.rig, versions.path, "--no-swa-bounded-replay") as running:
        token = versions.rig.run_dir / "engines" / f"{running.process.pid}.token"
        yield running
        assert running.stop() == 0
        assert not token.exists(), "a stopped engine leaves its control token behind"


@pytest.fixture
def engine(versions: Versions, server: Server) -> Server:
    """The module's engine, serving version 0 whatever the test before switched it to."""
    if http_status(f"{server.url}/v1/weights")[1]["key_id"] != versions.keys[0]:  # type: ignore[index]
        code, answer = switch_http(server, versions.path)
        assert code == 200, answer
    return server


def complete(server: Server, prompt: str) -> dict[str, Any]:
    code, answer = post(server.url, json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS}).encode())
    assert code == 200, answer
    return answer


def switch_http(server: Server, model: Path) -> tuple[int, Any]:
    return post(server.url, json.dumps({"model": str(model)}).encode(), "/v1/weights", server.token())


def by_weights(url: str, name: str) -> dict[str, float]:
    """One per-weights counter of /metrics by its `weights` label."""
    code, text = http_status(f"{url}/metrics")
    assert code == 200 and isinstance(text, str)
    return {s.labels["weights"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_switch_serves_the_new_weights_with_a_cache_of_their_own(versions: Versions, engine: Server) -> None:
    rig, keys, server = versions.rig, versions.keys, engine
    hits_before = by_weights(server.url, "wcache:prefix_cache_hits_by_weights_total")
    switches_before = len(rig.events("engine_switch"))
    assert http_status(f"{server.url}/v1/weights")[1]["key_id"] == keys[0]  # type: ignore[index]
    complete(server, PROMPTS[0])
    assert complete(server, PROMPTS[0])["wcache"]["hit_tokens"] == 64

    versions.become(1)
    result = rig.cli("switch", server.url, str(versions.path), "--json", as_json=True)
    assert (result["previous"]["key_id"], result["current"]["key_id"]) == (keys[0], keys[1])
    assert result["attach"]["outcome"] == "hit" and result["current"]["model"] == str(versions.path)
    answer = complete(server, PROMPTS[0])
    assert answer["wcache"]["weights_key"] == keys[1]
    assert answer["wcache"]["hit_tokens"] == 0, "a block computed under version 0 hit under version 1"
    assert answer["choices"][0]["token_ids"] == versions.expected[keys[1]][0]
    code, claimed = http_status(f"{server.url}/v1/weights")
    assert code == 200 and isinstance(claimed, dict) and claimed["key_id"] == keys[1]
    announced = json.loads((rig.run_dir / "engines" / f"{server.process.pid}.json").read_text())
    assert announced["key_id"] == keys[1] and announced["attach"]["daemon"] == f"cpu-{keys[1]}"

    checked = rig.cli("verify", server.url, "--greedy", "--json", as_json=True)
    served = checked["greedy"]["attach"]
    assert checked["ok"] and (served["engine"], served["url"], served["key_id"]) == (
        "reference (served)", server.url, keys[1])
    assert served["report"] == announced["attach"], "verify reads the report the engine announced"
    assert len(checked["greedy"]["prompts"]) == 4

    hits = by_weights(server.url, "wcache:prefix_cache_hits_by_weights_total")
    assert hits[keys[0]] - hits_before.get(keys[0], 0) == 64 and hits[keys[1]] == hits_before.get(keys[1], 0)
    top = rig.cli("top", "--once", "--json", "--interval", "0.2", "--run-dir", str(rig.run_dir), as_json=True)
    (row,) = [e for e in top["engines"] if e["url"] == server.url]
    assert row["key_id"] == keys[1]
    assert [key for key, _ in row["hit_rate_by_weights"]] == [keys[1], keys[0]]
    switched = rig.events("engine_switch")[switches_before:]
    assert [(e["engine_pid"], e["previous_key_id"], e["key_id"]) for e in switched] == [
        (server.process.pid, keys[0], keys[1])]


def test_a_switch_nothing_serves_is_refused_and_the_engine_keeps_serving(versions: Versions, engine: Server) -> None:
    rig, keys, server = versions.rig, versions.keys, engine
    other = rig.base / "other-architecture"
    write_checkpoint("small", other)
    versions.become(2)  # version 2 has no daemon
    code, answer = switch_http(server, versions.path)
    refusal = rig.events("switch_refused")[-1]["reason"]
    assert code == 409 and refusal in answer["error"]["message"] and len(refusal) > 200, answer  # whole, not cut
    refused = rig.cli("switch", server.url, str(versions.path))
    assert refused.returncode == 3, refused.stderr
    assert f"still serving {keys[0]}" in refused.stderr and "differs in checkpoint" in refused.stderr
    versions.become(0)
    assert complete(server, PROMPTS[1])["choices"][0]["token_ids"] == versions.expected[keys[0]][1]

    architecture = rig.cli("switch", server.url, str(other))
    assert architecture.returncode == 2 and "another architecture" in architecture.stderr
    nobody = rig.cli("switch", server.url, "--daemon", "cpu-000000000000")
    assert nobody.returncode == 3 and "0 running daemons" in nobody.stderr
    for body in (b"{}", b'{"model": 3}', b'{"model": "relative/path"}', b'{"mdl": "/x"}', b"[]"):
        code, answer = post(server.url, body, "/v1/weights", server.token())
        assert code == 400 and answer["error"]["message"], (body, answer)
    code, claimed = http_status(f"{server.url}/v1/weights")
    assert isinstance(claimed, dict) and claimed["key_id"] == keys[0]
    assert complete(server, PROMPTS[2])["choices"][0]["token_ids"] == versions.expected[keys[0]][2]
    assert [e["reason"] for e in rig.events("switch_refused")], "the refusal is an event"


def test_a_switch_to_the_same_tensors_with_another_tokenizer_is_refused_by_name(versions: Versions,
                                                                               engine: Server) -> None:
    """Copies of version 0's tensors and config beside a tokenizer.json of their own: another key, so no daemon
    serves it and the engine keeps serving version 0 with its own tokenizer."""
    rig, keys, server = versions.rig, versions.keys, engine
    retokenized = rig.base / "retokenized"
    shutil.copytree(versions.sources[0], retokenized)
    write_byte_tokenizer(retokenized, PRESETS["tiny"].config)
    refused = rig.cli("switch", server.url, str(retokenized))
    assert refused.returncode == 3, refused.stderr
    assert f"still serving {keys[0]}" in refused.stderr and "tokenizer.json" in refused.stderr
    assert "Traceback" not in refused.stderr
    code, claimed = http_status(f"{server.url}/v1/weights")
    assert code == 200 and isinstance(claimed, dict)
    assert claimed["key_id"] == keys[0] and claimed["model"] == str(versions.path)
    assert complete(server, PROMPTS[3])["choices"][0]["token_ids"] == versions.expected[keys[0]][3]


def test_verify_of_a_served_engine_finds_a_claim_the_checkpoint_no_longer_backs(versions: Versions,
                                                                                engine: Server) -> None:
    rig, keys, server = versions.rig, versions.keys, engine
    versions.become(1)  # the files change under the engine, which still serves version 0
    stale = rig.cli("verify", server.url, "--greedy", "--json")
    versions.become(0)
    assert stale.returncode == 1, stale.stderr
    report = json.loads(stale.stdout)["greedy"]
    assert f"claims key {keys[0]}" in report["problem"] and keys[1] in report["problem"]
    assert rig.cli("verify", server.url, "--greedy", "--num-prompts", "2").returncode == 0
    assert rig.cli("verify", server.url, "--content").returncode == 2

    # Same tensors, another tokenizer under the engine (it encodes with the one it loaded): its claimed key,
    # which covers the tokenizer, is no longer the checkpoint's, so nothing reads VERIFIED.
    write_byte_tokenizer(versions.path, PRESETS["tiny"].config)
    try:
        retokenized = rig.cli("verify", server.url, "--greedy", "--json")
    finally:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (versions.path / name).unlink()
    assert retokenized.returncode == 1, retokenized.stderr
    assert f"claims key {keys[0]}" in json.loads(retokenized.stdout)["greedy"]["problem"]


def test_a_hundred_switches_under_load_never_mix_versions(versions: Versions, engine: Server) -> None:
    """Concurrent shared-prefix requests while the one path alternates between versions 0 and 1 and the engine
    switches after each rewrite. Every answer must equal the cold tokens of the version that ran it; a block
    of the other version hitting would break that."""
    keys, server = versions.keys, engine
    answers: list[tuple[int, dict[str, Any]]] = []
    failures: list[str] = []
    stop = threading.Event()

    def client(offset: int) -> None:
        turn = offset
        while not stop.is_set():
            index = turn % len(PROMPTS)
            code, answer = post(server.url, json.dumps({"prompt": PROMPTS[index], "max_tokens": MAX_TOKENS}).encode())
            if code != 200:
                failures.append(f"{code} {answer}")
            answers.append((index, answer))
            turn += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    try:
        for n in range(SWITCHES):
            version = (n + 1) % 2
            versions.become(version)
            code, result = switch_http(server, versions.path)
            assert code == 200 and result["current"]["key_id"] == keys[version], result
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not failures, failures[:3]
    wrong = [(i, a["wcache"]["weights_key"], a["choices"][0]["token_ids"]) for i, a in answers
             if a["choices"][0]["token_ids"] != versions.expected[a["wcache"]["weights_key"]][i]]
    assert not wrong, f"{len(wrong)} of {len(answers)} answers are not their version's tokens: {wrong[:3]}"
    served = {a["wcache"]["weights_key"] for _, a in answers}
    assert served == set(keys[:2]), served
    hits = by_weights(server.url, "wcache:prefix_cache_hits_by_weights_total")
    assert hits[keys[0]] > 0 and hits[keys[1]] > 0, "the cache still serves each version its own blocks"
    code, text = http_status(f"{server.url}/metrics")
    assert isinstance(text, str) and "wcache:prefix_cache_cross_version_refusals_total" in text
    refusals = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "wcache:prefix_cache_cross_version_refusals_total"]
    assert refusals == [0.0]
    print(f"{SWITCHES} switches, {len(answers)} answers, "
          f"{sum(1 for _, a in answers if a['wcache']['hit_tokens'])} with prefix hits")


# -- who may switch: the engine's own user, by its control token ------------------------------------------


def test_a_switch_without_the_engines_token_is_refused_and_changes_nothing(versions: Versions,
                                                                           engine: Server) -> None:
    rig, keys, server = versions.rig, versions.keys, engine
    token_file = rig.run_dir / "engines" / f"{server.process.pid}.token"
    mode = token_file.stat()
    assert (stat.S_IMODE(mode.st_mode), mode.st_uid) == (0o600, os.getuid())
    token = server.token()
    versions.become(1)  # a daemon serves version 1: with the token, this switch would happen
    body = json.dumps({"model": str(versions.path)}).encode()
    switches_before = len(rig.events("engine_switch"))
    for sent, status in ((None, 401), ("", 401), ("x" * len(token), 403), (token[:-1], 403), (token + "x", 403)):
        headers = {"Content-Type": "application/json"}
        if sent is not None:
            headers["Authorization"] = f"Bearer {sent}"
        connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
        connection.request("POST", "/v1/weights", body=body, headers=headers)
        reply = connection.getresponse()
        answer = json.loads(reply.read())
        connection.close()
        assert reply.status == status, (sent, answer)
        assert "control token" in answer["error"]["message"], answer
        if status == 401:
            assert reply.getheader("WWW-Authenticate") == 'Bearer realm="wcache"'
    code, claimed = http_status(f"{server.url}/v1/weights")
    assert code == 200 and isinstance(claimed, dict) and claimed["key_id"] == keys[0]
    assert len(rig.events("engine_switch")) == switches_before
    assert complete(server, PROMPTS[0])["wcache"]["weights_key"] == keys[0]

    code, answer = post(server.url, body, "/v1/weights", token)
    assert code == 200 and answer["current"]["key_id"] == keys[1], answer
    # The reply is what its schema writes, every field in order; `wcache switch` reads it through the same type.
    switched = WeightsSwitched.from_wire(answer)
    assert json.dumps(switched.to_wire()) == json.dumps(answer), answer
    assert switched.attach.outcome == "hit" and SwitchAnswer.from_wire(answer).attach.daemon == switched.attach.daemon


def test_another_local_user_cannot_switch_the_engine(versions: Versions, engine: Server) -> None:
    """As root, `wcache switch` runs as uid 65534 (its own run dir, no way into root's); otherwise as this user
    with a run dir of its own, which is all another user has: one sentence, exit 2, the engine unchanged."""
    rig, keys, server = versions.rig, versions.keys, engine
    daemon = f"cpu-{keys[1]}"
    versions.become(1)  # the daemon's checkpoint is version 1 again: without the token check, this would switch
    if os.geteuid() == 0:
        with nobody_tree() as (base, env):
            token_file = rig.run_dir / "engines" / f"{server.process.pid}.token"
            read = run_as_nobody([sys.executable, "-c", f"open({str(token_file)!r}).read()"], env, cwd=base)
            assert read.returncode != 0 and "PermissionError" in read.stderr, read.stderr
            result = run_as_nobody([*WCACHE, "switch", server.url, "--daemon", daemon], env, cwd=base)
    else:
        other = rig.base / "other-user-run"
        other.mkdir(mode=0o700, exist_ok=True)
        result = rig.cli("switch", server.url, "--daemon", daemon, env={"WCACHE_RUN_DIR": str(other)})
    everything = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in everything, everything
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "control token" in lines[0], result.stderr
    code, claimed = http_status(f"{server.url}/v1/weights")
    assert code == 200 and isinstance(claimed, dict) and claimed["key_id"] == keys[0]


@pytest.mark.parametrize("model", ["/tmp/nul\0byte", "/" + "a" * 4095, "/" + "b" * 300 + "/model"],
                         ids=["NUL byte", "4096 characters", "a name too long"])
def test_a_path_no_file_can_have_is_a_400(versions: Versions, engine: Server, model: str) -> None:
    code, answer = post(engine.url, json.dumps({"model": model}).encode(), "/v1/weights", engine.token())
    assert code == 400, answer
    message = answer["error"]["message"]
    assert "\n" not in message and len(message) <= 201 and "model" in message, message


def test_a_switch_to_a_version_built_from_a_delta_and_the_name_the_engine_serves(versions: Versions,
                                                                                 engine: Server) -> None:
    """`--daemon D` for a daemon built from a delta (whose source is the delta file, not a checkpoint) switches
    to its weights; the completions, /v1/models, the engine's announcement and `top` then name the checkpoint
    the engine serves, not the one it started with."""
    rig, server = versions.rig, engine
    step = write_training_step(versions.sources[0], rig.base / "step1", 0.02)
    delta = rig.base / "step1.delta"
    assert rig.cli("delta", str(versions.sources[0]), str(step), "-o", str(delta)).returncode == 0
    built = rig.cli("preload", "--from", versions.keys[0], "--delta", str(delta), "--detach", "--json",
                    "--run-dir", str(rig.run_dir), as_json=True)
    rig._remember_supervisors()
    (child_key,) = [r["key_id"] for r in built["ranks"]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WCACHE_CACHE_DIR", str(rig.cache_dir))
        disk = Engine.from_disk(step, engine_config=EngineConfig(enable_prefix_caching=False))
    assert disk.tokenizer is not None and disk.served.key_id == child_key
    expected = disk.generate(disk.tokenizer.encode(PROMPTS[3]), MAX_TOKENS).token_ids

    switched = rig.cli("switch", server.url, "--daemon", child_key, "--json", as_json=True)
    assert switched["current"]["key_id"] == child_key and switched["current"]["model"] == str(delta)
    answer = complete(server, PROMPTS[3])
    assert answer["wcache"]["weights_key"] == child_key and answer["choices"][0]["token_ids"] == expected
    assert answer["model"] == versions.path.name  # the delta's lineage: the parent daemon's checkpoint

    # The checkpoint the delta makes, by its path: the same daemon's weights, now under that checkpoint's name.
    by_path = rig.cli("switch", server.url, str(step), "--json", as_json=True)
    assert by_path["current"]["key_id"] == child_key and by_path["attach"]["daemon"] == f"cpu-{child_key}"
    assert complete(server, PROMPTS[3])["model"] == "step1"
    assert http_status(f"{server.url}/v1/models")[1]["data"][0]["id"] == "step1"  # type: ignore[index]
    announced = json.loads((rig.run_dir / "engines" / f"{server.process.pid}.json").read_text())
    assert (announced["model"], announced["key_id"]) == ("step1", child_key)
    top = rig.cli("top", "--once", "--json", "--interval", "0.2", "--run-dir", str(rig.run_dir), as_json=True)
    (row,) = [e for e in top["engines"] if e["url"] == server.url]
    assert (row["model"], row["key_id"]) == ("step1", child_key)
