"""wcache: content-fingerprinted caches of processed LLM weights.

The public API, for engine authors, benchmarks and tests (everything else is internal and may move):

    import wcache

    group = wcache.start_daemons("path/to/model")            # `wcache preload`, returns once ready
    with wcache.attach(Path("path/to/model")) as weights:    # hit (zero-copy), or the disk fallback
        engine_tensors = weights.tensors                      # the plan's names (qkv_proj, gate_up_proj)
        hf_tensors = weights.checkpoint_tensors()             # Hugging Face names, as views
        print(weights.report.outcome, weights.report.reason)
    key = wcache.compute_key(Path("path/to/model"))
    group.stop()

Names are loaded on first use, so `import wcache` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcache._version import __version__
from wcache.lazy_exports import lazy_exports

_EXPORTS = {
    "attach": "wcache.attach",
    "AttachedWeights": "wcache.attach",
    "AttachMissError": "wcache.attach",
    "AttachReport": "wcache.attach",
    "AttachOptions": "wcache.attach_options",
    "compute_key": "wcache.key.compute",
    "KeyFile": "wcache.key.cache_key",
    "WeightCacheKey": "wcache.key.cache_key",
    "diff_keys": "wcache.key.diff",
    "KeyDiff": "wcache.key.diff",
    "PlanSpec": "wcache.plan.spec",
    "start_daemons": "wcache.daemon.launch",
    "stop_daemon": "wcache.daemon.stopping",
    "DaemonGroup": "wcache.daemon.launch",
    "PreloadFailedError": "wcache.daemon.launch",
    "DaemonDescriptor": "wcache.ipc.run_dir.directory",
    "DaemonExistsError": "wcache.ipc.run_dir.directory",
    "census": "wcache.ipc.run_dir.directory",
    "resolve_model_path": "wcache.checkpoint.model_path",
    "WcacheError": "wcache.errors",
    "BadInputError": "wcache.errors",
    "UnavailableError": "wcache.errors",
}

__all__ = [
    "AttachMissError", "AttachOptions", "AttachReport", "AttachedWeights", "BadInputError", "DaemonDescriptor",
    "DaemonExistsError", "DaemonGroup", "KeyDiff", "KeyFile", "PlanSpec", "PreloadFailedError", "UnavailableError",
    "WcacheError", "WeightCacheKey", "__version__", "attach", "census", "compute_key", "diff_keys",
    "resolve_model_path", "start_daemons", "stop_daemon",
]
assert set(__all__) == {"__version__", *_EXPORTS}

if TYPE_CHECKING:
    from wcache.attach import AttachedWeights, AttachMissError, AttachReport, attach
    from wcache.attach_options import AttachOptions
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.daemon.launch import DaemonGroup, PreloadFailedError, start_daemons
    from wcache.daemon.stopping import stop_daemon
    from wcache.errors import BadInputError, UnavailableError, WcacheError
    from wcache.ipc.run_dir.directory import DaemonDescriptor, DaemonExistsError, census
    from wcache.key.cache_key import KeyFile, WeightCacheKey
    from wcache.key.compute import compute_key
    from wcache.key.diff import KeyDiff, diff_keys
    from wcache.plan.spec import PlanSpec


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
