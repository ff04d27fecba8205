"""One output object: data on stdout (rich for people, JSON for programs), diagnostics on stderr."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

PIPE_WIDTH = 200
# C0 controls but newline and tab, DEL and C1: what a terminal would act on (escape sequences, OSC 8 links…).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Text from outside (a path, a name) as it may be shown on a terminal: control characters as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class Output:
    """Where every command prints; respects NO_COLOR and non-TTY output through rich."""

    def __init__(self) -> None:
        self.stdout = Console(highlight=False, soft_wrap=True)
        if not self.stdout.is_terminal and "COLUMNS" not in os.environ:
            # Piped output is read by grep and by people scrolling logs: never fold a tensor name at 80.
            self.stdout = Console(highlight=False, soft_wrap=True, width=PIPE_WIDTH)
        self.stderr = Console(stderr=True, highlight=False, soft_wrap=True)

    def json(self, value: Any) -> None:
        # Plain print: rich would re-wrap long strings and break the document.
        sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
        sys.stdout.flush()

    def print(self, *renderables: Any) -> None:
        self.stdout.print(*renderables)

    def error(self, message: str) -> None:
        self.stderr.print(f"[bold red]error:[/] {escape(printable(message))}")

    def warning(self, message: str) -> None:
        self.stderr.print(f"[yellow]warning:[/] {escape(printable(message))}")

    def hint(self, message: str) -> None:
        self.stderr.print(f"[dim]{escape(printable(message))}[/]")


out = Output()
