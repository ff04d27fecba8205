"""KV storage and the per-step attention policy: paged blocks, rolling windows, and bounded replay.

Full-attention layers always store KV in paged blocks that the prefix cache can share. Sliding-window
layers do so too when bounded replay is off; with replay on (the default) they keep only a rolling
window per request and nothing of theirs enters the prefix cache.

Attention never reads the paged blocks directly: each request keeps, per layer, a run of consecutive
positions in a buffer of its own (`RunKV`), filled once from the blocks it adopted and then appended to
step by step, so a decode step attends over a view instead of gathering every block again.
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
        # Uninitialised: the kernel maps a page on first write, so the pool costs nothing until blocks are used
        # (zeroing the default pool took seconds), and no slot is read before a request has written it.
        self.k = {i: torch.empty(shape, dtype=dtype) for i in layers}
        self.v = {i: torch.empty(shape, dtype=dtype) for i in layers}

    def bytes_per_block(self, layers: tuple[int, ...]) -> int:
        if not layers:
            return 0
        one = self.k[layers[0]][0]
        return 2 * len(layers) * one.numel() * one.element_size()

    def slots(self, block_table: list[int], first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of positions [first, end)."""
        positions = torch.arange(first, end)
        table = torch.tensor(block_table, dtype=torch.int64)
        return table[positions // self.block_size], positions % self.block_size

    def write(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def read(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` as [n, kv_heads, d]."""
        return self.k[layer][slots], self.v[layer][slots]


class RunKV:
    """Keys and values of consecutive positions [start, end), rows of buffers [kv_heads, capacity, d].

    Attention reads a view of it (the layout SDPA takes without a copy). Appending past the capacity first
    moves the live rows to the front, and grows the buffers only when they are not enough.
    """

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int) -> None:
        self.k = torch.empty((kv_heads, max(1, capacity), head_dim), dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.start = self.end = 0
        self.row = 0  # buffer row of position `start`

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store positions first.. (k and v [n, kv_heads, d]); `first` continues the run, or starts an empty one."""
        if not len(self):
            self.start = self.end = first
            self.row = 0
        assert first == self.end, "run positions must be contiguous"
        n = k.shape[0]
        if self.row + len(self) + n > self.k.shape[1]:
            self._make_room(len(self) + n)
        at = self.row + len(self)
        self.k[:, at : at + n] = k.transpose(0, 1)
        self.v[:, at : at + n] = v.transpose(0, 1)
        self.end += n

    def drop_before(self, position: int) -> None:
        """Forget positions below `position` (a window's keys no later query can see)."""
        cut = min(max(0, position - self.start), len(self))
        self.start += cut
        self.row += cut

    def view(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [first, end) as [kv_heads, end - first, d] views."""
        assert self.start <= first <= end <= self.end, "the run does not hold those positions"
        lo, hi = self.row + first - self.start, self.row + end - self.start
        return self.k[:, lo:hi], self.v[:, lo:hi]

    def _make_room(self, needed: int) -> None:
        live = slice(self.row, self.row + len(self))
        capacity = self.k.shape[1] if needed <= self.k.shape[1] else max(needed, 2 * self.k.shape[1])
        k, v = (torch.empty((t.shape[0], capacity, t.shape[2]), dtype=t.dtype) for t in (self.k, self.v))
        k[:, : len(self)], v[:, : len(self)] = self.k[:, live], self.v[:, live]
        self.k, self.v, self.row = k, v, 0


@dataclass
class SequenceKV:
    """A request's cache state: its block table and, per layer, the run of KV its attention reads.

    `capacity`: the positions the request may reach, so that its runs are allocated once.
    """

    block_table: list[int] = field(default_factory=list)
    runs: dict[int, RunKV] = field(default_factory=dict)
    capacity: int = 0


class StepAttention:
    """The attention policy for one forward step of one request, over positions [start, end).

    `write_floor`: paged layers do not write positions below it; those are cached blocks adopted from the
    prefix cache and stay as first written, even when replayed. `replay_start`: sliding-window attention
    reads nothing below it (the replayed window is rebuilt from there).
    """

    def __init__(self, config: ModelConfig, paged: PagedKV, seq: SequenceKV, start: int, end: int,
                 paged_layers: frozenset[int], write_floor: int, replay_start: int) -> None:
        self.config = config
        self.paged = paged
        self.seq = seq
        self.start, self.end = start, end
        self.paged_layers = paged_layers
        self.write_floor = write_floor
        self.replay_start = replay_start
        self._first_written = max(start, write_floor)
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None  # the same for every paged layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = (self.config.sliding_window or 0) if self.config.layer_types[layer] == SLIDING else 0
        run = self.seq.runs.get(layer)
        if run is None:
            capacity = self.seq.capacity or self.end
            run = RunKV(k.shape[1], k.shape[2], k.dtype, min(capacity, 2 * window) if window else capacity)
            self.seq.runs[layer] = run
        if window:
            run.drop_before(self.start - window + 1)  # what none of this step's queries, nor later ones, can see
        if layer in self.paged_layers:
            self._store_paged(layer, run, k, v, window)
        else:
            run.append(self.start, k, v)
        first = run.start
        if window:
            first = max(first, self.start - window + 1, self.replay_start)
        keys, values = run.view(first, self.end)
        return _attention(q, keys, values, self._mask(first, window))

    def _store_paged(self, layer: int, run: RunKV, k: torch.Tensor, v: torch.Tensor, window: int) -> None:
        begin = run.end if len(run) else (max(0, self.start - window + 1) if window else 0)
        if begin < self.write_floor:
            # The adopted blocks' KV, copied into the request's run once.
            slots = self.paged.slots(self.seq.block_table, begin, self.write_floor)
            run.append(begin, *self.paged.read(layer, slots))
        skip = self._first_written - self.start  # replayed positions below the floor read the cached KV
        if skip >= k.shape[0]:
            return
        if self._slots is None:
            self._slots = self.paged.slots(self.seq.block_table, self._first_written, self.end)
        self.paged.write(layer, self._slots, k[skip:], v[skip:])
        run.append(self._first_written, k[skip:], v[skip:])

    def _mask(self, first: int, window: int) -> torch.Tensor | bool | None:
        """None: every key is visible to every query; True: causal over a square; else the boolean mask."""
        if self.end - self.start == 1:
            return None  # one query: `first` already drops what it may not see
        if first == self.start and (not window or self.end - self.start <= window):
            return True
        queries = torch.arange(self.start, self.end)[:, None]
        keys = torch.arange(first, self.end)[None, :]
        allowed = keys <= queries
        if window:
            allowed &= keys > queries - window
        return allowed


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | bool | None) -> torch.Tensor:
    """Scaled dot-product attention with GQA; q [n, h, d], k/v [kv, m, d] -> [n, h, d].

    mask: None (all keys visible), True (causal, n == m) or a boolean [n, m] of allowed keys.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[0]
    if n == 1:
        # One query: the heads sharing a KV head become its query rows, so K and V are read as stored. On CPU
        # this is ~8x faster in bf16 than SDPA's enable_gqa for a single query.
        folded = q.reshape(kv_heads, heads // kv_heads, d)
        out = F.scaled_dot_product_attention(folded[None], k[None], v[None])
        return out.reshape(1, heads, d)
    # A leading batch dimension: 3-D inputs take SDPA's slow generic path on CPU (about 4× slower).
    attn_mask = mask[None, None] if isinstance(mask, torch.Tensor) else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=attn_mask,
                                         is_causal=mask is True, enable_gqa=heads != kv_heads)
    return out[0].transpose(0, 1)
