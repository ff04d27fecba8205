"""Entry point: runs the app and turns library errors into one sentence and an exit code."""

from __future__ import annotations

import logging
import sys
import traceback

from wcache.errors import EXIT_INTERRUPTED, WcacheError

from wcache_cli.output import out
from wcache_cli.state import state
from wcache_cli.words import cli_message, cli_text


class _StderrWarnings(logging.Handler):
    """Warnings on stderr, each once: `top` and `status --check` read the run dir on every poll, and one
    unreadable file is one warning, not one per poll."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self._seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = cli_text(record.getMessage())  # options named as flags, whoever logged the warning
        if message not in self._seen:
            self._seen.add(message)
            out.warning(message)


def main() -> None:
    """Console-script entry point for `wcache`."""
    from wcache_cli.app import app

    logger = logging.getLogger("wcache")
    logger.addHandler(_StderrWarnings(level=logging.WARNING))
    logger.propagate = False
    try:
        app()
    except WcacheError as exc:
        if state.verbose:
            traceback.print_exc()
        out.error(cli_message(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        out.error("interrupted.")
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
