"""One output object: data on stdout (rich for people, JSON for programs), diagnostics on stderr."""

from __future__ import annotations

import os
import re
import sys
from functools import cached_property
from typing import TYPE_CHECKING, Any

from wcache.errors import EXIT_OK

if TYPE_CHECKING:
    from rich.console import Console

PIPE_WIDTH = 200
# What a terminal would act on or a reader be misled by: C0 controls (escape sequences, OSC 8 links, and the
# newlines that would forge a line of output), DEL and C1, the line and paragraph separators, and the
# bidirectional controls that make text display in another order than it is read (U+202E and its kin).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Text from outside (a path, a name, a forged record's field) as it may be shown on a terminal, on one line:
    control characters as \\xNN, bidirectional ones as \\uNNNN."""
    return _CONTROL.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def reader_gone() -> None:
    """stdout's reader left (`| head`, `| grep -q`): it has what it wanted, so end quietly with success."""
    # Point stdout at /dev/null so the interpreter's final flush cannot raise a second time.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise SystemExit(EXIT_OK)


def literal(text: str) -> str:
    """Text from outside as rich markup that shows it as is: escaped for the terminal, and no `[tag]` acts."""
    from rich.markup import escape

    return escape(printable(text))


class Output:
    """Where every command prints; respects NO_COLOR and non-TTY output through rich.

    The consoles are made on first use: importing rich costs more than `wcache --help` itself.
    """

    @cached_property
    def stdout(self) -> Console:
        from rich.console import Console

        class _Console(Console):
            def on_broken_pipe(self) -> None:
                reader_gone()

        console = _Console(highlight=False, soft_wrap=True)
        if not console.is_terminal and "COLUMNS" not in os.environ:
            # Piped output is read by grep and by people scrolling logs: never fold a tensor name at 80.
            console = _Console(highlight=False, soft_wrap=True, width=PIPE_WIDTH)
        return console

    @cached_property
    def stderr(self) -> Console:
        from rich.console import Console

        return Console(stderr=True, highlight=False, soft_wrap=True)

    def json(self, value: Any) -> None:
        """Print `value` as indented JSON; msgspec writes it, so Schema structs in it are written as they are."""
        import msgspec

        # Plain print: rich would re-wrap long strings and break the document.
        try:
            sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            reader_gone()  # here, not in main(): Click turns EPIPE into exit 1 before main() could see it

    def print(self, *renderables: Any) -> None:
        self.stdout.print(*renderables)

    def error(self, message: str) -> None:
        self.stderr.print(f"[bold red]error:[/] {literal(message)}")

    def warning(self, message: str) -> None:
        self.stderr.print(f"[yellow]warning:[/] {literal(message)}")

    def hint(self, message: str) -> None:
        self.stderr.print(f"[dim]{literal(message)}[/]")


out = Output()
