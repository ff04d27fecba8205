"""Every malformed checkpoint, index, config or key file is one CheckpointError naming the file, and exit 2.

Each case builds a real file on disk (crafted with struct + json, or a real tiny checkpoint bent out of
shape), then checks both sides: the library raises a typed error whose message names the offending file,
and `wcache` exits 2 with exactly one "error:" sentence on stderr and no traceback. The CLI side runs through
`wcache`'s entry point in this interpreter (tests/helpers.py), except where the process is the subject: a read
that must not hang (ended by a timeout), uid 65534, and a daemon started along the way.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from as_nobody import nobody_tree, open_to_all, run_as_nobody
from helpers import WCACHE, assert_one_error_sentence, cli_env, edited_index, wcache_in_process, wcache_process
from wcache.checkpoint.safetensors_header import MAX_HEADER_BYTES
from wcache.errors import BadInputError, CheckpointError, KeyFileError
from wcache.key.cache_key import load_key_file
from wcache.key.compute import compute_key
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import write_checkpoint

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
# Deep enough to overflow any recursive JSON decoder; a strict parser must still answer with one sentence.
DEEP_JSON = "[" * 100_000
FIFO_DEADLINE_S = 5


# -- helpers ------------------------------------------------------------------------------------------


def safetensors_bytes(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte little-endian header length, the header, then the data region.

    `header` may be a dict (encoded as JSON), a str (encoded as UTF-8) or raw bytes.
    """
    if isinstance(header, bytes):
        raw = header
    elif isinstance(header, str):
        raw = header.encode()
    else:
        raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def f32(shape: list[object], start: int, end: int, dtype: str = "F32") -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


# Two well-formed tensors tiling a 24-byte data region; cases start here and break one thing.
GOOD_HEADER: dict[str, object] = {
    "__metadata__": {"format": "pt"},
    "a": f32([2, 2], 0, 16),
    "b": f32([4], 16, 24, dtype="F16"),
}
GOOD_DATA = bytes(range(24))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-shard tiny checkpoint (config, index, shards); cases copy it before breaking it."""
    return write_checkpoint("tiny", tmp_path_factory.mktemp("bad-input") / "tiny")


@pytest.fixture(scope="module")
def single_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real one-file tiny checkpoint (config + model.safetensors)."""
    return write_checkpoint("tiny", tmp_path_factory.mktemp("bad-input-single") / "tiny", num_shards=1)




def _write_index(checkpoint: Path, index: object) -> None:
    (checkpoint / INDEX).write_text(json.dumps(index))


# -- cases: each builds a bad checkpoint under `root` and returns (path to pass, names the error must show)

Case = Callable[[Path, Path, Path], tuple[Path, tuple[str, ...]]]


def _file(name: str, content: bytes) -> Case:
    def build(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
        path = root / name
        path.write_bytes(content)
        return path, (name,)

    return build


def _over_cap(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    # A sparse file big enough to "hold" the claimed header, so only the cap (not the size check) refuses it.
    path = root / "huge-header.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{")
        f.truncate(MAX_HEADER_BYTES + 64)
    return path, (path.name,)


def _truncated_data(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = Path(shutil.copytree(single, root / "ckpt"))
    shard = checkpoint / "model.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    return checkpoint, ("model.safetensors",)


def _tiny_copy(root: Path, template: Path) -> Path:
    return Path(shutil.copytree(template, root / "ckpt"))


def _index_without_weight_map(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    _write_index(checkpoint, {"metadata": {"total_size": 1}})
    return checkpoint, (INDEX,)


def _index_missing_shard(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    (checkpoint / SHARD2).unlink()
    return checkpoint, (SHARD2,)


def _index_ghost_tensor(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    with edited_index(checkpoint) as index:
        index["weight_map"]["model.ghost.weight"] = SHARD1
    return checkpoint, (INDEX, "model.ghost.weight")


def _index_wrong_shard(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    with edited_index(checkpoint) as index:
        weight_map = index["weight_map"]
        assert weight_map["model.embed_tokens.weight"] == SHARD1
        weight_map["model.embed_tokens.weight"] = SHARD2
    return checkpoint, (INDEX, "model.embed_tokens.weight")


def _index_missing_entry(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    with edited_index(checkpoint) as index:
        assert index["weight_map"].pop("model.norm.weight") == SHARD2
    return checkpoint, (SHARD2, "model.norm.weight")


def _same_tensor_twice(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = root / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "one.safetensors").write_bytes(safetensors_bytes({"x": f32([2], 0, 8)}, bytes(8)))
    two = {"x": f32([2], 0, 8), "y": f32([2], 8, 16)}
    (checkpoint / "two.safetensors").write_bytes(safetensors_bytes(two, bytes(16)))
    _write_index(checkpoint, {"weight_map": {"x": "one.safetensors", "y": "two.safetensors"}})
    return checkpoint, ("one.safetensors", "two.safetensors", "'x'")


def _index_traversal(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    # A real shard sits right where "../" points, so only the name check can refuse it.
    shutil.copy(checkpoint / SHARD1, root / SHARD1)
    with edited_index(checkpoint) as index:
        weight_map = index["weight_map"]
        for name, shard in weight_map.items():
            if shard == SHARD1:
                weight_map[name] = f"../{SHARD1}"
    return checkpoint, (INDEX,)


def _empty_directory(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = root / "no-weights-here"
    checkpoint.mkdir()
    shutil.copy(template / "config.json", checkpoint / "config.json")
    return checkpoint, (checkpoint.name,)


def _nonexistent(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    return root / "does-not-exist", ("does-not-exist",)


def _not_a_checkpoint(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    path = root / "notes.txt"
    path.write_text("these are not weights\n")
    return path, (path.name,)


def _config_not_json(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    (checkpoint / "config.json").write_text('{"hidden_size": 64,')
    return checkpoint, ("config.json",)


def _config_deeply_nested(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    (checkpoint / "config.json").write_text(DEEP_JSON)
    return checkpoint, ("config.json",)


def _index_deeply_nested(root: Path, template: Path, single: Path) -> tuple[Path, tuple[str, ...]]:
    checkpoint = _tiny_copy(root, template)
    (checkpoint / INDEX).write_text(DEEP_JSON)
    return checkpoint, (INDEX,)


def _with(header: dict[str, object], data: bytes = GOOD_DATA, name: str = "bad.safetensors") -> Case:
    return _file(name, safetensors_bytes(header, data))


def _changed(**entries: object) -> dict[str, object]:
    return {**GOOD_HEADER, **entries}


CASES: dict[str, Case] = {
    "shorter-than-8-bytes": _file("short.safetensors", b"\x10\x00\x00"),
    "empty-file": _file("empty.safetensors", b""),
    "header-longer-than-file": _file("long.safetensors", safetensors_bytes(b'{"a": 1}', length=1000)),
    "header-above-100MB-cap": _over_cap,
    "header-length-below-2": _file("tiny-header.safetensors", safetensors_bytes(b"{", length=1)),
    "header-not-utf8": _file("latin1.safetensors", safetensors_bytes(b'{"caf\xe9": 1}')),
    "header-not-json": _file("notjson.safetensors", safetensors_bytes(b'{"a": {"dtype": ')),
    "header-deeply-nested-json": _file("deep.safetensors", safetensors_bytes(DEEP_JSON)),
    "header-json-list": _file("list.safetensors", safetensors_bytes([1, 2])),
    "header-json-string": _file("string.safetensors", safetensors_bytes('"hello"')),
    "duplicate-tensor-keys": _file(
        "dup.safetensors",
        safetensors_bytes(
            '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
            ' "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
            bytes(16),
        ),
    ),
    "unknown-dtype": _with(_changed(a=f32([2, 2], 0, 16, dtype="F4"))),
    "dtype-not-a-string": _with(_changed(a={"dtype": 4, "shape": [2, 2], "data_offsets": [0, 16]})),
    "shape-with-float": _with(_changed(a=f32([2.0, 2], 0, 16))),
    "shape-with-negative": _with(_changed(a=f32([-2, -2], 0, 16))),  # (-2)·(-2)·4 = 16 bytes: sizes agree
    "shape-with-bool": _with(_changed(a=f32([True, 4], 0, 16))),  # true·4·4 = 16 bytes: sizes agree
    "shape-not-a-list": _with(_changed(a={"dtype": "F32", "shape": 4, "data_offsets": [0, 16]})),
    "offsets-one-int": _with(_changed(a={"dtype": "F32", "shape": [2, 2], "data_offsets": [16]})),
    "offsets-three-ints": _with(_changed(a={"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8, 16]})),
    "offsets-with-float": _with(_changed(a={"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16.0]})),
    "offsets-a-string": _with(_changed(a={"dtype": "F32", "shape": [2, 2], "data_offsets": "0:16"})),
    "offsets-beyond-data-region": _with({"a": f32([8], 0, 32)}, bytes(16)),
    "offsets-reversed": _with({"a": f32([0], 8, 0), "b": f32([2], 0, 8)}, bytes(8)),
    "offsets-inconsistent-with-shape": _with({"a": f32([2, 2], 0, 12)}, bytes(12)),
    "overlapping-tensors": _with({"a": f32([2, 2], 0, 16), "b": f32([4], 8, 24)}, bytes(24)),
    "gap-between-tensors": _with({"a": f32([2, 2], 0, 16), "b": f32([4], 20, 36)}, bytes(36)),
    "trailing-bytes": _with(GOOD_HEADER, GOOD_DATA + b"hide"),
    "metadata-non-string-value": _with(_changed(__metadata__={"format": "pt", "total": 24})),
    "metadata-not-a-map": _with(_changed(__metadata__=["format", "pt"])),
    "tensor-extra-key": _with(_changed(a={**f32([2, 2], 0, 16), "crc": 0})),
    "tensor-missing-key": _with(_changed(a={"dtype": "F32", "shape": [2, 2]})),
    "tensor-entry-not-object": _with(_changed(a=[0, 16])),
    "truncated-data-region": _truncated_data,
    "index-without-weight-map": _index_without_weight_map,
    "index-names-missing-shard": _index_missing_shard,
    "index-names-tensor-no-shard-holds": _index_ghost_tensor,
    "index-maps-tensor-to-wrong-shard": _index_wrong_shard,
    "shard-holds-tensor-index-omits": _index_missing_entry,
    "same-tensor-in-two-shards": _same_tensor_twice,
    "index-shard-path-traversal": _index_traversal,
    "index-deeply-nested-json": _index_deeply_nested,
    "directory-without-weights": _empty_directory,
    "nonexistent-path": _nonexistent,
    "regular-file-not-safetensors": _not_a_checkpoint,
    "config-not-json": _config_not_json,
    "config-deeply-nested-json": _config_deeply_nested,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_is_one_error_naming_the_file(
    case: str, tmp_path: Path, template: Path, single_template: Path
) -> None:
    root = tmp_path / "input"
    root.mkdir()
    path, names = CASES[case](root, template, single_template)

    with pytest.raises(CheckpointError) as caught:
        compute_key(path)
    message = str(caught.value)
    for name in names:
        assert name in message, (name, message)
    assert "\n" not in message

    assert_one_error_sentence(wcache_in_process("key", str(path), env=cli_env(tmp_path / "cache")), *names)


def test_the_good_header_the_cases_start_from_is_accepted(tmp_path: Path) -> None:
    # Guards the cases above: each must fail for its own reason, not because the base was already bad.
    path = tmp_path / "good.safetensors"
    path.write_bytes(safetensors_bytes(GOOD_HEADER, GOOD_DATA))
    assert len(compute_key(path).manifest) == 2
    result = wcache_in_process("key", str(path), "--json", env=cli_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["info"]["num_tensors"] == 2


# -- running as uid 65534 when the tests run as root -----------------------------------------------------

# Root reads a file whatever its mode, so as root the unreadable-file case runs its processes as "nobody"
# (tests/as_nobody.py).
# The library side, run as nobody: which error compute_key raised, and its message.
LIBRARY_AS_NOBODY = """
import json, sys
from pathlib import Path
from wcache.errors import CheckpointError
from wcache.key.compute import compute_key
try:
    compute_key(Path(sys.argv[1]))
except CheckpointError as exc:
    print(json.dumps({"raised": "CheckpointError", "message": str(exc)}))
else:
    print(json.dumps({"raised": None}))
"""


def _unreadable_shard_as_nobody(template: Path) -> None:
    with nobody_tree() as (base, env):
        checkpoint = Path(shutil.copytree(template, base / "ckpt"))
        open_to_all(checkpoint)
        cli = [*WCACHE, "key", str(checkpoint)]
        # Guard: nobody can key the checkpoint while the shard is readable, so the error below is the mode's.
        readable = run_as_nobody(cli, env, cwd=base)
        assert readable.returncode == 0, readable.stdout + readable.stderr
        (checkpoint / SHARD2).chmod(0)

        library = run_as_nobody([sys.executable, "-c", LIBRARY_AS_NOBODY, str(checkpoint)], env, cwd=base)
        assert library.returncode == 0, library.stdout + library.stderr
        outcome = json.loads(library.stdout)
        assert outcome["raised"] == "CheckpointError", outcome
        assert SHARD2 in outcome["message"], outcome
        assert "\n" not in outcome["message"], outcome

        assert_one_error_sentence(run_as_nobody(cli, env, cwd=base), SHARD2)


def test_unreadable_shard_is_one_error_naming_it(tmp_path: Path, template: Path) -> None:
    if os.geteuid() == 0:
        _unreadable_shard_as_nobody(template)
        return
    checkpoint = Path(shutil.copytree(template, tmp_path / "ckpt"))
    shard = checkpoint / SHARD2
    shard.chmod(0)
    try:
        with pytest.raises(CheckpointError, match=SHARD2):
            compute_key(checkpoint)
        assert_one_error_sentence(wcache_process("key", str(checkpoint), env=cli_env(tmp_path / "cache")), SHARD2)
    finally:
        shard.chmod(0o600)


def test_fifo_shard_is_refused_not_waited_on(tmp_path: Path) -> None:
    # Opening a FIFO for reading blocks until a writer appears; a checkpoint must never hang `wcache key`.
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    fifo = checkpoint / "model.safetensors"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def library() -> None:
        try:
            compute_key(checkpoint)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)
        else:
            outcome.append(None)

    worker = threading.Thread(target=library, daemon=True)
    worker.start()
    worker.join(FIFO_DEADLINE_S)
    hung = worker.is_alive()
    if hung:  # release the blocked open() so the thread ends, then report the hang
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(FIFO_DEADLINE_S)
    assert not hung, f"compute_key blocked for {FIFO_DEADLINE_S} s opening the FIFO {fifo}"
    assert isinstance(outcome[0], CheckpointError), outcome
    assert "model.safetensors" in str(outcome[0])

    try:
        result = wcache_process("key", str(checkpoint), env=cli_env(tmp_path / "cache"), timeout=FIFO_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`wcache key` blocked for {FIFO_DEADLINE_S} s opening the FIFO {fifo}")
    assert_one_error_sentence(result, "model.safetensors")


# -- wcache diff with bad key files ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_key(template: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    cache = tmp_path_factory.mktemp("saved-key-cache")
    result = wcache_in_process("key", str(template), "--json", env=cli_env(cache))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _edited_digest(document: dict[str, object]) -> str:
    tensors: list[dict[str, object]] = document["tensors"]  # type: ignore[assignment]
    tensors[0]["digest"] = "0" * 64
    return json.dumps(document)


def _dropped_tensor(document: dict[str, object]) -> str:
    tensors: list[dict[str, object]] = document["tensors"]  # type: ignore[assignment]
    del tensors[-1]
    return json.dumps(document)


def _infinite_shape(document: dict[str, object]) -> str:
    tensors: list[dict[str, object]] = document["tensors"]  # type: ignore[assignment]
    tensors[0]["shape"] = [float("inf")]
    return json.dumps(document)  # Python writes Infinity, which json.loads reads back as a float


def _size_a_bool(document: dict[str, object]) -> str:
    tensors: list[dict[str, object]] = document["tensors"]  # type: ignore[assignment]
    tensors[0]["nbytes"] = True
    return json.dumps(document)


def _sha256_not_hex(document: dict[str, object]) -> str:
    files: list[dict[str, object]] = document["files"]  # type: ignore[assignment]
    files[0]["sha256"] = "Z" * 64
    return json.dumps(document)


KEY_FILE_CASES: dict[str, Callable[[dict[str, object]], str]] = {
    "not-json": lambda _: "this is not { a key file\n",
    "json-list": lambda _: "[1, 2, 3]\n",
    "deeply-nested-json": lambda _: DEEP_JSON,
    "tensor-digest-hand-edited": _edited_digest,
    "tensor-removed-by-hand": _dropped_tensor,
    "tensor-shape-infinite": _infinite_shape,
    "tensor-size-a-bool": _size_a_bool,
    "file-sha256-not-hex": _sha256_not_hex,
    "an-unknown-field": lambda document: json.dumps({**document, "tensor_count": 3}),
}


@pytest.mark.parametrize("case", list(KEY_FILE_CASES))
def test_diff_with_a_bad_key_file_is_one_error_naming_it(
    case: str, tmp_path: Path, template: Path, saved_key: dict[str, object]
) -> None:
    key_path = tmp_path / "model.key"
    key_path.write_text(KEY_FILE_CASES[case](json.loads(json.dumps(saved_key))))

    with pytest.raises(KeyFileError) as caught:
        load_key_file(key_path)
    assert key_path.name in str(caught.value)

    result = wcache_in_process("diff", str(key_path), str(template), env=cli_env(tmp_path / "cache"))
    assert_one_error_sentence(result, key_path.name)


def test_diff_accepts_the_unedited_key_file(tmp_path: Path, template: Path, saved_key: dict[str, object]) -> None:
    # The control for the cases above: the same document, untouched, is a valid key equal to the checkpoint's.
    key_path = tmp_path / "model.key"
    key_path.write_text(json.dumps(saved_key))
    result = wcache_in_process("diff", str(key_path), str(template), env=cli_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stdout + result.stderr


# -- options --------------------------------------------------------------------------------------------


def test_rank_outside_tp_is_one_error_naming_the_option(tmp_path: Path, template: Path) -> None:
    # Python callers read the option by its API name; the command line names the flag.
    with pytest.raises(BadInputError, match=r"^tp_rank must be between 0 and 1 for tp_size=2\."):
        PlanSpec(tp_size=2, tp_rank=2)
    result = wcache_in_process("key", str(template), "--tp", "2", "--rank", "2", env=cli_env(tmp_path / "cache"))
    assert_one_error_sentence(result, "--rank")


@pytest.mark.parametrize(("name", "kind"), [
    ("config.json", "fifo"), ("model.safetensors.index.json", "fifo"), ("config.json", "/dev/zero"),
    ("model.safetensors.index.json", "/dev/zero"),
])
def test_json_file_that_is_not_a_regular_file_is_refused(tmp_path: Path, name: str, kind: str) -> None:
    # A FIFO would block the read forever; /dev/zero would be read until memory runs out.
    checkpoint = write_checkpoint("tiny", tmp_path / "ckpt")
    target = checkpoint / name
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(kind)
    try:
        result = wcache_process("key", str(checkpoint), env=cli_env(tmp_path / "cache"), timeout=FIFO_DEADLINE_S * 4)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`wcache key` blocked on {name} as {kind}")
    assert_one_error_sentence(result, name)
    assert "is not a regular file" in result.stderr


_GOOD_DESCRIPTOR = {
    "name": "cpu-aaaaaaaaaaaa", "pid": 999_999_999, "pid_created": 1.0, "device": "cpu", "tp_size": 1,
    "tp_rank": 0, "key_id": "aaaaaaaaaaaa",
    "key": {"checkpoint": "a", "config": "b", "tokenizer": "t", "plan": "c", "format": 1},
    "plan": {}, "config": None, "source": "/nowhere", "socket": "/nowhere.sock", "health_url": None,
    "supervisor_pid": None, "started": "2026-12-01T00:00:00Z", "weights_bytes": 0,
}


@pytest.mark.parametrize("bad", [
    "not json", "[1, 2]", json.dumps({**_GOOD_DESCRIPTOR, "pid": "123"}), json.dumps({**_GOOD_DESCRIPTOR, "pid": -1}),
    json.dumps({**_GOOD_DESCRIPTOR, "key": [1, 2]}), json.dumps({**_GOOD_DESCRIPTOR, "name": 7}),
    json.dumps({**_GOOD_DESCRIPTOR, "pid": True}),
    json.dumps({k: v for k, v in _GOOD_DESCRIPTOR.items() if k != "key"}),
], ids=["text", "list", "pid-string", "pid-negative", "key-list", "name-int", "pid-bool", "key-missing"])
def test_foreign_descriptor_is_skipped_with_a_warning(bad: str, tmp_path: Path, template: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "cpu-bad.json").write_text(bad)
    env = cli_env(tmp_path / "cache")
    status = wcache_in_process("status", "--json", "--run-dir", str(run_dir), env=env)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert "Ignoring unreadable daemon descriptor" in status.stderr and json.loads(status.stdout) is not None
    stop = wcache_in_process("stop", "--all", "--run-dir", str(run_dir), env=env)
    assert stop.returncode == 0 and "Traceback" not in stop.stderr, stop.stderr
    attach = wcache_in_process("attach", str(template), "--json", "--run-dir", str(run_dir), env=env)
    assert attach.returncode == 0 and json.loads(attach.stdout)["outcome"] == "fallback", attach.stderr


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_event_log_that_is_not_a_file_never_hangs(kind: str, tmp_path: Path, template: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    log = run_dir / "events.jsonl"
    if kind == "fifo":
        os.mkfifo(log)
    else:
        log.mkdir()
    try:
        attach = wcache_process("attach", str(template), "--json", "--run-dir", str(run_dir),
                                env=cli_env(tmp_path / "cache"), timeout=FIFO_DEADLINE_S * 6)
        top = wcache_process("top", "--once", "--json", "--interval", "0.1", "--run-dir", str(run_dir),
                             env=cli_env(tmp_path / "cache"), timeout=FIFO_DEADLINE_S * 6)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a command blocked on events.jsonl as a {kind}")
    assert attach.returncode == 0 and json.loads(attach.stdout)["outcome"] == "fallback", attach.stderr
    assert "Traceback" not in attach.stderr + top.stderr and top.returncode == 0, top.stderr


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_config_with_a_non_finite_number_is_one_sentence(number: str, tmp_path: Path, template: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(template, checkpoint)
    config = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(config.replace('"rms_norm_eps": 1e-06', f'"rms_norm_eps": {number}'))
    assert number in (checkpoint / "config.json").read_text()
    result = wcache_in_process("key", str(checkpoint), env=cli_env(tmp_path / "cache"))
    line = assert_one_error_sentence(result, "config.json")
    assert "no canonical form" in line


def test_index_shard_name_with_a_nul_byte_is_one_sentence(tmp_path: Path, template: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(template, checkpoint)
    index_path = checkpoint / INDEX
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model\u0000.safetensors"
    index_path.write_text(json.dumps(index))
    assert_one_error_sentence(wcache_in_process("key", str(checkpoint), env=cli_env(tmp_path / "cache")), INDEX)


def test_paths_with_terminal_escapes_are_shown_escaped(tmp_path: Path, template: Path) -> None:
    # A directory name can carry an escape sequence (colours, a window title, an OSC 8 link); printed raw, it
    # would act on the user's terminal instead of being read.
    hostile = tmp_path / "ti\x1b]0;owned\x07ny"
    shutil.copytree(template, hostile)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = cli_env(tmp_path / "cache")
    try:
        results = [
            wcache_in_process("key", str(hostile), env=env),
            wcache_in_process("key", str(hostile) + "-missing", env=env),
            wcache_process("preload", str(hostile), "--detach", "--run-dir", str(run_dir), env=env),  # a daemon
            wcache_in_process("status", "--run-dir", str(run_dir), env=env),
        ]
    finally:
        wcache_process("stop", "--all", "--force", "--run-dir", str(run_dir), env=env)
    assert [r.returncode for r in results] == [0, 2, 0, 0], [r.stderr for r in results]
    for result in results:
        assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout + result.stderr
    assert "ti\\x1b]0;owned\\x07ny" in results[0].stdout and "\\x1b" in results[1].stderr
    assert "\\x1b" in results[2].stdout and "\\x1b" in results[3].stdout
