"""The reference engine: a small decoder-only transformer with paged KV, prefix caching and SWA replay.

Names load on first use, so `import wcache.engine.block_manager` (pure Python) does not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcache.lazy_exports import lazy_exports

_EXPORTS = {
    "Engine": "wcache.engine.engine",
    "EngineCounters": "wcache.engine.engine",
    "Generation": "wcache.engine.engine",
    "EngineConfig": "wcache.engine.config",
    "ModelConfig": "wcache.engine.config",
}
__all__ = ["Engine", "EngineConfig", "EngineCounters", "Generation", "ModelConfig"]
assert set(__all__) == set(_EXPORTS)

if TYPE_CHECKING:
    from wcache.engine.config import EngineConfig, ModelConfig
    from wcache.engine.engine import Engine, EngineCounters, Generation

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
