"""What a manifest reply of 100k tensors costs to encode and decode: msgspec Structs against the hand-written codec.

A daemon answers `manifest` with one entry per tensor (large MoE checkpoints come near 100k); the client
decodes it whole before it can compare a single digest. This times, in one run, the message codec the
protocol uses now (`wcache.ipc.wire.messages`: one msgspec pass, every field checked) and, where the repository
has its history, the hand-written `Wire` codec it replaced, loaded with `git show` from the last revision that
had `core/wcache/ipc/codec.py` (msgpack to plain maps, then a checker per field), on the same data and a frame
body of the same fields.

Run::

    .venv/bin/python benchmarks/manifest_codec.py [--tensors 100000] [--repeat 5] [--old-ref REV]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
from wcache.checkpoint.manifest import TensorDigest
from wcache.ipc.wire.framing import HEADER, REPLY_LIMITS, Frame
from wcache.ipc.wire.messages import DaemonSummary, ManifestReply, encode, read_reply
from wcache.key.cache_key import WeightCacheKey
from wcache.plan.spec import PlanSpec

ROOT = Path(__file__).resolve().parents[1]
OLD_CODEC = "core/wcache/ipc/codec.py"


def manifest(count: int) -> ManifestReply:
    """A manifest of `count` tensors named and shaped like a MoE checkpoint's."""
    tensors = tuple(TensorDigest(f"model.layers.{i // 512}.mlp.experts.{i % 512}.down_proj.weight", "BF16",
                                 (2048, 768), 2048 * 768 * 2, f"{i:064x}") for i in range(count))
    key = WeightCacheKey(checkpoint="c" * 64, config="f" * 64, plan="p" * 64, format=2)
    summary = DaemonSummary(name="cpu-abc", key_id="abc", key=key, plan=PlanSpec(dtype="bfloat16"),
                            config={"model_type": "qwen3_moe"}, source="/models/big", device="cpu", state="ready",
                            released=None)
    return ManifestReply(tensors=tensors, daemon=summary)


def last_revision_with_old_codec() -> str:
    """The parent of the commit that deleted the hand-written codec (HEAD's history), or HEAD without one."""
    try:
        deleted = subprocess.run(["git", "log", "-1", "--format=%h", "--diff-filter=D", "--", OLD_CODEC], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "HEAD"
    return f"{deleted}^" if deleted else "HEAD"


def old_codec(ref: str) -> ModuleType | None:
    """The hand-written codec as it was at `ref`, loaded as a module of its own; None without the history."""
    try:
        source = subprocess.run(["git", "show", f"{ref}:{OLD_CODEC}"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    # The one module it imports that moved since: its error type is the framing's now.
    source = source.replace("from wcache.ipc.protocol import ProtocolError",
                            "from wcache.ipc.wire.framing import ProtocolError")
    path = Path(tempfile.mkdtemp(prefix="wcache-old-codec-")) / "old_codec.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_codec", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_codec"] = module  # dataclasses resolve their string annotations through it
    spec.loader.exec_module(module)
    return module


def old_types(codec: ModuleType) -> tuple[type, Callable[[ManifestReply], Any]]:
    """The manifest reply's classes as the old codec knew them (frozen dataclasses with `Wire`), and a converter
    from the new reply to the old one."""
    ns: dict[str, Any] = {"Wire": codec.Wire, "Any": Any}
    exec(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True, slots=True)\n"
        "class TensorDigest:\n name: str\n dtype: str\n shape: tuple[int, ...]\n nbytes: int\n digest: str\n"
        "@dataclass(frozen=True, slots=True)\n"
        "class WeightCacheKey:\n checkpoint: str\n config: str\n plan: str\n format: int\n"
        "@dataclass(frozen=True, slots=True)\n"
        "class PlanSpec:\n tp_size: int\n tp_rank: int\n dtype: str\n quantization: str\n"
        " quantization_config: dict[str, Any]\n layout: str\n"
        "@dataclass(frozen=True, slots=True)\n"
        "class DaemonSummary(Wire):\n name: str\n key_id: str\n key: WeightCacheKey\n plan: PlanSpec\n"
        " config: dict[str, Any] | None\n source: str\n device: str\n state: str\n released: str | None\n"
        "@dataclass(frozen=True, slots=True)\n"
        "class ManifestReply(Wire):\n tensors: tuple[TensorDigest, ...]\n daemon: DaemonSummary\n",
        ns)
    for name in ("TensorDigest", "WeightCacheKey", "PlanSpec", "DaemonSummary", "ManifestReply"):
        ns[name].__module__ = "old_codec"
        setattr(sys.modules["old_codec"], name, ns[name])

    def convert(reply: ManifestReply) -> Any:
        d = reply.daemon
        summary = ns["DaemonSummary"](d.name, d.key_id, ns["WeightCacheKey"](**d.key.to_json()),
                                      ns["PlanSpec"](**d.plan.to_json()), d.config, d.source, d.device, d.state,
                                      None)
        tensors = tuple(ns["TensorDigest"](t.name, t.dtype, t.shape, t.nbytes, t.digest) for t in reply.tensors)
        return ns["ManifestReply"](tensors, summary)

    return ns["ManifestReply"], convert


def best_of(repeat: int, work: Callable[[], Any]) -> tuple[float, float]:
    """Median and best wall time of `repeat` runs, in ms."""
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times), min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--old-ref", default=None,
                        help="git revision holding the hand-written codec (default: the last one that had it)")
    args = parser.parse_args()
    args.old_ref = args.old_ref or last_revision_with_old_codec()

    reply = manifest(args.tensors)
    frame = encode(reply, REPLY_LIMITS)
    body = frame[HEADER.size:]
    assert read_reply(Frame(body)) == reply
    rows = [("msgspec (now)", best_of(args.repeat, lambda: encode(reply, REPLY_LIMITS)),
             best_of(args.repeat, lambda: read_reply(Frame(body))), len(body))]

    codec = old_codec(args.old_ref)
    if codec is not None:
        old_reply_type, convert = old_types(codec)
        old = convert(reply)

        def old_encode() -> bytes:
            return bytes(msgpack.packb({"v": 1, "type": "manifest", **old.to_wire()}, use_bin_type=True))

        old_body = old_encode()

        def old_decode() -> Any:
            fields = msgpack.unpackb(old_body, raw=False, strict_map_key=True, max_array_len=4 * 1024 * 1024,
                                     max_map_len=1024 * 1024, max_str_len=1024 * 1024, max_bin_len=1024 * 1024,
                                     max_ext_len=0)
            del fields["v"], fields["type"]
            return old_reply_type.from_wire(fields)

        assert dataclasses.is_dataclass(old_decode())
        rows.append((f"hand-written codec ({args.old_ref})", best_of(args.repeat, old_encode),
                     best_of(args.repeat, old_decode), len(old_body)))

    print(f"manifest reply of {args.tensors:,} tensors, median of {args.repeat} (best in brackets)")
    print(f"{'codec':<32} {'encode':>22} {'decode':>22} {'body':>12}")
    for name, (enc, enc_best), (dec, dec_best), size in rows:
        print(f"{name:<32} {f'{enc:,.1f} ms ({enc_best:,.1f})':>22} {f'{dec:,.1f} ms ({dec_best:,.1f})':>22} "
              f"{size / 1e6:>9.1f} MB")
    if len(rows) == 2:
        (_, (new_enc, _), (new_dec, _), _), (_, (old_enc, _), (old_dec, _), _) = rows
        print(f"msgspec vs hand-written: encode {old_enc / new_enc:.1f}× faster, "
              f"decode {old_dec / new_dec:.1f}× faster")
    else:
        print(f"(no {OLD_CODEC} at {args.old_ref}: the hand-written codec was not timed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
