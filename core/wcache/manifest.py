"""The per-tensor manifest of a checkpoint and the Merkle root over it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from wcache.canonical import canonical_json

_LEAF = b"\x00"
_NODE = b"\x01"


@dataclass(frozen=True, slots=True)
class TensorDigest:
    """One manifest entry: a tensor's identity and the BLAKE3 of its data bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str

    @classmethod
    def from_json(cls, data: Any) -> TensorDigest:
        """From to_json()'s form; malformed input raises KeyError, TypeError, ValueError or OverflowError."""
        return cls(str(data["name"]), str(data["dtype"]), tuple(int(d) for d in data["shape"]),
                   int(data["nbytes"]), str(data["digest"]))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
                "digest": self.digest}


def _leaf(entry: TensorDigest) -> bytes:
    # nbytes follows from dtype and shape, so it stays out of the leaf; the file a tensor sits in and its
    # offsets stay out too, which is what makes the root independent of how tensors are sharded.
    encoded = canonical_json([entry.name, entry.dtype, list(entry.shape), entry.digest]).encode()
    return blake3.blake3(_LEAF + encoded).digest()


def merkle_root(entries: Sequence[TensorDigest]) -> str:
    """Merkle root over the entries sorted by tensor name; domain-separated leaves and nodes."""
    level = [_leaf(e) for e in sorted(entries, key=lambda e: e.name)]
    if not level:
        return blake3.blake3(_NODE).hexdigest()
    while len(level) > 1:
        paired = [blake3.blake3(_NODE + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0].hex()
