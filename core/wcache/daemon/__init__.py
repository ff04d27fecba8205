"""Daemon processes: a rank server per device and TP rank, and the supervisor that starts and watches them."""
