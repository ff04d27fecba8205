"""The content key: shard hashing, the digest store, fingerprints, key files, key diffs and daemons' keys."""
