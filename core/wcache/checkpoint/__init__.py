"""A checkpoint on disk: shards and index, safetensors headers, dtypes, config, the per-tensor manifest and its
Merkle root, and the MODEL argument."""
