"""An OpenAI-compatible completions endpoint for the reference engine, with /health, /metrics, /v1/weights,
/tokenize and /detokenize.

`POST /tokenize` and `POST /detokenize` (vLLM's routes and shapes) expose the tokenizer the engine holds in
memory, for `wcache verify URL` to compare with the checkpoint's files. `GET /v1/weights` says which
checkpoint and content key the engine serves; `POST /v1/weights` with
{"model": PATH} or {"daemon": ID} switches it to another daemon's weights between requests (engine.switch),
or answers 409 with the reason and keeps serving what it had. A switch changes what every client is served, so
it is the engine's user's alone: it must carry the engine's control token (`ipc.run_dir.engine_token`), read
from a file only that user can open; reads and completions stay open to whoever reaches the port.

Metric names follow vLLM where the meaning is the same (`vllm:prefix_cache_queries`, ...) and carry a
`wcache:` prefix for what vLLM does not export (replay), so one dashboard reads this engine and vLLM alike.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wcache.engine.block_manager import KVCacheFullError
from wcache.engine.engine import Engine, Generation
from wcache.errors import UnavailableError, WcacheError
from wcache.ipc.http.server import HTTPRequestError, QuietHandler, make_http_server
from wcache.ipc.run_dir.engines import EngineDescriptor
from wcache.ipc.run_dir.engines import write_engine_descriptor as write_descriptor
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event
from wcache.schema import Schema, SchemaError
from wcache.serving.api import (
    CompletionAnswer,
    CompletionChoice,
    CompletionExtension,
    CompletionRequest,
    CompletionUsage,
    ErrorAnswer,
    ErrorBody,
    HealthAnswer,
    ModelCard,
    ModelsAnswer,
    ServedCacheConfig,
    SwitchRequest,
    WeightsAnswer,
    WeightsSwitched,
)
from wcache.serving.tokenize_api import DetokenizeAnswer, DetokenizeRequest, TokenizeAnswer, TokenizeRequest

if TYPE_CHECKING:
    from wcache.serving.switch import SwitchResult

MAX_BODY_BYTES = 1 << 20
PATH_MAX = 4096  # Linux's, terminating NUL included: no longer path names a file
MAX_TOKENS_LIMIT = 4096

log = logging.getLogger("wcache.engine")


class RequestError(HTTPRequestError):
    """A client request the server answers with 400 and this message."""


@dataclass(frozen=True, slots=True)
class ServedEngine:
    """What the server knows about its engine besides the engine itself."""

    engine: Engine
    generate: Callable[[list[int], int], Generation]  # the TP-aware entry (rank 0 drives the others)
    on_switch: Callable[[ServedEngine], object] | None = None  # after the engine moved to other weights
    follows: bool = False  # it moves to its weights' newest version by itself (serving.follow)

    @property
    def model_name(self) -> str:
        """The model the engine serves now (a switch changes it), as its API and its announcement name it."""
        return self.engine.served.name or "unnamed"


class _EngineCollector(Collector):
    def __init__(self, served: ServedEngine) -> None:
        self.served = served

    def collect(self) -> Iterator[Metric]:
        c = self.served.engine.counters
        labels = ["model_name", "engine"]
        values = [self.served.model_name, "0"]

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", c.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens of adopted prefix-cache hits.", c.prefix_hits)
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", c.prefix_queries)
        yield counter("vllm:generation_tokens", "Tokens generated.", c.generation_tokens)
        yield counter("vllm:request_success", "Finished requests.", c.requests)
        running = 1.0 if self.served.engine.lock.locked() else 0.0
        yield gauge("vllm:num_requests_running", "Requests running now.", running)
        yield counter("wcache:prefix_cache_adopted_hits", "Requests whose prefix hit was adopted.", c.adopted_hits)
        yield counter("wcache:prefix_cache_rejected_hits", "Hits no longer than the window, not adopted.",
                      c.rejected_hits)
        yield counter("wcache:replayed_tokens", "Tokens recomputed to rebuild sliding windows.", c.replayed_tokens)
        yield counter("wcache:prefill_tokens_computed", "Prompt tokens computed in prefill.", c.prefill_tokens)
        yield counter("wcache:prefill_tokens_saved", "Prompt tokens not computed thanks to the cache.",
                      c.prefill_tokens_saved)
        yield gauge("wcache:swa_cached_bytes", "Sliding-window KV held for cached prefixes.", c.swa_cached_bytes)
        engine = self.served.engine
        by_labels = [*labels, "weights"]
        queries = CounterMetricFamily("wcache:prefix_cache_queries_by_weights",
                                      "Prompt tokens looked up, by the content key of the weights serving them.",
                                      labels=by_labels)
        hits = CounterMetricFamily("wcache:prefix_cache_hits_by_weights",
                                   "Prompt tokens of adopted prefix-cache hits, by the weights' content key.",
                                   labels=by_labels)
        for key_id, counted in list(engine.weights_counters.items()):
            queries.add_metric([*values, key_id], counted.prefix_queries)
            hits.add_metric([*values, key_id], counted.prefix_hits)
        yield queries
        yield hits
        yield counter("wcache:prefix_cache_cross_version_refusals",
                      "Cached blocks a lookup found under other weights and refused (0 unless hashes collide).",
                      engine.blocks.cross_version_refusals)
        report = engine.attach_report
        info = GaugeMetricFamily("wcache:engine_weights_info", "Where this engine's weights came from.",
                                 labels=[*labels, "outcome", "mode", "daemon", "key_id"])
        info.add_metric([*values, report.outcome if report else "disk", report.mode if report else "",
                         (report.daemon or "") if report else "", engine.served.key_id or ""], 1.0)
        yield info
        yield gauge("wcache:daemon_lost", "1 after the daemon backing zero-copy weights went away.",
                    1.0 if report is not None and report.daemon_lost else 0.0)
        yield gauge("wcache:weights_corrupt_tensors",
                    "Tensors of the weights served now that their daemon found changed in memory (0: none).",
                    len(report.corrupt.tensors) if report is not None else 0.0)


def corrupt_weights(engine: Engine) -> str | None:
    """Why the engine must not answer from the weights it holds now, or None (`/health`, completions)."""
    report = engine.attach_report
    return report.corrupt_sentence() if report is not None else None


def _refused_while_corrupt(engine: Engine) -> None:
    """Completions stop while the weights are known corrupt: an error, never tokens from changed bytes."""
    if (why := corrupt_weights(engine)) is not None:
        raise HTTPRequestError(f"{why}; this engine answers no completion until it switches (POST /v1/weights) or "
                               "restarts on good weights", 503)


# The sentence a request gets for a value of the wrong type, by the field it sent it in.
_COMPLETION_FIELDS = {
    "prompt": "prompt must be a non-empty string or a list of token ids",
    "max_tokens": f"max_tokens must be an integer between 1 and {MAX_TOKENS_LIMIT}",
    "temperature": "only greedy decoding is supported: temperature must be 0",
}


def _completion(served: ServedEngine, body: dict[str, Any]) -> CompletionAnswer:
    _refused_while_corrupt(served.engine)
    request = _read_body(CompletionRequest, body, _COMPLETION_FIELDS)
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    tokenizer = served.engine.tokenizer
    if isinstance(prompt, str):
        token_ids = _encode(served.engine, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        token_ids = [t for t in prompt if isinstance(t, int)]
    else:
        raise RequestError(_COMPLETION_FIELDS["prompt"])
    if not token_ids:
        raise RequestError("prompt is empty")
    if any(not 0 <= t < served.engine.model_config.vocab_size for t in token_ids):
        raise RequestError("prompt holds token ids outside the vocabulary")
    max_tokens = request.max_tokens
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise RequestError(_COMPLETION_FIELDS["max_tokens"])
    if request.temperature != 0:
        raise RequestError(_COMPLETION_FIELDS["temperature"])
    # Refused here, before any TP rank starts: a request the KV cache cannot hold would fail on every rank.
    capacity, needed = _kv_capacity(served.engine), len(token_ids) + max_tokens - 1
    if needed > capacity:
        raise RequestError(f"the prompt ({len(token_ids)} tokens) and max_tokens ({max_tokens}) need {needed} "
                           f"tokens of KV cache but this engine holds {capacity}; shorten the prompt or lower "
                           f"max_tokens")
    generation = served.generate(token_ids, max_tokens)
    text = tokenizer.decode(generation.token_ids) if tokenizer is not None else ""
    eos = set(served.engine.model_config.eos_token_ids)
    finished = "stop" if generation.token_ids and generation.token_ids[-1] in eos else "length"
    return CompletionAnswer(
        id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()), model=served.model_name,
        choices=[CompletionChoice(index=0, text=text, token_ids=generation.token_ids, finish_reason=finished)],
        usage=CompletionUsage(prompt_tokens=generation.prompt_tokens, completion_tokens=len(generation.token_ids),
                              total_tokens=generation.prompt_tokens + len(generation.token_ids)),
        wcache=CompletionExtension(hit_tokens=generation.hit_tokens, adopted=generation.adopted,
                                   replayed_tokens=generation.replayed_tokens,
                                   prefill_tokens=generation.prefill_tokens, weights_key=generation.weights_key))


def _kv_capacity(engine: Engine) -> int:
    """How many tokens one request may hold: prompt and answer share the engine's KV cache."""
    return engine.config.num_blocks * engine.config.block_size


def _encode(engine: Engine, prompt: str) -> list[int]:
    """`prompt` through the tokenizer the engine holds, as completions and /tokenize encode it."""
    if engine.tokenizer is None:
        raise RequestError("this engine has no tokenizer; send token ids")
    try:
        return engine.tokenizer.encode(prompt)
    except UnicodeEncodeError as exc:  # JSON can carry lone surrogates ("\ud800"), which no text encoding holds
        raise RequestError(f"the prompt is not valid Unicode text ({exc.reason})") from None


Body = TypeVar("Body", bound=Schema)


def _read_body(kind: type[Body], body: dict[str, Any], sentences: dict[str, str] | None = None) -> Body:
    """`body` read as `kind`; a 400 with the sentence `sentences` holds for the field at fault, else the
    schema's own sentence naming it."""
    try:
        return kind.from_wire(body)
    except SchemaError as exc:
        sentence = (sentences or {}).get(exc.field or "")
        raise RequestError(sentence or str(exc)) from None


def _tokenize(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """POST /tokenize (vLLM's route): the prompt's token ids from the tokenizer this engine holds in memory."""
    request = _read_body(TokenizeRequest, body)
    if not request.add_special_tokens:
        raise RequestError("this engine encodes a prompt as its completions do; add_special_tokens must be true")
    tokens = _encode(engine, request.prompt)
    return TokenizeAnswer(tokens, len(tokens), _kv_capacity(engine)).to_wire()


def _detokenize(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """POST /detokenize (vLLM's route): the text of token ids, as this engine's completions decode them."""
    request = _read_body(DetokenizeRequest, body)
    if engine.tokenizer is None:
        raise RequestError("this engine has no tokenizer to decode with")
    if any(t >= engine.model_config.vocab_size for t in request.tokens):
        raise RequestError("tokens holds ids outside the vocabulary")
    return DetokenizeAnswer(engine.tokenizer.decode(request.tokens)).to_wire()


def weights_document(served: ServedEngine) -> WeightsAnswer:
    """GET /v1/weights: the checkpoint and key the engine serves, under which plan, how it got them, and whether
    it follows its weights' newest version."""
    from wcache.serving.switch import served_claim

    engine = served.engine
    report = engine.attach_report
    plan = engine.attach_plan
    claim = served_claim(engine.served)
    return WeightsAnswer(model=claim.model, key=claim.key, key_id=claim.key_id, follows=served.follows,
                         from_delta=engine.served.lineage is not None, corrupt=corrupt_weights(engine),
                         plan=plan.to_json() if plan is not None else None,
                         tp_size=engine.tp.size, device=engine.device,
                         engine_config=ServedCacheConfig(**asdict(engine.config)),
                         attach=report.summary() if report else None)


# The sentence a switch request gets for a value of the wrong type, by its field.
_SWITCH_FIELDS = {"model": "model must be a non-empty string", "daemon": "daemon must be a non-empty string"}


def _switch(served: ServedEngine, body: dict[str, Any]) -> WeightsSwitched:
    """POST /v1/weights: move the engine to {"model": PATH} and/or {"daemon": ID}; 409 when nothing serves it."""
    from wcache.checkpoint.model_path import looks_like_repo_id, resolve_model_path
    from wcache.serving.switch import SwitchMissError

    unknown = sorted(set(body) - set(SwitchRequest.__struct_fields__))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; send model (a checkpoint path) and/or daemon (an id)")
    request = _read_body(SwitchRequest, body, _SWITCH_FIELDS)
    model, daemon = request.model, request.daemon
    if model is None and daemon is None:
        raise RequestError("name the weights to switch to: model (a checkpoint path) and/or daemon (an id)")
    for name, value in (("model", model), ("daemon", daemon)):
        if value is None:
            continue
        if not value:
            raise RequestError(_SWITCH_FIELDS[name])
        if "\0" in value or len(value.encode(errors="replace")) >= PATH_MAX:
            raise RequestError(f"{name} holds a NUL byte or is longer than a path may be ({PATH_MAX - 1} bytes)")
    try:
        if model is not None and not (Path(model).is_absolute() or looks_like_repo_id(model)):
            raise RequestError("model must be an absolute path or a repo id: the server's working directory is "
                               "not the client's")
        try:
            checkpoint = resolve_model_path(model) if model is not None else None
        except OSError as exc:  # a name too long for the filesystem, a directory on the way closed to the engine
            raise RequestError(f"model cannot be looked up ({exc.strerror or exc})") from None
        result = switch_served(served, checkpoint, daemon)
    except SwitchMissError as exc:
        raise HTTPRequestError(str(exc), 409) from None
    except UnavailableError as exc:
        raise HTTPRequestError(str(exc), 503) from None
    except WcacheError as exc:
        raise RequestError(str(exc)) from None
    return result.answer()


def switch_served(served: ServedEngine, checkpoint: Path | None, daemon: str | None) -> SwitchResult:
    """Switch the served engine (`switch_weights`), then announce what it serves now: what a POST /v1/weights
    and a following engine both run."""
    from wcache.serving.switch import switch_weights

    result = switch_weights(served.engine, checkpoint, daemon)
    if served.on_switch is not None:
        served.on_switch(served)
    return result


def make_server(served: ServedEngine, host: str, port: int, flags: tuple[str, str] | None = None, *,
                control_token: str | None = None) -> ThreadingHTTPServer:
    """The engine's HTTP server, not yet serving; `flags` name the options that chose host and port. A request
    that changes what it serves must carry `control_token`; without one, nobody may switch it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(served))

    class Handler(QuietHandler):
        def error_document(self, code: int, sentence: str) -> Any:
            # OpenAI's error shape: what the clients of this API parse.
            kind = "not_found" if code == 404 else "invalid_request_error" if code < 500 else "server_error"
            return ErrorAnswer(error=ErrorBody(message=sentence, type=kind, code=code)).to_wire()

        def do_GET(self) -> None:
            path = self.route()
            if path == "/health":
                report = served.engine.attach_report
                lost = report is not None and report.daemon_lost
                corrupt = corrupt_weights(served.engine)
                # CPU weights outlive their daemon (memfd); CUDA weights die with it.
                ok = not (lost and report.device != "cpu") and corrupt is None
                status = "ok" if ok else "weights corrupt" if corrupt is not None else "weights lost"
                self.send_json(200 if ok else 503, HealthAnswer(status=status, daemon_lost=lost,
                                                                corrupt=corrupt).to_wire())
            elif path == "/metrics":
                self.send_metrics(registry)
            elif path == "/v1/weights":
                self.send_json(200, weights_document(served).to_wire())
            elif path == "/v1/models":
                self.send_json(200, ModelsAnswer(data=[ModelCard(id=served.model_name)]).to_wire())
            else:
                raise HTTPRequestError(f"no route {path}", 404)

        def do_POST(self) -> None:
            path = self.route()
            if path == "/v1/weights":
                self.require_token(control_token, "switching this engine's weights")  # before its body is read
                self.send_json(200, _switch(served, self.read_json_object(MAX_BODY_BYTES)).to_wire())
                return
            if path in ("/tokenize", "/detokenize"):
                route = _tokenize if path == "/tokenize" else _detokenize
                self.send_json(200, route(served.engine, self.read_json_object(MAX_BODY_BYTES)))
                return
            if path != "/v1/completions":
                raise HTTPRequestError(f"no route {path}", 404)
            body = self.read_json_object(MAX_BODY_BYTES)
            try:
                completion = _completion(served, body)
            except (ValueError, KVCacheFullError) as exc:  # a prompt the tokenizer or the cache cannot take
                raise RequestError(str(exc)) from None
            self.send_json(200, completion.to_wire())

    return make_http_server(host, port, Handler, flags)


class CounterEvents:
    """Every `interval` seconds: the engine's counters to the run dir's event log when they changed (and once
    at the end), and a vLLM-style stats line to the "wcache.engine" logger while there was activity.

    An idle engine writes nothing: readers find engines by their descriptors, never by these lines.
    """

    def __init__(self, served: ServedEngine, run_dir: Path, url: str, interval: float = 5.0) -> None:
        self.served, self.run_dir, self.url, self.interval = served, run_dir, url, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wcache-engine-counters", daemon=True)
        self._last = served.engine.counters.snapshot()
        self._last_at = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def _emit(self, counters: dict[str, int]) -> None:
        report = self.served.engine.attach_report
        append_event(self.run_dir, ev.EngineCounters(engine_pid=os.getpid(), url=self.url,
                                                     model=self.served.model_name,
                                                     outcome=report.outcome if report else "disk", counters=counters))

    def _tick(self) -> None:
        engine = self.served.engine
        now, counters, running = time.monotonic(), engine.counters.snapshot(), engine.lock.locked()
        changed = counters != self._last
        if changed:
            self._emit(counters)
        if changed or running:
            log.info(stats_line(self._last, counters, now - self._last_at, running, engine.blocks.num_free,
                                engine.config.num_blocks))
        self._last, self._last_at = counters, now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 1)
        self._emit(self.served.engine.counters.snapshot())  # the final count, changed or not


def stats_line(before: dict[str, int], after: dict[str, int], seconds: float, running: bool, free_blocks: int,
               num_blocks: int) -> str:
    """One line like vLLM's periodic stats log, over the interval between two counter snapshots."""

    def grew(name: str) -> int:
        return after[name] - before[name]

    per_s = 1.0 / seconds if seconds > 0 else 0.0
    queries = grew("prefix_queries")
    hit_rate = 100.0 * grew("prefix_hits") / queries if queries else 0.0
    usage = 100.0 * (num_blocks - free_blocks) / num_blocks if num_blocks else 0.0
    return (f"Avg prompt throughput: {queries * per_s:.1f} tokens/s, "
            f"Avg generation throughput: {grew('generation_tokens') * per_s:.1f} tokens/s, "
            f"Running: {int(running)} reqs, Started: {grew('requests')} reqs, "
            f"Prefix cache hit rate: {hit_rate:.1f}%, KV cache usage: {usage:.1f}%")


def announce_engine(run_dir: Path, url: str, served: ServedEngine) -> Path:
    """Announce the engine in the run dir (again after a switch), and again when the daemon behind the weights it
    serves reports them changed in memory, so what reads the run dir sees `attach.corrupt`."""
    path = write_engine_descriptor(run_dir, url, served)
    report = served.engine.attach_report
    if report is not None:
        def again() -> None:
            if not path.exists():
                return  # the engine stopped (or moved on): nothing to announce
            try:
                write_engine_descriptor(run_dir, url, served)
            except OSError as exc:
                log.warning("Could not announce this engine's corrupt weights in %s (%s).", run_dir, exc)

        report.corrupt.listen(again)
    return path


def write_engine_descriptor(run_dir: Path, url: str, served: ServedEngine) -> Path:
    """Announce the engine in the run dir so `wcache top` can find and scrape it (again after a switch)."""
    report = served.engine.attach_report
    return write_descriptor(run_dir, EngineDescriptor(
        pid=os.getpid(), url=url, model=served.model_name, source=str(served.engine.served.source),
        attach=report.summary() if report is not None else None,
        key_id=served.engine.served.key_id, started=time.time(), follows=served.follows))
