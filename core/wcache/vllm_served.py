"""A served vLLM (its OpenAI server) as `wcache switch URL` and `wcache verify URL` reach it, over HTTP only.

vLLM 0.32's server has no endpoint that loads other weights; its development endpoints
(VLLM_SERVER_DEV_MODE=1) reach every worker, and with them a switch is the offline one
(`wcache.integrations.vllm.switch`) driven from outside:

1. `POST /pause?mode=wait`: requests running finish on the old weights; new ones wait (no request sees two);
2. `POST /collective_rpc` `update_config`: the workers' load format becomes `wcache`, pinned to the daemon named;
3. `POST /collective_rpc` `reload_weights`: each rank attaches the new checkpoint's daemon and vLLM reloads
   in place; on a miss every rank refuses before any layer is touched, and the engine keeps its weights;
4. `POST /reset_prefix_cache`: no KV computed under the old weights is reused;
5. `POST /update_weight_version`: vLLM keeps, and `GET /weight_info` reports, what wcache switched it to (the
   front end's own configuration still names the checkpoint it started with);
6. `POST /resume`, whatever happened before.

The switch is then confirmed from the run dir's events: the attach hits of the server's own processes after
step 3. Nothing here imports vLLM: the client needs none.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from wcache.checkpoint.companions import is_companion
from wcache.checkpoint.files import locate
from wcache.checkpoint.model_path import resolve_model_path
from wcache.daemon_choice import lineage_checkpoint
from wcache.errors import BadInputError, UnavailableError
from wcache.integrations.registry import GreedyAttach, not_served
from wcache.integrations.vllm.switch import LOAD_FORMAT, VllmSwitchError, in_place_refusal, worker_reason
from wcache.ipc.run_dir.directory import census, default_run_dir, matches
from wcache.ipc.run_dir.engines import announced_at
from wcache.key.companion_digest import companion_files, tokenizer_digest
from wcache.monitor import event_types as ev
from wcache.monitor.events import engine_events, read_typed_events
from wcache.plan.spec import PlanSpec, preload_command
from wcache.serving.api import CompletionAnswer
from wcache.serving.client import (
    EngineRequestError,
    call_engine,
    engine_base_url,
    engine_tokens,
    read_answer,
)

if TYPE_CHECKING:
    from wcache.verify import GreedyReport

DEV_MODE = "VLLM_SERVER_DEV_MODE"
CLAIM = "wcache"  # the key of wcache's claim in the weight version it sets
FROM_DELTA = "from_delta"  # in a claim: the weights are a version built from a delta, not `model`'s files
# config.json fields that say nothing about the tensors' shapes: a switch may change them.
NOT_ARCHITECTURE = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})


@dataclass(frozen=True, slots=True)
class ServedVllm:
    """What a served vLLM says about itself: its configuration at start and the weights wcache last gave it."""

    url: str
    version: str
    model_name: str  # the name its completions API takes
    started_model: str  # the checkpoint it started with, as its front end still names it
    tokenizer: str  # where its tokenizer came from at start: a reload in place never changes it
    load_format: str | None  # None: its front end does not say (no development endpoints)
    extra_config: dict[str, Any]  # the wcache options it started with
    tp_size: int
    device: str  # vLLM's device type: "cpu", "cuda"
    dtype: str
    max_model_len: int
    claim: dict[str, Any] | None  # what the last `wcache switch` set: model, key_id, daemon

    @property
    def model(self) -> Path:
        """The checkpoint it serves now."""
        return Path(self.claim["model"] if self.claim else self.started_model)

    @property
    def run_dir(self) -> Path:
        configured = self.extra_config.get("run_dir") if self.load_format == LOAD_FORMAT else None
        return Path(configured) if configured else default_run_dir()


def served_version(url: str) -> str | None:
    """The vLLM version the server at `url` reports (GET /version); None when it is no vLLM server."""
    try:
        version = call_engine(url, "GET", "/version", timeout=30).get("version")
    except EngineRequestError:
        version = None
    return version if isinstance(version, str) else None


def vllm_version(url: str) -> str:
    """`served_version`, for a caller that knows the engine at `url` is no other engine of the registry."""
    version = served_version(url)
    if version is None:
        raise not_served(engine_base_url(url))
    return version


def verify_if_vllm(url: str, prompts: list[str], max_new_tokens: int) -> GreedyReport | None:
    """The registry's served verifier of vLLM: `verify_served_vllm`, or None when `url` is no vLLM server."""
    version = served_version(url)
    return None if version is None else verify_served_vllm(url, version, prompts, max_new_tokens)


def switch_if_vllm(url: str, model: Path | None, daemon: str | None) -> dict[str, Any] | None:
    """The registry's served switch of vLLM: `switch_served`, or None when `url` is no vLLM server."""
    version = served_version(url)
    return None if version is None else switch_served(url, version, model, daemon)


def describe(url: str, version: str, *, dev_mode: bool = True) -> ServedVllm:
    """The served vLLM at `url`. Without its dev endpoints: UnavailableError saying how to start it, or with
    `dev_mode` false what /v1/models tells (the checkpoint it started with, at TP 1 and vLLM's default dtype)."""
    try:
        info: dict[str, Any] | None = call_engine(url, "GET", "/server_info?config_format=json", timeout=60)
    except EngineRequestError as exc:
        if exc.status != 404:
            raise
        if dev_mode:
            raise UnavailableError(f"the vLLM server at {engine_base_url(url)} has no development endpoints, so it "
                                   f"cannot reload weights in place; start it with {DEV_MODE}=1 in its "
                                   "environment (it keeps its weights).") from None
        info = None
    models = call_engine(url, "GET", "/v1/models", timeout=30).get("data") or [{}]
    try:
        if info is None:
            listed = models[0]
            return ServedVllm(engine_base_url(url), version, str(listed["id"]), str(listed["root"]),
                              str(listed["root"]), None, {}, 1, "cpu", "auto", int(listed["max_model_len"]), None)
        weight_version = call_engine(url, "GET", "/weight_info", timeout=30).get("weight_version")
        config = info["vllm_config"]
        model, load, parallel = config["model_config"], config["load_config"], config["parallel_config"]
        return ServedVllm(
            url=engine_base_url(url), version=version, model_name=str(models[0].get("id") or model["model"]),
            started_model=str(model["model"]), tokenizer=str(model.get("tokenizer") or model["model"]),
            load_format=str(load["load_format"]),
            extra_config=dict(load.get("model_loader_extra_config") or {}),
            tp_size=int(parallel["tensor_parallel_size"]), device=str(config["device_config"]["device"]),
            dtype=str(model["dtype"]).removeprefix("torch."), max_model_len=int(model["max_model_len"]),
            claim=_claim(weight_version))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise UnavailableError(f"the vLLM server at {engine_base_url(url)} describes its configuration in a form "
                               f"wcache does not read ({exc!r}).") from None


def _claim(weight_version: Any) -> dict[str, Any] | None:
    with contextlib.suppress(TypeError, ValueError):
        document = json.loads(weight_version)
        if isinstance(document, dict) and isinstance(document.get(CLAIM), dict):
            return dict(document[CLAIM])
    return None


@dataclass(frozen=True, slots=True)
class SwitchTarget:
    """What a served vLLM reloads: the checkpoint its reload reads config, tokenizer and headers from, the key
    id it pins (a named daemon's), and whether the daemon is trusted for the checkpoint's digest (a version
    built from a delta has no checkpoint on disk to compute its key from)."""

    checkpoint: Path
    pin: str | None
    trusted: bool = False


def _target(engine: ServedVllm, model: Path | None, daemon: str | None) -> SwitchTarget:
    """The switch's target, after every check that needs no engine: the named daemon exists and fits the engine's
    device and TP size, some daemon could, and the checkpoint's shapes and tokenizer are the engine's. The pin is a
    key, not a name: each TP rank attaches its own daemon. A daemon named alone that was built from a delta is
    reloaded through its lineage's checkpoint (else the engine's own), as a reference engine's switch does."""
    live = census(engine.run_dir).live if engine.run_dir.exists() else ()
    fitting = [d for d in live if d.device.split(":")[0] == engine.device]
    trusted = False
    if daemon is not None:
        named = [d for d in fitting if matches(d, daemon)]
        if len({d.key_id for d in named}) != 1:
            raise UnavailableError(f"{len(named)} running daemons on {engine.device} match {daemon!r} in "
                                   f"{engine.run_dir}; name one daemon (or one key).")
        fitting = named
        if model is None and named[0].parent is not None:
            model, trusted = lineage_checkpoint(live, named[0]) or engine.model, True
        elif model is None:
            model = Path(named[0].source)
    assert model is not None  # the command asks for MODEL or --daemon
    path = resolve_model_path(model).absolute()
    # The command to run: the plan's other fields are vLLM's, which `wcache preload` defaults to as well.
    preload = preload_command(path, PlanSpec(tp_size=engine.tp_size))
    if daemon is not None and fitting[0].tp_size != engine.tp_size:
        raise UnavailableError(f"daemon {fitting[0].name} holds TP {fitting[0].tp_size} shards, but the engine runs "
                               f"TP {engine.tp_size}; run `{preload}` first. The engine keeps "
                               "its weights.")
    if not [d for d in fitting if d.tp_size == engine.tp_size]:
        raise UnavailableError(f"no daemon in {engine.run_dir} holds TP {engine.tp_size} shards on {engine.device} "
                               f"for the engine; run `{preload}` first. The engine keeps "
                               "its weights.")
    _same_architecture(engine.model, path)
    _same_tokenizer(Path(engine.tokenizer), path)
    return SwitchTarget(path, fitting[0].key_id if daemon is not None else None, trusted)


def _same_architecture(current: Path, new: Path) -> None:
    old_config, new_config = (locate(resolve_model_path(p)).config or {} for p in (current, new))
    changed = sorted(k for k in (old_config.keys() | new_config.keys()) - NOT_ARCHITECTURE
                     if old_config.get(k) != new_config.get(k))
    if changed:
        raise BadInputError(f"{new} has another architecture than {current} ({', '.join(changed)} differ); an "
                            "in-place reload keeps vLLM's model and KV cache, so start a new engine for it.")


def _same_tokenizer(served: Path, new: Path) -> None:
    """BadInputError unless `new` has the tokenizer files (and generation config) of `served`, by the key's
    tokenizer digest: vLLM keeps the tokenizer it started with, so new weights beside another tokenizer would be
    served through the old one."""
    old_files, new_files = (companion_files(locate(resolve_model_path(p)), None) for p in (served, new))
    if tokenizer_digest(old_files) == tokenizer_digest(new_files):
        return
    old_sums, new_sums = ({f.name: f.sha256 for f in files if is_companion(f.name)} for files in (old_files, new_files))
    differ = sorted(n for n in old_sums.keys() | new_sums.keys() if old_sums.get(n) != new_sums.get(n))
    raise BadInputError(f"{new} has other tokenizer files than the served {served} ({', '.join(differ[:5])} differ); "
                        "an in-place reload keeps vLLM's tokenizer, so start a new engine for it.")


def switch_served(url: str, version: str, model: Path | None, daemon: str | None) -> dict[str, Any]:
    """Move the served vLLM at `url` to the weights a daemon holds for `model` (or the daemon `daemon`'s).

    Returns what it replaced and with what, as `POST /v1/weights` of a reference engine does. Raises (the
    engine keeping its weights) UnavailableError when it runs without dev endpoints or no daemon fits, and
    VllmSwitchError when its ranks refused the attach.
    """
    engine = describe(url, version)
    target = _target(engine, model, daemon)
    path = target.checkpoint
    refusal = in_place_refusal(engine.tp_size)
    if refusal is not None:
        raise VllmSwitchError(f"vLLM keeps serving {engine.model}, no switch to {path}: {refusal}.")
    # No pin unpins what an earlier switch pinned, and trust lasts one switch; the rest (run dir, mode, …) stays as
    # the server started. Trust the server started with for one named daemon (a following server restarted on the
    # version it was moved to) vouched for that daemon alone.
    started = engine.extra_config if engine.load_format == LOAD_FORMAT else {}
    trusted_at_start = bool(started.get("trust_daemon")) and not started.get("daemon")
    extra = {**started, "daemon": target.pin, "trust_daemon": target.trusted or trusted_at_start}
    pids = engine_pids(engine)
    last = _last_hit(engine.run_dir, pids)
    previous = {"model": str(engine.model), "key_id": (engine.claim or {}).get("key_id")
                or (last.key_id if last is not None else None)}
    began_at, began = time.time(), time.perf_counter()
    try:
        # Inside the try: a pause answered with an error may still have paused the server.
        call_engine(url, "POST", "/pause?mode=wait&clear_cache=false")
        override = {"load_config": {"load_format": LOAD_FORMAT, "model_loader_extra_config": extra}}
        call_engine(url, "POST", "/collective_rpc", {"method": "update_config", "args": [override]})
        try:
            call_engine(url, "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {
                "weights_path": str(path), "is_checkpoint_format": True}})
        except EngineRequestError as exc:
            hits = _hits(engine.run_dir, began_at, pids)
            raise _refusal(engine, path, worker_reason(exc), hits) from None
        reset = call_engine(url, "POST", "/reset_prefix_cache")
        hits = _hits(engine.run_dir, began_at, pids)
        first = _rank0(engine.run_dir, hits)
        current: dict[str, str | bool | None] = {
            "model": str(path), "key_id": first.key_id if first else None,
            "daemon": first.daemon if first else target.pin}
        if target.trusted:  # `model` gave config, tokenizer and headers only: no file holds these weights
            current[FROM_DELTA] = True
        call_engine(url, "POST", "/update_weight_version", {"new_version": json.dumps({CLAIM: current})})
    finally:
        call_engine(url, "POST", "/resume")
    seconds = time.perf_counter() - began
    if not reset.get("success"):
        raise UnavailableError(f"vLLM serves {path} now but did not reset its prefix cache; reset it with POST "
                               f"{engine.url}/reset_prefix_cache before trusting its answers.")
    return {"engine": f"vllm {version}", "previous": previous, "current": current,
            "attach": {"daemon": current["daemon"], "confirmed": len(hits) >= engine.tp_size,
                       "hits": [{"daemon": e.daemon, "key_id": e.key_id, "pid": e.pid} for e in hits]},
            "switch_ms": round(seconds * 1000, 3)}


def _refusal(engine: ServedVllm, path: Path, reason: str, hits: list[ev.AttachHit]) -> UnavailableError:
    if hits:  # some rank attached and began to reload: its layers may hold either version now
        return UnavailableError(f"vLLM's reload of {path} failed after {len(hits)} rank(s) attached, so its weights "
                                f"may be mixed: {reason}; restart the engine.")
    return VllmSwitchError(f"vLLM keeps serving {engine.model}, no switch to {path}: {reason}.")


def server_pids(url: str) -> set[int] | None:
    """The processes of the server listening at `url` on this host (its engine core and workers included), or
    None when it cannot be told (another host, or another user's process)."""
    import psutil

    parts = urllib.parse.urlsplit(engine_base_url(url))
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port or 80)}
        local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs} | {"0.0.0.0", "::"}
        if not addresses & local:
            return None
        listening = [c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid
                     and c.laddr and c.laddr.port == parts.port]
        if len(set(listening)) != 1:
            return None
        server = psutil.Process(listening[0])
        return {server.pid, *(child.pid for child in server.children(recursive=True))}
    except (OSError, psutil.Error):
        return None


def engine_pids(engine: ServedVllm) -> set[int] | None:
    """The processes of the served engine: those below its listening process (`server_pids`) and the ranks
    announced at its URL in its run dir (a warm start forks its engine core and workers from a forkserver, not
    from the server); None when neither can be told."""
    below = server_pids(engine.url)
    announced = {d.pid for d in announced_at(engine.run_dir, engine.url)} if engine.run_dir.exists() else set()
    if below is None:
        return announced or None
    return below | announced


def _hits(run_dir: Path, since: float, pids: set[int] | None) -> list[ev.AttachHit]:
    """The vLLM loader's attach hits since `since`, of the server's processes when they are known."""
    if not run_dir.exists():
        return []
    return [e for e in engine_events(run_dir, ev.AttachHit, "vllm", since) if pids is None or e.pid in pids]


def _last_hit(run_dir: Path, pids: set[int] | None) -> ev.AttachHit | None:
    """The server's latest attach: what it serves when no `wcache switch` moved it yet."""
    return _rank0(run_dir, _hits(run_dir, 0.0, pids) if pids is not None else [])


def _rank0(run_dir: Path, hits: list[ev.AttachHit]) -> ev.AttachHit | None:
    """Of `hits`, the latest of tensor-parallel rank 0 (whose key stands for the server's, as it announces it);
    the latest of all where no live daemon says which rank a hit's was."""
    live = {d.name: d.tp_rank for d in census(run_dir).live} if hits and run_dir.exists() else {}
    first = [h for h in hits if live.get(h.daemon or "") == 0] or hits
    return first[-1] if first else None


def verify_served_vllm(url: str, version: str, prompts: list[str], max_new_tokens: int) -> GreedyReport:
    """Greedy tokens of the served vLLM at `url`, through its completions API, against a fresh vLLM disk load
    (`load_format="auto"`) of the checkpoint it serves, with its dtype, TP size and context length; and the
    tokenizer it holds against that load's (each prompt through its POST /tokenize, each answer's text)."""
    from wcache.integrations.vllm.runner import VllmRun, greedy_runs
    from wcache.verify import (
        GreedyReport,
        built_from_delta,
        compare_prompts,
        decoding_difference,
        encoding_difference,
    )

    engine = describe(url, version, dev_mode=False)
    if engine.claim is not None and engine.claim.get(FROM_DELTA):
        raise built_from_delta(engine.url, engine.claim.get("key_id"), engine.claim.get("daemon"))
    attach = _served_attach(engine, engine_pids(engine))
    if attach.daemon is not None and built_from_delta_daemon(engine.run_dir, attach.daemon):
        # Started on such a version (a following server restarted where it had been moved): no claim says so.
        raise built_from_delta(engine.url, attach.key_id, attach.daemon)
    # One request for all prompts: vLLM schedules them together, as the disk engine's one generate() does.
    answer = read_answer(CompletionAnswer, call_engine(url, "POST", "/v1/completions", {
        "model": engine.model_name, "prompt": prompts, "max_tokens": max_new_tokens, "temperature": 0,
        "return_token_ids": True}), url)
    if sorted(choice.index for choice in answer.choices) != list(range(len(prompts))):
        raise UnavailableError(f"the vLLM server at {engine.url} did not answer each of the {len(prompts)} "
                               "prompts once.")
    choices = sorted(answer.choices, key=lambda choice: choice.index)
    served = [list(choice.token_ids) for choice in choices]
    # The prompts as the served engine's own tokenizer encodes them: vLLM may run another tokenizer than the
    # files beside the checkpoint (--tokenizer), which a disk load of that checkpoint would use.
    engine_ids = [engine_tokens(url, prompt, engine.model_name) for prompt in prompts]
    switched = describe(url, version, dev_mode=False).claim != engine.claim
    [disk] = greedy_runs([VllmRun(str(engine.model), prompts, max_new_tokens, dtype=engine.dtype,
                                  tensor_parallel_size=engine.tp_size, max_model_len=engine.max_model_len)])
    problems = [encoding_difference(engine.model, index, ids, disk_ids)
                for index, (ids, disk_ids) in enumerate(zip(engine_ids, disk.prompt_tokens, strict=True))]
    # Where both generated the same ids, their texts are each tokenizer's decoding of the same tokens.
    problems += [decoding_difference(engine.model, index, choice.text, text)
                 for index, (choice, tokens, text) in enumerate(zip(choices, disk.tokens, disk.texts, strict=True))
                 if choice.text is not None and list(choice.token_ids) == tokens]
    problems.append("the engine switched its weights during the verification" if switched else None)
    return GreedyReport(compare_prompts(prompts, served, disk.tokens), attach,
                        next((p for p in problems if p is not None), None))


def built_from_delta_daemon(run_dir: Path, daemon: str) -> bool:
    """Whether daemon `daemon` runs (or, gone, last ran) a version built from a delta: its descriptor names a parent,
    else the last READY it announced did. A key served later from files under the same name announced none."""
    if not run_dir.exists():
        return False
    for live in census(run_dir, clean=False).live:
        if live.name == daemon:
            return live.parent is not None
    last = None
    for event in read_typed_events(run_dir):
        if isinstance(event, ev.Ready) and event.daemon == daemon:
            last = event
    return last is not None and last.parent is not None


def _served_attach(engine: ServedVllm, pids: set[int] | None) -> GreedyAttach:
    """How the served vLLM got the weights it serves: what the last `wcache switch` claimed, else its latest
    attach hit (of its own processes, where they can be told), else from disk when it says it loads no other way."""
    served = GreedyAttach(f"vllm {engine.version} (served)", "unknown", url=engine.url, model=str(engine.model))
    if engine.claim is not None:
        key_id = engine.claim.get("key_id")
        return msgspec.structs.replace(served, outcome="hit" if key_id else "unknown",
                                       daemon=engine.claim.get("daemon"), key_id=key_id)
    if engine.load_format is not None and engine.load_format != LOAD_FORMAT:
        return msgspec.structs.replace(served, outcome="disk")
    last = _last_hit(engine.run_dir, pids)
    if last is None:
        return served
    return msgspec.structs.replace(served, outcome="hit", daemon=last.daemon, mode=last.mode, key_id=last.key_id)
