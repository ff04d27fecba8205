"""The vLLM load format `wcache`: vLLM's parameters are a daemon's processed tensors, or vLLM loads from disk.

`--load-format wcache --model-loader-extra-config '{"mode": "copy"}'` (server) or `LLM(..., load_format="wcache",
model_loader_extra_config={...})` (offline); the options are `wcache.attach_options.AttachOptions`. The plan
comes from vLLM's own configuration (TP size and rank from its parallel state, dtype from the model config,
the layout from the model class's fusions; see `formats`, which also says which pre-quantized formats
are served), so the key is the one `wcache preload` computes for the same checkpoint and TP size.

On a hit vLLM builds the model with its parameters on the meta device (its buffers, such as the rotary cache,
on the real one): no parameter memory is allocated for weights the daemon holds. Every parameter whose name,
shape and dtype equal a daemon tensor's is registered as that tensor (zero-copy: a view of the daemon's arena);
only the rest are materialized, and filled by the model's own `load_weights` under Hugging Face names from
views of the arena, never read from disk. At TP > 1 the plan shards exactly as vLLM does (replicated key/value
heads, the vocabulary padded to vLLM's 64 rows before it is split), so every parameter is the daemon's. vLLM's
post-processing (`process_weights_after_loading`) then runs as after a disk load: vLLM's CPU backend repacks
linear weights for oneDNN into memory of its own and drops the parameter; that copy is vLLM's. The arena is
mapped copy-on-write, so such post-processing can never write into the weights other engines read.

On a miss one warning says why (wcache's diff) and names the `wcache preload` command that would serve this
engine, and vLLM's default loader reads the checkpoint; with `"fallback": false` the engine does not start and
the error says why.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch
from torch import nn

from wcache.attach import AttachedWeights, AttachMissError, attach_with
from wcache.attach.report import AttachReport
from wcache.attach_options import AttachOptions
from wcache.checkpoint.model_path import resolve_model_path
from wcache.errors import CheckpointError, UnavailableError, WcacheError, in_words, marked
from wcache.integrations.placement import parameter_slots, parameters_on_meta, replace_parameter, same_kind
from wcache.integrations.vllm import formats
from wcache.integrations.vllm.announce import announce
from wcache.integrations.vllm.api import (
    BaseModelLoader,
    DefaultModelLoader,
    LoadConfig,
    ModelConfig,
    VllmConfig,
    get_current_vllm_config,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    guard_each_step,
    init_logger,
    initialize_model,
    process_weights_after_loading,
    set_default_torch_dtype,
)
from wcache.integrations.vllm.plan import plan_of
from wcache.integrations.vllm.switch import in_place_refusal
from wcache.integrations.vllm.words import EXTRA_CONFIG, vllm_words
from wcache.ipc.attach_summary import AttachSummary
from wcache.ipc.run_dir.directory import default_run_dir, ensure_run_dir
from wcache.key.digest_store import DigestStore
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event
from wcache.monitor.private_memory import private_bytes
from wcache.plan.processing import UnsupportedPlanError
from wcache.plan.spec import PlanSpec

# Under "vllm." so that vLLM's own logging configuration (format, level, VLLM_LOGGING_LEVEL) applies.
logger = init_logger("vllm.wcache")

ENGINE = "vllm"


class CannotAttachError(UnavailableError):
    """vLLM's configuration or model cannot take a daemon's tensors; with fallback on, vLLM loads from disk.
    `report` is the attach's own when it missed a daemon (its key and diff), None when it did not get that far."""

    def __init__(self, message: str, report: AttachReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """How a hit's tensors reached vLLM's parameters."""

    assigned: int  # parameters that now are the daemon's tensors (views of the arena in zero-copy mode)
    copied: tuple[str, ...]  # parameters materialized and filled by the model's load_weights, by vLLM name
    private_bytes: int | None = None  # this process's private memory added from the build until post-processing
    device_peak_bytes: int | None = None  # CUDA: the most device memory the build and attach allocated at once
    post_processing_s: float = 0.0  # vLLM's process_weights_after_loading (the oneDNN repack on CPU)
    note: str = ""  # what the log line adds for this model (its stacked experts, parameters left as vLLM made them)


def plan_for(vllm_config: VllmConfig, model_config: ModelConfig) -> PlanSpec:
    """The plan a daemon must hold for this vLLM rank."""
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise CannotAttachError("wcache does not serve pipeline-parallel vLLM ranks")
    return plan_of(model_config, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())


def device_name(vllm_config: VllmConfig) -> str:
    """The daemon device this rank attaches to: "cpu", or "cuda:N" for the rank's current device."""
    device = torch.device(vllm_config.device_config.device_type)  # `device` is None on some platforms (TPU)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def attach_into(model: nn.Module, weights: AttachedWeights, device: torch.device, *, quantized: bool = False
                ) -> Placement:
    """Register the daemon's tensors as the model's parameters; load the rest through the model's load_weights.

    The one attach path: `load_model` calls it on a model whose parameters are on the meta device,
    `load_weights` on a built one. A parameter takes the daemon's tensor of its name when shape and dtype
    agree, in every module that shares it (tied embeddings); any other parameter still on the meta device is
    materialized on `device`, then every other one is loaded by the model's `load_weights` from checkpoint-named
    views of the daemon's tensors.

    With `quantized`, parameters that neither the daemon nor load_weights fill (the attention's KV-cache
    scales a checkpoint may leave out) keep the values vLLM created them with, as vLLM's disk loader leaves them.
    """
    slots = parameter_slots(model)
    params = dict(model.named_parameters())  # one name per parameter, tied ones under their first
    assigned: set[str] = set()
    for name, param in params.items():
        tensor = weights.tensors.get(formats.daemon_name(name))
        if (tensor is not None and tuple(tensor.shape) == tuple(param.shape) and tensor.dtype == param.dtype
                and tensor.device.type == device.type):
            replace_parameter(slots[id(param)], same_kind(param, tensor))
            assigned.add(name)
    rest = [name for name in params if name not in assigned]
    note = formats.expert_note(model, assigned)
    if not rest:
        return Placement(len(assigned), (), note=note)
    taken = {formats.daemon_name(name) for name in assigned}
    unused = [name for name in weights.tensors if name not in taken]
    if not unused and quantized:
        # Every daemon tensor is placed; what is left the checkpoint does not hold (on any rank).
        return _kept_as_made(params, assigned, rest, note)
    if weights.key_file.plan.tp_size > 1:
        # load_weights shards full checkpoint tensors itself; a daemon holds only this rank's shard.
        raise CannotAttachError(
            f"vLLM parameter {rest[0]} has no daemon tensor of its shape and dtype, and a TP shard cannot be "
            "reloaded under checkpoint names"
        )
    for name in rest:  # what the daemon lacks: the only parameter memory this attach allocates
        param = params[name]
        if param.device.type == "meta":
            empty = torch.empty_strided(tuple(param.shape), param.stride(), dtype=param.dtype, device=device)
            replace_parameter(slots[id(param)], same_kind(param, empty))
    # Every vLLM model class has load_weights, but no vLLM type declares it: nn.Module's __getattr__ answers.
    loaded = model.load_weights(weights.checkpoint_tensors(unused).items())  # type: ignore[operator]
    missing = [name for name in rest if loaded is not None and name not in loaded]
    if missing and not quantized:
        raise CannotAttachError(f"the daemon holds nothing vLLM can load into parameter {missing[0]}")
    if missing:
        return _kept_as_made(params, assigned, [n for n in rest if n not in missing], note, missing)
    return Placement(len(assigned), tuple(rest), note=note)


def _kept_as_made(params: dict[str, nn.Parameter], assigned: set[str], copied: list[str], note: str,
                  kept: list[str] | None = None) -> Placement:
    """A quantized model's placement where the parameters in `kept` (all of `copied` when None) are left as
    vLLM created them: the checkpoint does not hold them. One built on the meta device has no such value."""
    kept = copied if kept is None else kept
    copied = [] if kept is copied else copied
    if lost := [name for name in kept if params[name].device.type == "meta"]:
        raise CannotAttachError(f"vLLM parameter {lost[0]} is in neither the daemon nor the checkpoint, and was "
                                "built without an initial value to keep")
    note += f"; {len(kept)} the checkpoint lacks (such as {kept[0]}) kept vLLM's initial values, as from disk"
    return Placement(len(assigned), tuple(copied), note=note)


class WcacheModelLoader(BaseModelLoader):
    """`load_format="wcache"`: attach to a wcache daemon holding this checkpoint's key, else load from disk."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = AttachOptions.from_mapping(load_config.model_loader_extra_config, EXTRA_CONFIG)

    def _disk_loader(self) -> DefaultModelLoader:
        # vLLM's default loader must see neither our load format nor our options.
        return DefaultModelLoader(dataclasses.replace(self.load_config, load_format="auto",
                                                      model_loader_extra_config={}))

    def _run_dir(self) -> Path:
        return ensure_run_dir(Path(self.options.run_dir) if self.options.run_dir else default_run_dir())

    def download_model(self, model_config: ModelConfig) -> None:
        self._disk_loader().download_model(model_config)

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's in-place reload (`reload_weights`, what `wcache.integrations.vllm.switch.switch` runs)."""
        return daemon_weights(self, model, model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes a CUDA daemon holds for this rank in zero-copy mode, so vLLM does not count them as its own.

        Only vLLM's GPU worker asks; it has not run on this project's CPU-only CI.
        """
        if self.options.mode != "zero_copy" or not device_name(vllm_config).startswith("cuda"):
            return 0
        from wcache.daemon_choice import pick_daemon

        model_config = vllm_config.model_config
        try:
            plan = plan_for(vllm_config, model_config)
            path = resolve_model_path(model_config.model, model_config.revision)
            daemon = pick_daemon(path, plan, self._run_dir(), device_name(vllm_config), self.options.daemon)
        except WcacheError as exc:
            logger.info("wcache: no daemon memory to account for (%s)", in_words(marked(exc), vllm_words))
            return 0
        return daemon.weights_bytes

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Attach a built model to a daemon (the same path as load_model's), else vLLM's disk loader."""
        vllm_config = get_current_vllm_config()
        try:
            weights = self._attach(vllm_config, model_config)
            try:
                attach_into(model, weights, self._target_device(vllm_config),
                            quantized=bool(model_config.quantization))
            except CannotAttachError:
                weights.close()
                raise
        except CannotAttachError as exc:
            if not self.options.fallback:
                raise
            reason = in_words(marked(exc), vllm_words)
            logger.warning("wcache: cannot load from a daemon (%s); loading from disk", reason)
            self._disk_loader().load_weights(model, model_config)
            self._announce_fallback(vllm_config, model_config, reason, exc.report)
            return
        _keep_lease(model, weights)
        self._announce_hit(model_config, weights)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        began = time.perf_counter()
        try:
            weights = self._attach(vllm_config, model_config)
        except CannotAttachError as exc:
            return self._fall_back(vllm_config, model_config, prefix, exc)
        try:
            model, placement = self._build(vllm_config, model_config, prefix, weights)
        except CannotAttachError as exc:
            weights.close()
            return self._fall_back(vllm_config, model_config, prefix, exc)
        report = weights.report
        how = "zero-copy views of its arena" if report.mode == "zero_copy" else "private copies (copy mode)"
        total = placement.assigned + len(placement.copied)
        copied = (f"{len(placement.copied)} ({_names(placement.copied)}) were materialized and copied in through "
                  "the model's load_weights, as their shape or dtype differ from the daemon's"
                  if placement.copied else "none was materialized")
        private = ("" if placement.private_bytes is None else
                   f"; this process's private memory grew by {placement.private_bytes / 2**20:.1f} MiB before "
                   "vLLM's post-processing")
        if placement.device_peak_bytes is not None:
            private += f", and the build allocated at most {placement.device_peak_bytes / 2**20:.1f} MiB on the device"
        logger.info(
            "wcache: weight cache hit from daemon %s (key %s) for TP rank %d of %d: %d of %d parameters are the "
            "daemon's tensors as %s, %s%s; no checkpoint byte was read%s (attach %.1f ms, vLLM's post-processing "
            "%.1f ms; %.1f ms, post-processing included)", report.daemon, report.daemon_key_id,
            weights.key_file.plan.tp_rank, weights.key_file.plan.tp_size, placement.assigned, total, how, copied,
            placement.note, private, report.timings_ms.get("total", 0.0), placement.post_processing_s * 1000,
            (time.perf_counter() - began) * 1000,
        )
        append_event(self._run_dir(), ev.Placement(
            engine=ENGINE, daemon=report.daemon, tp_rank=weights.key_file.plan.tp_rank,
            tp_size=weights.key_file.plan.tp_size, mode=report.mode, parameters=total, assigned=placement.assigned,
            copied=list(placement.copied), private_bytes=placement.private_bytes,
            device_peak_bytes=placement.device_peak_bytes,
            post_processing_ms=round(placement.post_processing_s * 1000, 3)))
        self._announce_hit(model_config, weights)
        return model

    def _announce_hit(self, model_config: ModelConfig, weights: AttachedWeights) -> None:
        plan = weights.key_file.plan
        announce(self._run_dir(), model=_served_name(model_config), source=weights.key_file.source,
                 attach=weights.report.summary(), key_id=weights.key_file.key.short_id, tp_rank=plan.tp_rank,
                 tp_size=plan.tp_size)

    def _announce_fallback(self, vllm_config: VllmConfig, model_config: ModelConfig, reason: str,
                           report: AttachReport | None) -> None:
        """A rank that loaded from disk says so, with the reason, as a hit says which daemon it maps."""
        if report is not None:
            summary = msgspec.structs.replace(report.summary(), outcome="fallback", reason=reason)
        else:
            summary = AttachSummary(
                outcome="fallback", mode=self.options.mode, device=device_name(vllm_config), key_id=None, daemon=None,
                daemon_key_id=None, reason=reason, mismatched=(), diff=None, timings_ms={}, bytes_mapped=0,
                num_tensors=0, daemon_lost=False)
        announce(self._run_dir(), model=_served_name(model_config), source=str(model_config.model), attach=summary,
                 key_id=summary.key_id, tp_rank=get_tensor_model_parallel_rank(),
                 tp_size=get_tensor_model_parallel_world_size())

    def _attach(self, vllm_config: VllmConfig, model_config: ModelConfig, reload: bool = False) -> AttachedWeights:
        """The daemon's tensors for this rank; CannotAttachError (with the reason) when there are none, or, for
        vLLM's in-place reload (`reload`), none it can take."""
        try:
            plan = plan_for(vllm_config, model_config)
            refusal = in_place_refusal(plan.tp_size, plan.quantization) if reload else None
            if refusal is not None:
                raise CannotAttachError(refusal)
            path = resolve_model_path(model_config.model, model_config.revision)
            with DigestStore.open() as store:
                options = msgspec.structs.replace(self.options, fallback=False)
                return attach_with(path, plan, options, device=device_name(vllm_config), store=store, engine=ENGINE)
        except AttachMissError as exc:
            raise CannotAttachError(exc.report.reason or str(exc), exc.report) from None
        except (UnsupportedPlanError, CheckpointError) as exc:
            # E.g. a Hugging Face id not downloaded yet: vLLM's own loader fetches it; wcache never downloads.
            raise CannotAttachError(marked(exc).rstrip(".")) from None

    def _target_device(self, vllm_config: VllmConfig) -> torch.device:
        return torch.device(self.load_config.device or vllm_config.device_config.device_type)

    def _build(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
               weights: AttachedWeights) -> tuple[nn.Module, Placement]:
        target_device = self._target_device(vllm_config)
        before = private_bytes()
        cuda = target_device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(target_device)
            allocated = torch.cuda.memory_allocated(target_device)
        # ModelConfig declares dtype as a name or a torch.dtype; its __post_init__ always leaves a torch.dtype.
        with set_default_torch_dtype(model_config.dtype):  # type: ignore[arg-type]
            with target_device, parameters_on_meta():
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            placement = attach_into(model, weights, target_device, quantized=bool(model_config.quantization))
            after = private_bytes()
            # The daemon's tensors are its own allocation (CUDA IPC), never counted here: what is counted is what
            # this process allocated for parameters, at most one vLLM `torch.empty` at a time plus what it lacked.
            peak = torch.cuda.max_memory_allocated(target_device) - allocated if cuda else None
            began = time.perf_counter()
            process_weights_after_loading(model, model_config, target_device)
        grown = after - before if after is not None and before is not None else None
        placement = dataclasses.replace(placement, private_bytes=grown, device_peak_bytes=peak,
                                        post_processing_s=time.perf_counter() - began)
        _keep_lease(model, weights)
        return model.eval(), placement

    def _fall_back(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, why: CannotAttachError,
                   ) -> nn.Module:
        """vLLM's own loader; the reason (why not the daemon) names options as vLLM users set them."""
        reason = in_words(marked(why), vllm_words)
        if not self.options.fallback:
            raise CannotAttachError(f"wcache: {reason}; not falling back to disk (fallback is false).")
        logger.warning("wcache: weight cache miss for %s: %s; falling back to disk loading (load_format=auto)",
                       model_config.model, reason)
        began = time.perf_counter()
        model = self._disk_loader().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        seconds = time.perf_counter() - began
        logger.info("wcache: vLLM's default loader read %s from disk (%.1f ms, post-processing included)",
                    model_config.model, seconds * 1000)
        append_event(self._run_dir(), ev.Fallback(source=str(model_config.model), device=device_name(vllm_config),
                                                  reason=reason, seconds=round(seconds, 3), engine=ENGINE))
        self._announce_fallback(vllm_config, model_config, reason, why.report)
        return model


def _keep_lease(model: nn.Module, weights: AttachedWeights) -> None:
    """The model keeps the lease (and the arena's map) for as long as vLLM keeps the model; a reload's lease
    replaces the last one. Module.__setattr__ is typed for tensors and modules, but a plain attribute is set
    like any other. From then on no step samples from weights the daemon reported changed in memory."""
    previous = getattr(model, "_wcache_weights", None)
    model._wcache_weights = weights  # type: ignore[assignment]
    if isinstance(previous, AttachedWeights):
        previous.close()
    guard_each_step(model, functools.partial(_refuse_corrupt, model))


class WeightsCorruptError(UnavailableError):
    """The daemon behind this engine's lease found its weights changed in memory: no step may run on them."""


def _refuse_corrupt(model: nn.Module) -> None:
    """Raise, failing vLLM's step, once the lease the model holds now was told its weights changed in memory (a
    reload in place to other weights before that step takes a lease whose weights are sound)."""
    weights = getattr(model, "_wcache_weights", None)
    why = weights.report.corrupt_sentence() if isinstance(weights, AttachedWeights) else None
    if why is not None:
        raise WeightsCorruptError(f"wcache: {why}; this engine runs no step on them (restart it once a daemon "
                                  "serves good weights).")


def _served_name(model_config: ModelConfig) -> str:
    """The name vLLM serves the model under (`--served-model-name`), else the model as it was given."""
    served = model_config.served_model_name
    return str(served[0] if isinstance(served, list | tuple) and served else served or model_config.model)


def _names(names: tuple[str, ...], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def daemon_weights(loader: WcacheModelLoader, model: nn.Module,
                   model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """What the loader gives vLLM's in-place reload: the daemon's tensors for `model_config.model` under
    checkpoint names. Attaches now, before vLLM touches a layer, and refuses (no fallback) on a miss."""
    from wcache.integrations.vllm.api import get_current_vllm_config

    previous = getattr(model, "_wcache_weights", None)
    try:
        weights = loader._attach(get_current_vllm_config(), model_config, reload=True)
    except CannotAttachError as exc:
        # vLLM already pointed the config at the new path; the engine still runs the old checkpoint's weights.
        if previous is not None:
            model_config.model = previous.key_file.source
        raise CannotAttachError(f"{exc}".rstrip(".")) from None
    return _load_then_keep(loader, model, model_config, weights)


def _load_then_keep(loader: WcacheModelLoader, model: nn.Module, model_config: ModelConfig,
                    weights: AttachedWeights) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        yield from weights.checkpoint_tensors().items()
    except BaseException:
        weights.close()
        raise
    # The new lease is what the engine holds now (the daemon counts it); the old daemon may go once it ends.
    _keep_lease(model, weights)
    loader._announce_hit(model_config, weights)
