"""Short table cells that `status` and `top` share with the key renderings (`render`): a byte size, and a daemon's
provenance as one mark. Apart from `render` so that `status` imports none of the key renderings."""

from __future__ import annotations

# A daemon's files against what the Hub published, as one short cell (status and top).
PROVENANCE_MARK = {"matches": ("✓ hub", "green"), "differs": ("✗ DIFFERS", "bold red"), "unknown": ("?", "yellow")}


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
