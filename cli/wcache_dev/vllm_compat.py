"""vLLM 0.31's checkpoint fingerprint and the sampled variant proposed in #59648, reimplemented.

They exist so the demo and the benchmark can show, side by side, what each method notices and what it
costs. Neither is used to decide anything in wcache.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from wcache.checkpoint.files import INDEX_NAME

SAMPLE_BYTES = 1024


def _shards(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"), key=lambda p: p.name)
    index = model_dir / INDEX_NAME
    if index.exists():
        listed = set(json.loads(index.read_text())["weight_map"].values())
        files = [f for f in files if f.name in listed]
    return files


def header_fingerprint(model_dir: Path) -> str:
    """vLLM 0.31 `hash_checkpoint`: each shard's name and raw header, sorted by name; no tensor bytes."""
    hasher = hashlib.sha256()
    for shard in _shards(model_dir):
        with shard.open("rb") as f:
            prefix = f.read(8)
            (length,) = struct.unpack("<Q", prefix)
            hasher.update(shard.name.encode())
            hasher.update(prefix + f.read(length))
    return hasher.hexdigest()


def sampled_fingerprint(model_dir: Path) -> str:
    """#59648's proposal: the header fingerprint plus each shard's size and each tensor's first KiB."""
    hasher = hashlib.sha256(header_fingerprint(model_dir).encode())
    for shard in _shards(model_dir):
        with shard.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            hasher.update(str(shard.stat().st_size).encode())
            for name in sorted(k for k in header if k != "__metadata__"):
                start, end = header[name]["data_offsets"]
                f.seek(8 + length + start)
                hasher.update(f.read(min(SAMPLE_BYTES, end - start)))
    return hasher.hexdigest()
