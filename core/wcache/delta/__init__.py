"""Weight versions: sparse deltas between checkpoints, and the next daemon built from the one holding the parent."""
