"""Completion candidates that only exist at run time: the ids of the daemons in the run dir.

Typer calls these from `wcache` itself while a shell completes a word (`_WCACHE_COMPLETE`, see
`wcache completion`). Whatever goes wrong (no run dir, a run dir that is not ours, a torn descriptor), the
answer is no candidates: a completion must never print, raise or wait, and nothing here removes stale files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer


def _live_daemons(ctx: typer.Context) -> list[tuple[str, str, str]]:
    """(name, key id, description) of every live daemon in the run dir the command line names, else the default."""
    from wcache.ipc.run_dir.directory import (  # psutil: paid at completion time only, never by `--help`
        census,
        default_run_dir,
    )

    logger = logging.getLogger("wcache")
    was_disabled, logger.disabled = logger.disabled, True  # an unreadable descriptor is warned about otherwise
    try:
        run_dir = ctx.params.get("run_dir")
        where = Path(run_dir) if run_dir else default_run_dir()
        live = census(where, clean=False).live if where.is_dir() else ()
        return [(d.name, d.key_id, f"{Path(d.source).name} on {d.device}") for d in live]
    except Exception:  # a completion that fails offers nothing rather than a traceback in the user's prompt
        return []
    finally:
        logger.disabled = was_disabled


def daemon_ids(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Names of live daemons starting with `incomplete`, or their key ids when that is what is being typed."""
    candidates = []
    for name, key_id, description in _live_daemons(ctx):
        if name.startswith(incomplete):
            candidates.append((name, description))
        elif key_id.startswith(incomplete):
            candidates.append((key_id, description))
    return candidates


def _names_a_path(incomplete: str) -> bool:
    """Whether `incomplete` is (the start of) a path the shell's own file completion should complete."""
    if os.sep in incomplete or incomplete.startswith(("~", ".")):
        return True
    try:
        # Hidden entries count only once a dot is typed, as in the shells' own file completion.
        return any(p.name.startswith(incomplete) and not p.name.startswith(".") for p in Path().iterdir())
    except OSError:
        return False


def daemon_ids_or_paths(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Daemon ids for an operand that is a path or a daemon, as `operands.daemon_named` reads it.

    A word that starts an existing name in the working directory (the empty word, unless the directory is empty),
    or has a slash, is a path: no candidates here, so the shell completes files as for any path argument (every
    shell script Typer writes does so when the answer is empty).
    """
    return [] if _names_a_path(incomplete) else daemon_ids(ctx, incomplete)
