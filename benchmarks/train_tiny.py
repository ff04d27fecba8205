"""Train the "tiny-trained" checkpoint (wcache_dev.trained) into a new directory and show what came out.

Prints the time training took, the BLAKE3 digest of every tensor, the checkpoint's content key (the
constant tests/test_trained_checkpoint.py commits), and greedy generations from phrases of the corpus.

Run::

    .venv/bin/python benchmarks/train_tiny.py /tmp/tiny-trained     # the directory must be new or empty
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from wcache.engine import Engine
from wcache.key.compute import compute_key
from wcache_dev.synth import read_tensors
from wcache_dev.trained import BASE_PRESET, STEPS, write_trained_checkpoint

PROMPTS = ("the daemon keeps", "the weights cache daemon", "a header only key")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="a new (or empty) directory to write the checkpoint to")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens to generate per prompt")
    args = parser.parse_args()

    wall, cpu = time.perf_counter(), time.process_time()
    write_trained_checkpoint(args.dest)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"trained the {BASE_PRESET!r} architecture for {STEPS} steps and wrote {args.dest}: "
          f"{wall:.2f} s wall, {cpu:.2f} s CPU (one thread)")

    key = compute_key(args.dest)
    width = max(len(e.name) for e in key.manifest)
    print(f"\n{len(key.manifest)} tensors, {key.total_bytes:,} bytes (BLAKE3 of each tensor's bytes):")
    for entry in key.manifest:
        print(f"  {entry.name:<{width}}  {entry.digest}")
    print(f"\ncheckpoint key (Merkle root): {key.key.checkpoint}")

    engine = Engine.from_weights(args.dest, read_tensors(args.dest))
    print("\ngreedy generations:")
    for prompt in PROMPTS:
        text, _ = engine.complete(prompt, args.new_tokens)
        print(f"  {prompt!r} -> {text!r}")


if __name__ == "__main__":
    main()
