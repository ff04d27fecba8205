"""KV storage and the per-step attention policy: paged blocks, rolling windows, and bounded replay.

Full-attention layers always store KV in paged blocks that the prefix cache can share. Sliding-window
layers do so too when bounded replay is off; with replay on (the default) they keep only a rolling
window per request and nothing of theirs enters the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from wcache.engine.config import SLIDING, ModelConfig


class PagedKV:
    """Block pools for the layers that keep paged KV: k and v of shape [blocks, block_size, kv_heads, d]."""

    def __init__(self, layers: tuple[int, ...], num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.block_size = block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype) for i in layers}

    def bytes_per_block(self, layers: tuple[int, ...]) -> int:
        if not layers:
            return 0
        one = self.k[layers[0]][0]
        return 2 * len(layers) * one.numel() * one.element_size()

    def _slots(self, block_table: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(block_table, dtype=torch.int64)
        return table[positions // self.block_size], positions % self.block_size

    def write(self, layer: int, block_table: list[int], positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        blocks, offsets = self._slots(block_table, positions)
        self.k[layer][blocks, offsets] = k
        self.v[layer][blocks, offsets] = v

    def gather(self, layer: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) as contiguous [length, kv_heads, d]."""
        positions = torch.arange(length)
        blocks, offsets = self._slots(block_table, positions)
        return self.k[layer][blocks, offsets], self.v[layer][blocks, offsets]


@dataclass
class WindowKV:
    """One request's rolling window for one sliding layer: the last `window` positions' keys and values."""

    window: int
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    start: int = 0  # position of k[0]

    def extend(self, first: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append a step's keys at positions first.. and return everything a query may need, with its start."""
        if self.k is None or self.v is None:
            self.k, self.v, self.start = k, v, first
        else:
            assert self.start + self.k.shape[0] == first, "window positions must be contiguous"
            self.k, self.v = torch.cat((self.k, k)), torch.cat((self.v, v))
        keys, values, start = self.k, self.v, self.start
        # Keep the last `window` positions: the most any later query can see.
        excess = self.k.shape[0] - self.window
        if excess > 0:
            self.k, self.v, self.start = self.k[excess:], self.v[excess:], self.start + excess
        return keys, values, start

    @property
    def nbytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class SequenceKV:
    """A request's cache state: its block table and, with replay on, its sliding-layer windows."""

    block_table: list[int] = field(default_factory=list)
    windows: dict[int, WindowKV] = field(default_factory=dict)


class StepAttention:
    """The attention policy for one forward step of one request.

    `write_floor`: paged layers do not write positions below it; those are cached blocks adopted from the
    prefix cache and stay as first written, even when replayed. `replay_start`: sliding-window attention
    reads nothing below it (the replayed window is rebuilt from there).
    """

    def __init__(self, config: ModelConfig, paged: PagedKV, seq: SequenceKV, positions: torch.Tensor,
                 paged_layers: frozenset[int], write_floor: int, replay_start: int) -> None:
        self.config = config
        self.paged = paged
        self.seq = seq
        self.positions = positions
        self.paged_layers = paged_layers
        self.write_floor = write_floor
        self.replay_start = replay_start

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sliding = self.config.layer_types[layer] == SLIDING
        last = int(self.positions[-1]) + 1
        if layer in self.paged_layers:
            keep = self.positions >= self.write_floor
            if bool(keep.any()):
                self.paged.write(layer, self.seq.block_table, self.positions[keep], k[keep], v[keep])
            keys, values = self.paged.gather(layer, self.seq.block_table, last)
            key_start = 0
        else:
            window = self.seq.windows.setdefault(layer, WindowKV(window=self.config.sliding_window or last))
            keys, values, key_start = window.extend(int(self.positions[0]), k, v)
        key_positions = torch.arange(key_start, key_start + keys.shape[0])
        allowed = key_positions[None, :] <= self.positions[:, None]
        if sliding:
            window_size = self.config.sliding_window or 0
            allowed &= key_positions[None, :] > self.positions[:, None] - window_size
            allowed &= key_positions[None, :] >= self.replay_start
        return _attention(q, keys, values, allowed)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with GQA; q [n, h, d], k/v [m, kv, d], allowed [n, m] -> [n, h, d]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # A leading batch dimension: 3-D inputs take SDPA's slow generic path on CPU (about 4× slower).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed[None, None]
    )
    return out[0].transpose(0, 1)
