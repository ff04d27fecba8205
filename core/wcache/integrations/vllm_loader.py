"""The vLLM load format `wcache`: vLLM's parameters take a daemon's processed tensors, or vLLM loads from disk.

`--load-format wcache --model-loader-extra-config '{"mode": "copy"}'` (server) or `LLM(..., load_format="wcache",
model_loader_extra_config={...})` (offline); the options are `wcache.attach_options.AttachOptions`. The plan
comes from vLLM's own configuration (TP size and rank from its parallel state, dtype from the model config,
the layout from the model class's fusions; see `vllm_formats`, which also says which pre-quantized formats
are served), so the key is the one `wcache preload` computes for the same checkpoint and TP size.

On a hit every vLLM parameter whose name, shape and dtype equal a daemon tensor's takes that tensor as is
(zero-copy: a view of the daemon's arena); the rest go through the model's own `load_weights` under Hugging
Face names, copied from views of the arena, never read from disk. vLLM's CPU backend then repacks linear
weights for oneDNN into memory of its own and drops the parameter: that copy is vLLM's. The arena is mapped
copy-on-write, so such post-processing can never write into the weights other engines read.

On a miss one warning says why (wcache's diff), and vLLM's default loader reads the checkpoint; with
`"fallback": false` the engine does not start and the error says why.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from wcache.attach import AttachedWeights, AttachMissError, attach_with
from wcache.attach_options import AttachOptions
from wcache.checkpoint.files import locate
from wcache.checkpoint.model_path import resolve_model_path
from wcache.errors import CheckpointError, UnavailableError, WcacheError
from wcache.integrations import vllm_formats
from wcache.ipc.rundir import default_run_dir, ensure_run_dir
from wcache.key.digest_store import DigestStore
from wcache.monitor.events import append_event
from wcache.plan.processing import UnsupportedPlanError
from wcache.plan.spec import PlanSpec

# Under "vllm." so that vLLM's own logging configuration (format, level, VLLM_LOGGING_LEVEL) applies.
logger = init_logger("vllm.wcache")

ENGINE = "vllm"
EXTRA_CONFIG = "model_loader_extra_config"


class CannotAttachError(UnavailableError):
    """vLLM's configuration or model cannot take a daemon's tensors; with fallback on, vLLM loads from disk."""


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """How a hit's tensors reached vLLM's parameters."""

    assigned: int  # parameters that now are the daemon's tensors (views of the arena in zero-copy mode)
    copied: int  # parameters filled by the model's load_weights from checkpoint-named views
    post_processing_s: float = 0.0  # vLLM's process_weights_after_loading (the oneDNN repack on CPU)
    note: str = ""  # what the log line adds for this model (its stacked experts, parameters left as vLLM made them)


def plan_for(vllm_config: VllmConfig, model_config: ModelConfig) -> PlanSpec:
    """The plan a daemon must hold for this vLLM rank."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise CannotAttachError("wcache does not serve pipeline-parallel vLLM ranks")
    vllm_formats.check_quantization(model_config)
    config = locate(resolve_model_path(model_config.model, model_config.revision)).config
    dtype = str(model_config.dtype).removeprefix("torch.")
    return PlanSpec(tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank(),
                    dtype=dtype, layout=vllm_formats.layout_for_vllm(model_config, config))


def device_name(vllm_config: VllmConfig) -> str:
    """The daemon device this rank attaches to: "cpu", or "cuda:N" for the rank's current device."""
    device = torch.device(vllm_config.device_config.device_type)  # `device` is None on some platforms (TPU)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def place(model: nn.Module, weights: AttachedWeights, plan: PlanSpec, quantized: bool = False) -> Placement:
    """Give every vLLM parameter its tensor: the daemon's own where it fits, else through load_weights.

    With `quantized`, parameters that neither the daemon nor load_weights fill (the attention's KV-cache
    scales a checkpoint may leave out) keep the values vLLM created them with, as vLLM's disk loader leaves them.
    """
    assigned: set[str] = set()
    params = dict(model.named_parameters())
    for name, param in params.items():
        tensor = weights.tensors.get(vllm_formats.daemon_name(name))
        if (tensor is not None and tuple(tensor.shape) == tuple(param.shape) and tensor.dtype == param.dtype
                and tensor.device.type == param.device.type):
            param.data = tensor
            assigned.add(name)
    rest = [name for name in params if name not in assigned]
    note = vllm_formats.expert_note(model, assigned)
    if not rest:
        return Placement(len(assigned), 0, note=note)
    taken = {vllm_formats.daemon_name(name) for name in assigned}
    unused = [name for name in weights.tensors if name not in taken]
    if not unused and quantized:
        # Every daemon tensor is placed; what is left the checkpoint does not hold (on any rank).
        missing = rest
    elif plan.tp_size > 1:
        # load_weights shards full checkpoint tensors itself; a daemon holds only this rank's shard.
        raise CannotAttachError(
            f"vLLM parameter {rest[0]} has no daemon tensor of its shape and dtype, and a TP shard cannot be "
            "reloaded under checkpoint names"
        )
    else:
        # Every vLLM model class has load_weights, but no vLLM type declares it: nn.Module's __getattr__ answers.
        loaded = model.load_weights(weights.checkpoint_tensors(unused).items())  # type: ignore[operator]
        missing = [name for name in rest if loaded is not None and name not in loaded]
    if missing and not quantized:
        raise CannotAttachError(f"the daemon holds nothing vLLM can load into parameter {missing[0]}")
    if missing:
        note += f"; {len(missing)} the checkpoint lacks (such as {missing[0]}) kept vLLM's initial values, as from disk"
    return Placement(len(assigned), len(rest) - len(missing), note=note)


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
            logger.info("wcache: no daemon memory to account for (%s)", exc)
            return 0
        return daemon.weights_bytes

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's in-place reload (`reload_weights`, what `wcache.integrations.vllm_switch.switch` runs)."""
        from wcache.integrations.vllm_switch import daemon_weights

        return daemon_weights(self, model, model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """In-place reload: the daemon's tensors copied in under checkpoint names, else vLLM's disk loader."""
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        try:
            weights = self._attach(vllm_config, model_config)
        except CannotAttachError as exc:
            if not self.options.fallback:
                raise
            logger.warning("wcache: cannot reload from a daemon (%s); reloading from disk", exc)
            self._disk_loader().load_weights(model, model_config)
            return
        with weights:
            # load_weights is on every vLLM model class but on no vLLM type (see place).
            model.load_weights(weights.checkpoint_tensors().items())  # type: ignore[operator]

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        began = time.perf_counter()
        try:
            weights = self._attach(vllm_config, model_config)
        except CannotAttachError as exc:
            return self._fall_back(vllm_config, model_config, prefix, str(exc))
        try:
            model, placement = self._build(vllm_config, model_config, prefix, weights)
        except CannotAttachError as exc:
            weights.close()
            return self._fall_back(vllm_config, model_config, prefix, str(exc))
        report = weights.report
        how = "zero-copy views of its arena" if report.mode == "zero_copy" else "private copies (copy mode)"
        logger.info(
            "wcache: weight cache hit from daemon %s (key %s): %d parameters took the daemon's tensors as %s, "
            "%d were copied in through load_weights%s; no checkpoint byte was read (attach %.1f ms, vLLM's "
            "post-processing %.1f ms; %.1f ms, post-processing included)", report.daemon, report.daemon_key_id,
            placement.assigned, how, placement.copied, placement.note, report.timings_ms.get("total", 0.0),
            placement.post_processing_s * 1000, (time.perf_counter() - began) * 1000,
        )
        return model

    def _attach(self, vllm_config: VllmConfig, model_config: ModelConfig) -> AttachedWeights:
        """The daemon's tensors for this rank; CannotAttachError (with the reason) when there are none."""
        try:
            plan = plan_for(vllm_config, model_config)
            path = resolve_model_path(model_config.model, model_config.revision)
            with DigestStore.open() as store:
                options = dataclasses.replace(self.options, fallback=False)
                return attach_with(path, plan, options, device=device_name(vllm_config), store=store, engine=ENGINE)
        except AttachMissError as exc:
            raise CannotAttachError(exc.report.reason or str(exc)) from None
        except (UnsupportedPlanError, CheckpointError) as exc:
            # E.g. a Hugging Face id not downloaded yet: vLLM's own loader fetches it; wcache never downloads.
            raise CannotAttachError(str(exc).rstrip(".")) from None

    def _build(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
               weights: AttachedWeights) -> tuple[nn.Module, Placement]:
        target_device = torch.device(self.load_config.device or vllm_config.device_config.device_type)
        # ModelConfig declares dtype as a name or a torch.dtype; its __post_init__ always leaves a torch.dtype.
        with set_default_torch_dtype(model_config.dtype):  # type: ignore[arg-type]
            # Built on the device, as vLLM's own loaders do: the parameters' memory is allocated but never
            # touched before the daemon's tensors replace it.
            with target_device:
                model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            placement = place(model, weights, weights.key_file.plan, quantized=bool(model_config.quantization))
            began = time.perf_counter()
            process_weights_after_loading(model, model_config, target_device)
            placement = dataclasses.replace(placement, post_processing_s=time.perf_counter() - began)
        # The model keeps the lease (and the arena's map) for as long as vLLM keeps the model. Module.__setattr__
        # is typed for tensors and modules, but a plain attribute is set like any other.
        model._wcache_weights = weights  # type: ignore[assignment]
        return model.eval(), placement

    def _fall_back(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, reason: str) -> nn.Module:
        if not self.options.fallback:
            raise CannotAttachError(f"wcache: {reason}; not falling back to disk (fallback is false).")
        logger.warning("wcache: weight cache miss for %s: %s; falling back to disk loading (load_format=auto)",
                       model_config.model, reason)
        began = time.perf_counter()
        model = self._disk_loader().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        seconds = time.perf_counter() - began
        logger.info("wcache: vLLM's default loader read %s from disk (%.1f ms, post-processing included)",
                    model_config.model, seconds * 1000)
        append_event(self._run_dir(), "fallback", source=str(model_config.model), device=device_name(vllm_config),
                     reason=reason, seconds=round(seconds, 3), engine=ENGINE)
        return model
