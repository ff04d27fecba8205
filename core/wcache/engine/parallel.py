"""Tensor-parallel collectives for the engine; with one rank they are the identity."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's rank and the group size; collectives go through torch.distributed (gloo on CPU)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        # gloo reduces float32 deterministically in rank order; sum in float32 whatever the compute dtype.
        summed = tensor.to(torch.float32).contiguous()
        dist.all_reduce(summed)
        return summed.to(tensor.dtype)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's list, on every rank (the greedy token every rank must agree on)."""
        if self.size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(tensor, src=0)
        return [int(v) for v in tensor.tolist()]
