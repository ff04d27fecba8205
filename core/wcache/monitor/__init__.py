"""Monitoring: what `wcache top` shows, collected from the run dir, daemons, events and engine metrics."""
