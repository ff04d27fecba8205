"""Find a checkpoint's shards, its config and its index, and check that the index tells the truth."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import blake3

from wcache.canonical import NonFiniteNumberError, loads_finite
from wcache.checkpoint.companions import Companion, content_digests, find_companions
from wcache.checkpoint.file_record import FileDigest
from wcache.checkpoint.identity import FileIdentity
from wcache.checkpoint.safetensors_header import ShardHeader
from wcache.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """What a checkpoint path names: its shards, and the config and index read from its directory."""

    root: Path
    shards: tuple[Path, ...]
    config: dict[str, Any] | None
    weight_map: dict[str, str] | None  # tensor name → shard file name, from the index
    # BLAKE3 of the index file's bytes: a stored Merkle root is reused only under the very index it was checked
    # against (check_index), without checking 11,000 entries again. None without an index.
    index_digest: str | None = None
    # config.json and the index as they were read, each with the identity of the descriptor it was read through:
    # a key that then reads the shards checks that these paths still name those files (fingerprint), so that
    # its config and index are of the checkpoint it hashed.
    read_files: tuple[tuple[Path, FileIdentity], ...] = ()
    # config.json's size and digests, from the bytes read (provenance judges it as it judges a shard).
    config_file: FileDigest | None = None
    # The tokenizer's files and the generation config beside the tensors, as stat saw them (their digests are
    # the key's: `wcache.key.companion_digests`).
    companions: tuple[Companion, ...] = ()


# config.json and the index of an 11,000-tensor checkpoint are about a megabyte; anything far larger is not one.
MAX_JSON_BYTES = 64 << 20
# The most a FUSE client asks for in one READ (32 pages): one read() of a larger file is a chain of round trips,
# so an index larger than this (2,000 shards: 166 KB) is read in concurrent preads of this size instead.
ONE_REQUEST_BYTES = 128 << 10
MAX_READ_THREADS = 16


@dataclass(frozen=True, slots=True)
class _Read:
    """A small file's bytes and the identity of the descriptor they were read through."""

    path: Path
    data: bytes
    identity: FileIdentity


def read_small_file(path: Path, limit: int = MAX_JSON_BYTES, what: str = "a model's JSON") -> _Read | None:
    """A small regular file's bytes and identity (None where there is none); CheckpointError once it passes
    `limit`."""
    # os.open/os.read rather than Path.read_bytes: on a remote filesystem every extra ioctl (isatty) and lookup
    # is a round trip, and these two files are on the warm path. O_NONBLOCK and the S_ISREG check: a FIFO must
    # be refused, not waited on, and a device (/dev/zero) must not be read until memory runs out.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file.")
        chunks, size = [], 0
        # The first read asks for exactly the size fstat saw: a read that ends within the known size spares a
        # FUSE client the size refresh (a round trip) that a read past it costs. Reading still goes on to EOF.
        want = min(st.st_size, limit + 1) or 1 << 20
        if ONE_REQUEST_BYTES < st.st_size <= limit and (head := _read_concurrently(fd, st.st_size)):
            chunks, size, want = [head], len(head), 1 << 20
            os.lseek(fd, size, os.SEEK_SET)
        while chunk := os.read(fd, want):
            size += len(chunk)
            if size > limit:
                raise CheckpointError(f"{path} is over {_size(limit)}, too large for {what}.")
            chunks.append(chunk)
            want = 1 << 20
        return _Read(path, b"".join(chunks), FileIdentity.of(st))
    finally:
        os.close(fd)


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"


def _read_concurrently(fd: int, size: int) -> bytes | None:
    """The first `size` bytes of `fd` in concurrent preads of one request each; None if one comes back short
    (the file shrank: the caller reads it from the start)."""
    starts = range(0, size, ONE_REQUEST_BYTES)

    def part(at: int) -> bytes:
        return os.pread(fd, min(ONE_REQUEST_BYTES, size - at), at)

    with ThreadPoolExecutor(max_workers=min(MAX_READ_THREADS, len(starts)), thread_name_prefix="wcache-read") as pool:
        parts = list(pool.map(part, starts))
    if sum(map(len, parts)) != size:
        return None
    return b"".join(parts)


def _read_json(path: Path, what: str) -> tuple[Any, _Read | None]:
    read = _read_checked(path)
    return (None, None) if read is None else (_parse_json(path, what, read.data), read)


def _read_index(path: Path) -> tuple[Any, str | None, _Read | None]:
    """The parsed index and the BLAKE3 of its bytes; (None, None, None) where there is no index."""
    read = _read_checked(path)
    if read is None:
        return None, None, None
    return _parse_json(path, "shard index", read.data), blake3.blake3(read.data).hexdigest(), read


def _read_checked(path: Path) -> _Read | None:
    try:
        return read_small_file(path)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror}).") from None


def _parse_json(path: Path, what: str, text: bytes) -> Any:
    try:
        return loads_finite(text)
    except NonFiniteNumberError as exc:
        # Canonical JSON, and so the key, has no NaN or Infinity; a config holding one has no defined key.
        raise CheckpointError(f"{path} holds the number {exc}, which has no canonical form, so the {what} "
                              "cannot be keyed; write a finite number or null.") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}), so the {what} cannot be read.") from None


def locate(path: Path) -> CheckpointLayout:
    """Resolve a model directory or a single .safetensors file into a layout.

    Reads only config.json and the index, concurrently with the stat that tells a directory from a file,
    because on remote storage each is a chain of round trips; shard files are not touched here.
    """
    with ThreadPoolExecutor(max_workers=4) as pool:
        mode_future: Future[int] = pool.submit(_mode_of, path)
        companions_future: Future[tuple[Companion, ...]] = pool.submit(find_companions, path)
        # Read as if `path` were a directory; where it is not, these fail or find nothing and are dropped.
        config_future: Future[tuple[Any, _Read | None]] = pool.submit(_read_json, path / CONFIG_NAME,
                                                                      "model config")
        index_future: Future[tuple[Any, str | None, _Read | None]] = pool.submit(_read_index, path / INDEX_NAME)
        if stat.S_ISDIR(mode_future.result()):
            (config, config_read), (index, index_digest, index_read) = config_future.result(), index_future.result()
            layout = _directory_layout(path, config, index, index_digest)
            return replace(layout, read_files=_identities(config_read, index_read),
                           config_file=_config_file(config_read), companions=companions_future.result())
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path} is neither a model directory nor a .safetensors file.")
    # A single file takes the config of the directory it sits in, as vLLM does for a file path.
    config, config_read = _read_json(path.parent / CONFIG_NAME, "model config")
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"{path.parent / CONFIG_NAME} is not a JSON object.")
    return CheckpointLayout(root=path.parent, shards=(path,), config=config, weight_map=None,
                            read_files=_identities(config_read), config_file=_config_file(config_read),
                            companions=find_companions(path.parent))


def _config_file(read: _Read | None) -> FileDigest | None:
    if read is None:
        return None
    digests = content_digests(read.data)
    return FileDigest(CONFIG_NAME, len(read.data), digests.sha256, digests.git_sha1)


def _identities(*reads: _Read | None) -> tuple[tuple[Path, FileIdentity], ...]:
    return tuple((read.path, read.identity) for read in reads if read is not None)


def why_missing(path: Path) -> str:
    """What to say of a path whose open or stat found nothing: "does not exist", unless it is a dangling symlink,
    which exists (and is what the user has to mend)."""
    try:
        target = path.readlink()
    except OSError:
        return "does not exist"
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"is a symlink to {target}, which loops back on itself"
    if (target if target.is_absolute() else path.parent / target).is_symlink():
        return f"is a symlink to {target}, which leads to no file"  # a chain: its last link dangles
    return f"is a symlink to {target}, which does not exist"


def _mode_of(path: Path) -> int:
    try:
        return path.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path} {why_missing(path)}.") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror}).") from None


def _directory_layout(path: Path, config: Any, index: Any, index_digest: str | None) -> CheckpointLayout:
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"{path / CONFIG_NAME} is not a JSON object.")
    if index is None:
        return CheckpointLayout(root=path, shards=_unindexed_shards(path), config=config, weight_map=None)
    weight_map = _parse_index(index, path / INDEX_NAME)
    shard_names = sorted(set(weight_map.values()))
    return CheckpointLayout(
        root=path, shards=tuple(path / name for name in shard_names), config=config, weight_map=weight_map,
        index_digest=index_digest,
    )


def _unindexed_shards(path: Path) -> tuple[Path, ...]:
    single = path / SINGLE_NAME
    if single.exists() or single.is_symlink():
        # The shard's stat happens later with all the others; an unreadable file is reported there.
        return (single,)
    # No index and no model.safetensors: every *.safetensors in the directory, as vLLM globs them; its glob skips
    # dotfiles, and so do we (macOS leaves `._model-00001-of-00002.safetensors` beside every copied shard).
    try:
        names = sorted(entry.name for entry in os.scandir(path)
                       if entry.name.endswith(".safetensors") and not entry.name.startswith("."))
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be listed ({exc.strerror}).") from None
    if names:
        return tuple(path / name for name in names)
    if any(path.glob("*.bin")) or (path / "pytorch_model.bin.index.json").exists():
        raise CheckpointError(
            f"{path} holds only PyTorch .bin weights; wcache reads safetensors, so convert them first "
            "(for example with transformers: model.save_pretrained(dir, safe_serialization=True))."
        )
    raise CheckpointError(f"{path} holds no .safetensors file (neither {SINGLE_NAME} nor an index).")


def _parse_index(index: Any, index_path: Path) -> dict[str, str]:
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{index_path} has no weight_map object.")
    weight_map = index["weight_map"]
    if not weight_map:
        raise CheckpointError(f"{index_path} lists no tensors.")
    checked: set[str] = set()  # thousands of tensors name a few shards: each name is checked once
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or "\x00" in shard:
            raise CheckpointError(f"{index_path} maps tensor {tensor!r} to something that is not a file name.")
        if shard in checked:
            continue
        checked.add(shard)
        pure = PurePosixPath(shard)
        # A shard name that escapes the model directory would let an index point at any file on the machine.
        if pure.is_absolute() or ".." in pure.parts or len(pure.parts) != 1:
            raise CheckpointError(f"{index_path} names shard {shard!r}, which is not a file in the model directory.")
    return dict(weight_map)


def check_index(layout: CheckpointLayout, headers: Mapping[Path, ShardHeader], index_path: Path) -> None:
    """Every index entry points at a tensor its shard holds, and every shard tensor is in the index."""
    seen: dict[str, Path] = {}
    for shard, header in headers.items():
        for tensor in header.tensors:
            if tensor.name in seen:
                raise CheckpointError(
                    f"tensor {tensor.name!r} is stored twice, in {seen[tensor.name]} and in {shard}."
                )
            seen[tensor.name] = shard
    if layout.weight_map is None:
        return
    for tensor_name, shard_name in layout.weight_map.items():
        holder = seen.get(tensor_name)
        if holder is None:
            raise CheckpointError(
                f"{index_path} lists tensor {tensor_name!r} in {shard_name}, but no shard holds it."
            )
        if holder.name != shard_name:
            raise CheckpointError(
                f"{index_path} lists tensor {tensor_name!r} in {shard_name}, but it is in {holder.name}."
            )
    for tensor_name, holder in seen.items():
        if tensor_name not in layout.weight_map:
            raise CheckpointError(f"{holder} holds tensor {tensor_name!r}, which {index_path} does not list.")
