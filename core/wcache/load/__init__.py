"""Reading a checkpoint once and running its plan: into a daemon's arena (read, hash and fill in one pass)
or for an engine's disk load."""
