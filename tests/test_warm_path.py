"""A warm key opens no shard (not even its header); a cold key opens each shard exactly once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import run_python, wait_past_racy_window

PROBE = """
import json, sys
from collections import Counter
from pathlib import Path
from wcache.key.digest_store import DigestStore
from wcache.key.compute import compute_key

checkpoint = Path({checkpoint!r})
opened = Counter()

def audit(event, args):
    if event == "open" and args[0] is not None:
        opened[Path(str(args[0])).name] += 1
    elif event == "mmap.__new__":
        opened["<mmap>"] += 1

store = DigestStore.open()
sys.addaudithook(audit)
cold = compute_key(checkpoint, store=store, rehash=True)
cold_opens = dict(opened)
opened.clear()
warm = compute_key(checkpoint, store=store)
print(json.dumps({{
    "cold": cold_opens, "warm": dict(opened), "same": cold.key == warm.key,
    "warm_from_store": warm.stats.shards_from_store, "num_shards": warm.stats.num_shards,
}}))
"""


def test_warm_key_reads_no_shard_and_cold_key_reads_each_once(tiny_template: Path, tmp_path: Path) -> None:
    checkpoint = Path(shutil.copytree(tiny_template, tmp_path / "tiny"))
    shards = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    wait_past_racy_window()
    result = run_python(PROBE.format(checkpoint=str(checkpoint)))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["same"]
    assert report["warm_from_store"] == report["num_shards"] == len(shards)
    assert {name: report["cold"].get(name) for name in shards} == dict.fromkeys(shards, 1)
    # Warm: only config.json and the index are read; no shard is opened or mapped.
    assert set(report["warm"]) <= {"config.json", "model.safetensors.index.json"}, report["warm"]


def test_an_index_larger_than_one_read_request_is_read_whole(tiny_template: Path, tmp_path: Path) -> None:
    # Past one FUSE request (128 KiB) the index is read in concurrent pieces; they must join to the file.
    from wcache.checkpoint.files import ONE_REQUEST_BYTES, locate
    from wcache.key.compute import compute_key

    checkpoint = Path(shutil.copytree(tiny_template, tmp_path / "tiny"))
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"] = {**index.get("metadata", {}), "padding": "".join(f"{i:07d}," for i in range(50_000))}
    index_path.write_text(json.dumps(index))
    assert index_path.stat().st_size > 3 * ONE_REQUEST_BYTES
    layout = locate(checkpoint)
    assert layout.weight_map == index["weight_map"]
    assert compute_key(checkpoint).key == compute_key(tiny_template).key
