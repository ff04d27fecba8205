"""`wcache attach --serve` answers a real OpenAI client end to end; `attach --prompt` generates.

A daemon holds `tiny` in a private run dir (tests/daemon_fixtures.py); `wcache attach tiny --serve --port 0`
runs as a subprocess in its own session and is killed however a test ends. The `openai` package talks to
it; /metrics is read with prometheus_client's own parser; token ids are compared with an engine loaded from
disk in this process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_fixtures import (
    DaemonRig,
    http_status,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    preloaded_tiny,
    wait_for,
)
from engine_serving import Server, metrics, post, serving
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.schema import Schema
from wcache.serving.api import CompletionAnswer, ErrorAnswer, ErrorBody, HealthAnswer, ModelsAnswer, WeightsAnswer
from wcache.serving.tokenize_api import DetokenizeAnswer, TokenizeAnswer

# Two prompts sharing a 96-byte prefix (the byte tokenizer makes that 96 tokens: six blocks of 16, well past
# tiny's 32-token window, so the hit is adopted even with bounded replay on).
SHARED = "The weights cache keeps processed tensors in a daemon, so engines restart without loading. " * 2
PROMPT_A = SHARED[:96] + "First tail: what does the engine do next?"
PROMPT_B = SHARED[:96] + "Second tail, a different question entirely."


def engine_events(rig: DaemonRig, pid: int) -> list[dict[str, Any]]:
    return [e for e in rig.events("engine_counters") if e.get("engine_pid") == pid]


@pytest.fixture(scope="module")
def preloaded(tiny_template: Path) -> Iterator[tuple[DaemonRig, Path, DaemonDescriptor]]:
    with preloaded_tiny(tiny_template) as preloaded:
        yield preloaded


@pytest.fixture(scope="module")
def server(preloaded: tuple[DaemonRig, Path, DaemonDescriptor]) -> Iterator[Server]:
    rig, model, _ = preloaded
    with serving(rig, model) as running:
        yield running


@pytest.fixture(scope="module")
def disk_engine(preloaded: tuple[DaemonRig, Path, DaemonDescriptor]) -> Any:
    """`tiny` loaded from disk in this process: the reference every served answer must equal."""
    from wcache.engine import Engine

    rig, model, _ = preloaded
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WCACHE_CACHE_DIR", str(rig.cache_dir))
        return Engine.from_disk(model)


def cold_tokens(engine: Any, prompt: str, max_new_tokens: int) -> list[int]:
    return engine.generate(engine.tokenizer.encode(prompt), max_new_tokens).token_ids


# -- the OpenAI client --------------------------------------------------------------------------------------


def test_openai_client_gets_the_disk_engines_tokens(server: Server, disk_engine: Any) -> None:
    # 45 tokens: a repeat finds two cached blocks (32 tokens, not more than the window), which bounded replay
    # does not adopt, so the repeat is computed cold and must match exactly. (An adopted hit replays only
    # one window and may differ from a cold run by design; see the no-replay test for exact reuse.)
    prompt = "Attached weights and disk weights: one answer"
    assert len(prompt.encode()) == 45
    client = server.client()
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert first.object == "text_completion" and first.model == "tiny"
    (choice,) = first.choices
    token_ids = choice.model_extra["token_ids"]
    assert token_ids == cold_tokens(disk_engine, prompt, 8)
    assert choice.text == disk_engine.tokenizer.decode(token_ids)
    assert choice.finish_reason in ("stop", "length")
    assert choice.finish_reason == "length" or token_ids[-1] in disk_engine.model_config.eos_token_ids
    assert first.usage is not None
    prompt_tokens = len(disk_engine.tokenizer.encode(prompt))
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (prompt_tokens, len(token_ids))
    assert first.usage.total_tokens == prompt_tokens + len(token_ids)

    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].model_extra["token_ids"] == token_ids and again.choices[0].text == choice.text
    assert again.id != first.id
    assert again.model_extra["wcache"]["hit_tokens"] == 32 and again.model_extra["wcache"]["adopted"] is False


def test_shared_prefix_is_a_prefix_cache_hit_in_metrics(server: Server) -> None:
    before = metrics(server.url)
    client = server.client()
    a = client.completions.create(model="tiny", prompt=PROMPT_A, max_tokens=4, temperature=0)
    b = client.completions.create(model="tiny", prompt=PROMPT_B, max_tokens=4, temperature=0)
    assert a.model_extra["wcache"]["hit_tokens"] == 0, "PROMPT_A is new to this server"
    extension = b.model_extra["wcache"]
    assert extension["adopted"] is True and extension["hit_tokens"] == 96, extension
    # Bounded replay: the tail plus one window (tiny's is 32 tokens) is computed, nothing more.
    assert extension["replayed_tokens"] == 32
    assert extension["prefill_tokens"] == len(PROMPT_B.encode()) - 96 + 32
    after = metrics(server.url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:prefix_cache_queries_total") == len(PROMPT_A.encode()) + len(PROMPT_B.encode())
    assert grew("vllm:prefix_cache_hits_total") == extension["hit_tokens"] > 0
    assert grew("wcache:replayed_tokens_total") == extension["replayed_tokens"] > 0
    assert grew("wcache:prefix_cache_adopted_hits_total") == 1
    assert grew("vllm:request_success_total") == 2
    assert after["wcache:swa_cached_bytes"] == 0, "with bounded replay no sliding-window KV is cached"
    assert after["wcache:daemon_lost"] == 0


def test_health_models_and_bad_requests(server: Server) -> None:
    code, health = http_status(f"{server.url}/health")
    assert code == 200 and isinstance(health, dict) and health["status"] == "ok"
    code, models = http_status(f"{server.url}/v1/models")
    assert code == 200 and isinstance(models, dict)
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert [m.id for m in server.client().models.list()] == ["tiny"]

    with pytest.raises(openai.BadRequestError) as error:
        server.client().completions.create(model="tiny", prompt="warm", max_tokens=4, temperature=0.7)
    assert error.value.status_code == 400
    assert "temperature" in str(error.value.body)

    code, body = post(server.url, b'{"prompt": "unterminated')
    assert code == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    code, body = post(server.url, b'["a", "list"]')
    assert code == 400 and "object" in body["error"]["message"]
    code, body = post(server.url, json.dumps({"prompt": "x", "max_tokens": 0}).encode())
    assert code == 400 and "max_tokens" in body["error"]["message"]
    code, _ = http_status(f"{server.url}/no/such/route")
    assert code == 404
    # Still serving after the bad requests.
    assert http_status(f"{server.url}/health")[0] == 200


# -- attach --prompt and serving without bounded replay ---------------------------------------------------


def _written_by(kind: type[Schema], reply: Any) -> Schema:
    """`reply` read through `kind`, asserting the schema writes it back as the server wrote it: every field,
    in the same order, with the same values."""
    typed = kind.from_wire(reply)
    assert json.dumps(typed.to_wire()) == json.dumps(reply), (kind.__name__, reply)
    return typed


def test_every_reply_is_written_by_its_schema(server: Server) -> None:
    """The API's replies decode through the schemas its clients read them with, and re-encode to the same
    JSON: the schemas are the whole of what the server writes, not a part of it."""
    for route, kind in (("/health", HealthAnswer), ("/v1/models", ModelsAnswer), ("/v1/weights", WeightsAnswer)):
        code, reply = http_status(f"{server.url}{route}")
        assert code == 200, (route, reply)
        _written_by(kind, reply)
    code, claim = http_status(f"{server.url}/v1/weights")
    assert isinstance(_written_by(WeightsAnswer, claim), WeightsAnswer)
    weights = WeightsAnswer.from_wire(claim)
    assert weights.key is not None and weights.attach is not None and weights.attach.outcome == "hit"
    code, reply = post(server.url, json.dumps({"prompt": "warm", "max_tokens": 3}).encode())
    assert code == 200
    completion = _written_by(CompletionAnswer, reply)
    assert isinstance(completion, CompletionAnswer) and len(completion.choices[0].token_ids) == 3
    assert completion.wcache.weights_key == weights.key_id
    code, reply = post(server.url, json.dumps({"prompt": "warm"}).encode(), "/tokenize")
    assert code == 200
    _written_by(TokenizeAnswer, reply)
    code, reply = post(server.url, json.dumps({"tokens": [104, 105]}).encode(), "/detokenize")
    assert code == 200
    _written_by(DetokenizeAnswer, reply)
    for route, body in (("/v1/completions", {"prompt": [True]}), ("/v1/completions", {"max_tokens": "many"}),
                        ("/tokenize", {"prompt": 3})):
        code, reply = post(server.url, json.dumps(body).encode(), route)
        error = _written_by(ErrorAnswer, reply)
        assert code == 400 and isinstance(error, ErrorAnswer) and isinstance(error.error, ErrorBody), reply
        assert error.error.code == 400 and error.error.type == "invalid_request_error"
        assert error.error.message and "\n" not in error.error.message, reply


def test_attach_prompt_json_prints_text_and_tokens(
    preloaded: tuple[DaemonRig, Path, DaemonDescriptor], disk_engine: Any
) -> None:
    rig, model, daemon = preloaded
    prompt = "Attach, then generate eight tokens."
    result = rig.cli(
        "attach",
        str(model),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "8",
        "--json",
        "--run-dir",
        str(rig.run_dir),
        as_json=True,
    )
    assert result["attach"]["outcome"] == "hit" and result["attach"]["daemon"] == daemon.name
    assert result["token_ids"] == cold_tokens(disk_engine, prompt, 8)
    assert result["text"] == disk_engine.tokenizer.decode(result["token_ids"])
    assert result["prompt_tokens"] == len(disk_engine.tokenizer.encode(prompt))


def test_no_swa_bounded_replay_caches_sliding_window_kv(
    preloaded: tuple[DaemonRig, Path, DaemonDescriptor], disk_engine: Any
) -> None:
    rig, model, _ = preloaded
    with serving(rig, model, "--no-swa-bounded-replay") as server:
        client = server.client()
        for prompt in (PROMPT_A, PROMPT_A, PROMPT_B):
            completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
            # Replay off: a hit reuses stored KV exactly, so the answer equals a cold run's.
            assert completion.choices[0].model_extra["token_ids"] == cold_tokens(disk_engine, prompt, 4)
        assert completion.model_extra["wcache"]["adopted"] is True
        assert completion.model_extra["wcache"]["replayed_tokens"] == 0
        values = metrics(server.url)
        assert values["wcache:swa_cached_bytes"] > 0
        assert values["vllm:prefix_cache_hits_total"] > 0 and values["wcache:replayed_tokens_total"] == 0
        assert server.stop() == 0


# -- shutdown (last: it stops the module's server) ----------------------------------------------------------


def test_sigterm_writes_counters_and_removes_descriptor(
    preloaded: tuple[DaemonRig, Path, DaemonDescriptor], server: Server
) -> None:
    rig = preloaded[0]
    pid = server.process.pid
    descriptor_path = rig.run_dir / "engines" / f"{pid}.json"
    assert descriptor_path.exists(), "a serving engine announces itself in <run dir>/engines/"
    descriptor = json.loads(descriptor_path.read_text())
    assert descriptor["pid"] == pid and descriptor["url"] == server.url and descriptor["model"] == "tiny"
    assert descriptor["attach"]["outcome"] == "hit"
    server.client().completions.create(model="tiny", prompt="one more request", max_tokens=2, temperature=0)
    requests = metrics(server.url)["vllm:request_success_total"]
    before = len(engine_events(rig, pid))

    assert server.stop() == 0, server.stderr.read_text()
    assert not descriptor_path.exists(), "the engine descriptor outlived the server"
    events = wait_for(lambda: engine_events(rig, pid)[before:], timeout=5, what="an engine_counters event")
    final = events[-1]
    assert final["url"] == server.url and final["model"] == "tiny" and final["outcome"] == "hit"
    assert final["counters"]["requests"] == requests >= 1
    assert final["counters"]["prefix_queries"] > 0 and final["counters"]["generation_tokens"] > 0
