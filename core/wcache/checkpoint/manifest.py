"""The per-tensor manifest of a checkpoint and the Merkle root over it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from json.encoder import encode_basestring
from operator import attrgetter

import blake3

from wcache.schema import Schema

_LEAF = b"\x00"
_NODE = b"\x01"


class TensorDigest(Schema, frozen=True, gc=False):
    """One manifest entry: a tensor's identity and the BLAKE3 of its data bytes."""

    # gc=False: strings, ints and a tuple of ints make no cycle, and a 100k-tensor manifest decoded without the
    # collector tracking each entry takes half the time (benchmarks/manifest_codec.py).

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str


# A manifest, or what builds it when first asked for: a key whose root came from the digest store builds its
# per-tensor list only for whoever needs it (a diff, verify, a tensor table), not on every attach.
ManifestSource = tuple[TensorDigest, ...] | Callable[[], tuple[TensorDigest, ...]]


def build_manifest(source: ManifestSource) -> tuple[TensorDigest, ...]:
    """The manifest `source` holds or builds."""
    return source if isinstance(source, tuple) else source()


def _leaf(entry: TensorDigest) -> bytes:
    # nbytes follows from dtype and shape, so it stays out of the leaf; the file a tensor sits in and its
    # offsets stay out too, which is what makes the root independent of how tensors are sharded.
    # The bytes are canonical_json([name, dtype, list(shape), digest]) (a list has no keys to sort), spelled
    # out with the JSON encoder's own string escaper: json.dumps costs ~3 µs a call, and a key has a leaf per tensor.
    text = (f"[{encode_basestring(entry.name)},{encode_basestring(entry.dtype)},"
            f"[{','.join(map(int.__repr__, entry.shape))}],{encode_basestring(entry.digest)}]")
    return blake3.blake3(_LEAF + text.encode()).digest()


def merkle_root(entries: Sequence[TensorDigest]) -> str:
    """Merkle root over the entries sorted by tensor name; domain-separated leaves and nodes."""
    level = [_leaf(e) for e in sorted(entries, key=attrgetter("name"))]
    if not level:
        return blake3.blake3(_NODE).hexdigest()
    hasher = blake3.blake3
    while len(level) > 1:
        # An odd last node has no partner in the zip; it is carried up as it is.
        paired = [hasher(_NODE + a + b).digest() for a, b in zip(level[::2], level[1::2], strict=False)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0].hex()
