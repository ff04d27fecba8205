"""A strict parser for safetensors headers: every lie a header can tell is one CheckpointError."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wcache.checkpoint.dtypes import ITEMSIZE
from wcache.errors import CheckpointError

PREFIX_BYTES = 8
# The safetensors reference implementation refuses headers above 100 MB; so do we, before allocating.
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as a header describes it; offsets are relative to the start of the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """A parsed, validated safetensors header."""

    header_bytes: int
    metadata: dict[str, str]
    tensors: tuple[TensorInfo, ...]

    @property
    def data_start(self) -> int:
        return PREFIX_BYTES + self.header_bytes

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def header_length(prefix: bytes, file_size: int, path: Path) -> int:
    """Validate the 8-byte little-endian length prefix against the file size and the cap."""
    if file_size < PREFIX_BYTES or len(prefix) < PREFIX_BYTES:
        raise CheckpointError(f"{path} is truncated: {file_size} bytes is too short for a safetensors file.")
    (length,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path} declares a {length}-byte header, above the {MAX_HEADER_BYTES}-byte limit."
        )
    if length > file_size - PREFIX_BYTES:
        raise CheckpointError(
            f"{path} is truncated: its header claims {length} bytes but the file holds "
            f"{file_size - PREFIX_BYTES} after the length prefix."
        )
    if length < 2:
        raise CheckpointError(f"{path} has a {length}-byte header, too short to be a JSON object.")
    return length


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _is_int(value: object) -> bool:
    # bool is an int subclass; a shape of [true] is a lie, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(raw: bytes, file_size: int, path: Path) -> ShardHeader:
    """Parse header JSON `raw` (without the length prefix) of a file of `file_size` bytes."""
    header_bytes = len(raw)
    data_bytes = file_size - PREFIX_BYTES - header_bytes
    try:
        text = raw.decode("utf-8")
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} has a header that is not UTF-8.") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} has a header that is not valid JSON ({exc}).") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{path} has a header that is not a JSON object.")

    metadata: dict[str, str] = {}
    tensors: list[TensorInfo] = []
    for name, entry in document.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                raise CheckpointError(f"{path} has __metadata__ that is not a map of strings to strings.")
            metadata = dict(entry)
            continue
        tensors.append(_parse_tensor(name, entry, data_bytes, path))

    _check_layout(tensors, data_bytes, path)
    return ShardHeader(header_bytes=header_bytes, metadata=metadata, tensors=tuple(tensors))


def _parse_tensor(name: str, entry: object, data_bytes: int, path: Path) -> TensorInfo:
    if not name:
        raise CheckpointError(f"{path} has a tensor with an empty name.")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(
            f"{path}: tensor {name!r} must be an object with exactly dtype, shape and data_offsets."
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}.")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has a shape that is not a list of non-negative integers.")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets that are not two integers.")
    start, end = offsets
    if not 0 <= start <= end <= data_bytes:
        raise CheckpointError(
            f"{path}: tensor {name!r} has data_offsets [{start}, {end}] outside the "
            f"{data_bytes}-byte data region."
        )
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if end - start != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {end - start} bytes but {dtype} × {shape} needs {expected}."
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), start=start, end=end)


def _check_layout(tensors: list[TensorInfo], data_bytes: int, path: Path) -> None:
    # Like the reference implementation: tensors tile the data region exactly, so no byte of the file can
    # hide outside every tensor (and outside every digest).
    position = 0
    previous: TensorInfo | None = None
    for tensor in sorted(tensors, key=lambda t: (t.start, t.end)):
        if tensor.start < position and previous is not None:
            raise CheckpointError(f"{path}: tensors {previous.name!r} and {tensor.name!r} overlap.")
        if tensor.start > position:
            raise CheckpointError(
                f"{path}: bytes {position}..{tensor.start} of the data region belong to no tensor."
            )
        position = tensor.end
        previous = tensor
    if position != data_bytes:
        raise CheckpointError(
            f"{path}: the data region holds {data_bytes} bytes but its tensors cover {position}."
        )


def read_header(fd: int, file_size: int, path: Path) -> ShardHeader:
    """Read and parse the header of an open file with two positioned reads."""
    length = header_length(os.pread(fd, PREFIX_BYTES, 0), file_size, path)
    raw = os.pread(fd, length, PREFIX_BYTES)
    if len(raw) != length:
        raise CheckpointError(f"{path} is truncated inside its header.")
    return parse_header(raw, file_size, path)
