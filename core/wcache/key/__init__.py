"""The content key: shard hashing (each file's SHA-256 from the same reads), the digest store, fingerprints,
key files, key diffs, and the provenance rule preload applies."""
