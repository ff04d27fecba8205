"""The shared-memory arena: made, filled and sealed by a daemon (`daemon_side`, torch-free for a CPU arena), and
an engine's map and tensor views of it (`engine_side`, which imports nothing of the daemon's side)."""
