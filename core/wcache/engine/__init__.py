"""The reference engine: a small decoder-only transformer with paged KV, prefix caching and SWA replay."""

from wcache.engine.config import EngineConfig, ModelConfig
from wcache.engine.engine import Engine, EngineCounters, Generation

__all__ = ["Engine", "EngineConfig", "EngineCounters", "Generation", "ModelConfig"]
