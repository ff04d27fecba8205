"""Reading a checkpoint once and running its plan: into a daemon's arena (read, hash and fill in one pass, with
each shard's SHA-256 from the same reads) or for an engine's disk load."""
