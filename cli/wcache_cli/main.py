"""Entry point: runs the app and turns library errors into one sentence and an exit code."""

from __future__ import annotations

import logging
import sys
import traceback

from wcache.errors import WcacheError

from wcache_cli.output import out
from wcache_cli.state import state


class _StderrWarnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        out.warning(record.getMessage())


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
        out.error(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        out.error("interrupted.")
        sys.exit(130)


if __name__ == "__main__":
    main()
