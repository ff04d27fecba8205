"""The engine: prefix lookup, bounded replay, prefill, greedy decode, and the counters that describe them."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from wcache.attach_options import AttachOptions
from wcache.engine.block_manager import BlockManager, chain_hashes, weights_root
from wcache.engine.config import EngineConfig, ModelConfig
from wcache.engine.kv_cache import PagedKV, SequenceKV, StepAttention
from wcache.engine.model import Transformer
from wcache.engine.parallel import TensorParallel
from wcache.engine.threads import restored_threads, step_threads, use_threads
from wcache.engine.tokenizer import Tokenizer, load_tokenizer
from wcache.errors import CheckpointError
from wcache.key.cache_key import WeightCacheKey


@dataclass
class EngineCounters:
    """Cumulative counters, in tokens unless named otherwise (vLLM's meanings where names match)."""

    requests: int = 0
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # tokens of adopted hits, replayed window included (vLLM's accounting)
    lookup_hits: int = 0  # tokens the lookup found, adopted or not
    adopted_hits: int = 0  # requests whose hit was adopted
    rejected_hits: int = 0  # requests whose hit was no longer than the window (not adopted under replay)
    replayed_tokens: int = 0
    prefill_tokens: int = 0  # tokens actually computed in prefill
    prefill_tokens_saved: int = 0  # prompt tokens not computed thanks to the cache
    generation_tokens: int = 0
    swa_cached_bytes: int = 0  # sliding-window KV held for cached prefixes (a gauge, not cumulative)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class WeightsCounters:
    """Prefix-cache lookups and hits (tokens) of the requests one version of the weights served."""

    prefix_queries: int = 0
    prefix_hits: int = 0


@dataclass(frozen=True, slots=True)
class ServedWeights:
    """The weights an engine runs: the checkpoint they came from and its content key (None: handed over unkeyed)."""

    source: Path | None = None
    key: WeightCacheKey | None = None
    # Weights a daemon built from a delta exist in no checkpoint on disk: `source` is then that delta file, and
    # this the checkpoint of its lineage, whose config, tokenizer and tensor headers they share.
    lineage: Path | None = None

    @property
    def checkpoint(self) -> Path | None:
        """The checkpoint whose config, tokenizer and tensor headers these weights have."""
        return self.lineage if self.lineage is not None else self.source

    @property
    def name(self) -> str | None:
        """The model these weights are of, as an engine's API names it."""
        return self.checkpoint.name if self.checkpoint is not None else None

    @property
    def namespace(self) -> str | None:
        """What the prefix cache is namespaced by: the full key digest."""
        return self.key.digest if self.key is not None else None

    @property
    def key_id(self) -> str | None:
        return self.key.short_id if self.key is not None else None


@dataclass(frozen=True, slots=True)
class Generation:
    """One request's result and what the cache did for it."""

    token_ids: list[int]
    prompt_tokens: int
    hit_tokens: int
    adopted: bool
    replayed_tokens: int
    prefill_tokens: int
    weights_key: str | None = None  # the short key of the weights that ran the whole request


@dataclass
class _Request:
    tokens: list[int]
    kv: SequenceKV = field(default_factory=SequenceKV)
    computed: int = 0  # positions whose KV is stored (paged layers)
    threads: int = 1  # the most threads a step may use: torch's setting when the request came in


class Engine:
    """One TP rank's engine; requests run one at a time (a reference engine, not a batching scheduler)."""

    def __init__(self, model_config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 engine_config: EngineConfig | None = None, tp: TensorParallel | None = None,
                 tokenizer: Tokenizer | None = None, served: ServedWeights | None = None) -> None:
        self.model_config = model_config
        self.config = engine_config or EngineConfig()
        self.tp = tp or TensorParallel()
        self.model = Transformer(model_config, weights, self.tp)
        self.tokenizer = tokenizer
        self.replay = self.config.swa_bounded_replay and bool(model_config.sliding_layers)
        self.window = model_config.sliding_window or 0
        # With replay, sliding layers leave the paged cache (and so the prefix cache) entirely.
        paged = model_config.full_layers if self.replay else tuple(range(model_config.num_layers))
        self.paged_layers = frozenset(paged)
        self.blocks = BlockManager(self.config.num_blocks, self.config.block_size)
        self.kv = PagedKV(tuple(sorted(paged)), self.config.num_blocks, self.config.block_size,
                          self.model.num_kv_heads, self.model.head_dim, self.model.dtype)
        self._swa_bytes_per_block = 0 if self.replay else self.kv.bytes_per_block(model_config.sliding_layers)
        self.counters = EngineCounters()
        self.weights_counters: dict[str, WeightsCounters] = {}  # by short key; "" for unkeyed weights
        self.lock = threading.Lock()
        self.switch_lock = threading.Lock()  # one weight switch at a time (engine.switch)
        self._keepalive: Any = None  # e.g. the attach lease that backs zero-copy weights
        self.served = served or ServedWeights()
        self._root = weights_root(self.served.namespace)
        self.blocks.serve(self.served.namespace)
        # What a switch attaches with: the plan, options and device this engine attached with (None: it did not).
        self.attach_plan: Any = None
        self.attach_options: AttachOptions | None = None
        self.device = "cpu"

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def from_weights(cls, checkpoint: Path, weights: Mapping[str, torch.Tensor],
                     engine_config: EngineConfig | None = None, tp: TensorParallel | None = None,
                     key: WeightCacheKey | None = None) -> Engine:
        """An engine over `weights` made from `checkpoint`, whose content key is `key` (None: not keyed)."""
        model_config, tokenizer = checkpoint_model(checkpoint)
        return cls(model_config, weights, engine_config, tp, tokenizer, ServedWeights(checkpoint, key))

    @classmethod
    def from_disk(cls, checkpoint: Path, plan: Any = None, engine_config: EngineConfig | None = None,
                  tp: TensorParallel | None = None) -> Engine:
        """Load through the processing plan from disk (the path every engine without wcache takes)."""
        from wcache.key.compute import compute_key
        from wcache.key.digest_store import DigestStore
        from wcache.load.loader import load_from_disk
        from wcache.plan.spec import PlanSpec

        spec = plan or PlanSpec(tp_size=(tp or TensorParallel()).size, tp_rank=(tp or TensorParallel()).rank)
        with DigestStore.open() as store:
            key_file = compute_key(checkpoint, spec, store=store)
        return cls.from_weights(checkpoint, load_from_disk(key_file, checkpoint), engine_config, tp, key_file.key)

    @classmethod
    def from_attach(cls, checkpoint: Path, plan: Any = None, engine_config: EngineConfig | None = None,
                    tp: TensorParallel | None = None, *, options: AttachOptions | None = None,
                    device: str = "cpu") -> Engine:
        """Take weights through wcache (zero-copy, copy, or the disk fallback); the report is `attach_report`."""
        from wcache.attach import attach_with
        from wcache.key.digest_store import DigestStore
        from wcache.plan.spec import PlanSpec

        spec = plan or PlanSpec(tp_size=(tp or TensorParallel()).size, tp_rank=(tp or TensorParallel()).rank)
        with DigestStore.open() as store:
            attached = attach_with(checkpoint, spec, options or AttachOptions(), device=device, store=store)
        try:
            engine = cls.from_weights(checkpoint, attached.tensors, engine_config, tp, attached.key_file.key)
        except BaseException:
            attached.close()
            raise
        engine._keepalive = attached
        engine.attach_plan, engine.attach_options, engine.device = spec, options or AttachOptions(), device
        return engine

    def install(self, model: Transformer, tokenizer: Tokenizer | None, served: ServedWeights,
                keepalive: Any) -> Any:
        """Run later requests on `model` (built for this engine's config); the keepalive it replaced is returned
        for the caller to close. Taken between requests: the one running finishes on the weights it began with."""
        with self.lock:
            previous = self._keepalive
            self.model, self.tokenizer, self.served, self._keepalive = model, tokenizer, served, keepalive
            self._root = weights_root(served.namespace)
            self.blocks.serve(served.namespace)
            return previous

    @property
    def attach_report(self) -> Any:
        return getattr(self._keepalive, "report", None)

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()

    # -- requests ------------------------------------------------------------------------------------

    def _step(self, request: _Request, start: int, write_floor: int, replay_start: int) -> torch.Tensor:
        """Run positions [start, len(tokens)) and return their hidden states."""
        end = len(request.tokens)
        block_size = self.config.block_size
        while len(request.kv.block_table) * block_size < end:
            request.kv.block_table.append(self.blocks.allocate())
        use_threads(step_threads(request.threads, end - start, self.model.layer_macs))
        positions = torch.arange(start, end)
        tokens = torch.tensor(request.tokens[start:end], dtype=torch.int64)
        attention = StepAttention(self.model_config, self.kv, request.kv, start, end, self.paged_layers,
                                  write_floor, replay_start)
        hidden = self.model.forward(tokens, positions, attention)
        request.computed = end
        return hidden

    def _lookup(self, tokens: list[int]) -> list[int]:
        if not self.config.enable_prefix_caching:
            return []
        # Cap the hit below the prompt length: the last prompt token is always computed for its logits.
        hashes = chain_hashes(tokens, self.config.block_size, self._root)
        return self.blocks.match(hashes[: (len(tokens) - 1) // self.config.block_size], self.served.namespace)

    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Cold logits of every prompt position (no prefix cache read or written): [len, vocab]."""
        with self.lock, torch.inference_mode(), restored_threads() as threads:
            request = _Request(list(token_ids), threads=threads)
            try:
                return self.model.logits(self._step(request, 0, 0, 0))
            finally:
                # Never registered, so never matched: the blocks go back to the pool as plain free blocks.
                self.blocks.release(request.kv.block_table)

    def generate(self, token_ids: list[int], max_new_tokens: int) -> Generation:
        """Greedy decoding with prefix caching (and bounded replay on sliding layers when enabled)."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        with self.lock, torch.inference_mode(), restored_threads() as threads:
            return self._generate(list(token_ids), max_new_tokens, threads)

    def _generate(self, prompt: list[int], max_new_tokens: int, threads: int) -> Generation:
        c = self.counters
        c.requests += 1
        request = _Request(list(prompt), SequenceKV(capacity=len(prompt) + max_new_tokens), threads=threads)
        hit_blocks = self._lookup(prompt)
        hit = len(hit_blocks) * self.config.block_size
        c.prefix_queries += len(prompt)
        by_weights = self.weights_counters.setdefault(self.served.key_id or "", WeightsCounters())
        by_weights.prefix_queries += len(prompt)
        c.lookup_hits += hit
        adopted = hit > 0
        if self.replay and 0 < hit <= self.window:
            # A hit no longer than the window would be recomputed in full by the replay: it saves nothing.
            adopted = False
            c.rejected_hits += 1
        start = 0
        if adopted:
            self.blocks.acquire(hit_blocks)
            request.kv.block_table = list(hit_blocks)
            start = hit - min(self.window, hit) if self.replay else hit
            c.adopted_hits += 1
            c.prefix_hits += hit
            by_weights.prefix_hits += hit
            c.replayed_tokens += hit - start
        write_floor = hit if adopted else 0
        try:
            # Only a replayed window is clamped; without replay the cached sliding KV is read as stored.
            hidden = self._step(request, start, write_floor, start if self.replay else 0)
            c.prefill_tokens += len(prompt) - start
            c.prefill_tokens_saved += start
            generated: list[int] = []
            logits = self.model.logits(hidden[-1:])
            eos = set(self.model_config.eos_token_ids)
            while len(generated) < max_new_tokens:
                token = self.tp.broadcast_ints([int(torch.argmax(logits[-1]))])[0]
                generated.append(token)
                if token in eos or len(generated) == max_new_tokens:
                    break
                request.tokens.append(token)
                hidden = self._step(request, len(request.tokens) - 1, 0, 0)
                logits = self.model.logits(hidden)
            c.generation_tokens += len(generated)
            self._register(request)
        finally:
            # Tail first: LRU then evicts a prefix from its end, and what stays cached is still a matchable prefix.
            self.blocks.release(request.kv.block_table[::-1])
        c.swa_cached_bytes = self._swa_bytes_per_block * self.blocks.num_cached
        return Generation(generated, len(prompt), hit, adopted, (hit - start) if adopted else 0, len(prompt) - start,
                          self.served.key_id)

    def _register(self, request: _Request) -> None:
        """Make every full block whose KV is stored findable by later requests."""
        hashes = chain_hashes(request.tokens[: request.computed], self.config.block_size, self._root)
        for block_id, block_hash in zip(request.kv.block_table, hashes, strict=False):
            self.blocks.register(block_id, block_hash, self.served.namespace)

    # -- text ----------------------------------------------------------------------------------------

    def complete(self, prompt: str, max_new_tokens: int) -> tuple[str, Generation]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer")
        generation = self.generate(self.tokenizer.encode(prompt), max_new_tokens)
        return self.tokenizer.decode(generation.token_ids), generation


def checkpoint_model(checkpoint: Path) -> tuple[ModelConfig, Tokenizer | None]:
    """The architecture `checkpoint`'s config.json names, and its tokenizer (None when it has none)."""
    from wcache.checkpoint.files import locate

    layout = locate(checkpoint)
    if layout.config is None:
        raise CheckpointError(f"{checkpoint} has no config.json; the engine needs the architecture it names.")
    return ModelConfig.from_hf(layout.config), load_tokenizer(layout.root)
