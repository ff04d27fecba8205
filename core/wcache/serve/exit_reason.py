"""Why a server died, in one line: how it ended and the last meaningful line of its log.

vLLM's start-up failures end in a Python exception whose last line says what went wrong (often the engine
core's, re-raised by the front process as a generic one): the first of those last lines is the cause; without
one, the last line of the log that is not a traceback frame.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

TAIL_BYTES = 256 * 1024
SHOWN_CHARS = 300
# An exception's last line, as Python prints it, perhaps behind vLLM's "(EngineCore pid=12) " process prefix.
_EXCEPTION = re.compile(r"^(?:\([\w ]+pid=\d+\)\s*)?(?P<line>[A-Za-z_][\w.]*(?:Error|Exception|Exit)(?::.*)?)$")
_PREFIX = re.compile(r"^(?:\([\w ]+pid=\d+\)\s*)?"
                     r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^]]*\]\s*)?")
_PROCESS = re.compile(r"^\([\w ]+pid=\d+\) ?")
MAX_DETAIL_LINES = 2
# The front process's own exceptions that only say the engine core failed: the core's line says why.
_GENERIC = ("RuntimeError: Engine core initialization failed", "SystemExit")


def how_it_ended(status: int) -> str:
    """An exit status as Popen reports it (negative: the signal that killed it), in words."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with status {status}"


def log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def last_meaningful_line(log: Path, start: int, end: int, exceptions_only: bool = False) -> str | None:
    """The line of `log` between bytes `start` and `end` (one server's part, up to its death) that best says why
    it stopped: an exception's last line, else (unless `exceptions_only`) the last plain line; None if none."""
    try:
        with log.open("rb") as file:
            file.seek(max(start, end - TAIL_BYTES))
            text = file.read(max(0, end - max(start, end - TAIL_BYTES))).decode(errors="replace")
    except OSError:
        return None
    lines = [_PROCESS.sub("", line.rstrip()) for line in text.splitlines() if line.strip()]
    exceptions = [(i, m["line"]) for i, line in enumerate(lines) if (m := _EXCEPTION.match(line.strip()))]
    specific = [(i, line) for i, line in exceptions if not line.startswith(_GENERIC)]
    if specific or exceptions:
        index, line = (specific or exceptions)[-1]
        return _shown(" ".join([line, *_details(lines[index + 1:])]))
    if exceptions_only:
        return None
    plain = [line for line in lines if not line.startswith((" ", "\t", "Traceback"))]
    return _shown(_PREFIX.sub("", plain[-1])) if plain else None


def _details(following: list[str]) -> list[str]:
    """The indented lines that continue an exception's message (pydantic's validation errors say what was wrong
    there), without their type annotations and links."""
    details = []
    for line in following[:MAX_DETAIL_LINES]:
        if not line[:1].isspace() or line.strip().startswith(("File ", "For further information")):
            break
        details.append(line.strip().split(" [type=", 1)[0])
    return details


def _shown(line: str) -> str:
    line = " ".join(line.split())
    return line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS] + "…"


def death_line(pid: int, status: int, log: Path, start: int, end: int) -> str:
    """One line: the server `pid` and how it ended, with its log's last meaningful line (of a server killed by a
    signal, only an exception's: its last lines say nothing about a kill from outside)."""
    line = last_meaningful_line(log, start, end, exceptions_only=status < 0)
    return f"the vLLM server (pid {pid}) {how_it_ended(status)}" + (f": {line}" if line else "")
