"""Which columns of a table fit a terminal's width: whole columns are dropped, lowest priority first, never cut.

A cell cut to `dev…` or a key id cut to `66e…` cannot be typed back into a command, and a number wrapped over two
lines reads as two rows; a missing column only hides what the wider screen or --json still shows.
"""

from __future__ import annotations

from collections.abc import Sequence

# Rich's default table: one cell of padding on each side and one border per column, plus the closing border.
RICH_PER_COLUMN = 3
RICH_FIXED = 1


def visible_columns(widths: Sequence[int], drops: Sequence[int], width: int, *, per_column: int = RICH_PER_COLUMN,
                    fixed: int = RICH_FIXED) -> list[int]:
    """Indices of the columns to show, in order: all of them when their widths fit, else without the columns of
    highest `drops` (0: never dropped; the rightmost first among equals) until the rest fit or only those are
    left."""
    shown = list(range(len(widths)))

    def total() -> int:
        return fixed + sum(widths[i] + per_column for i in shown)

    while total() > width:
        droppable = [i for i in shown if drops[i] > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (drops[i], i)))
    return shown
