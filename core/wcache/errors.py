"""Typed errors: each one carries a one-sentence message and the exit code the CLI maps it to.

Exit codes are owned here, once. Options are named in messages by their API name (`option("layout", "identity")`,
a field of PlanSpec, AttachOptions or LoadArgs), never by a CLI flag: each front end words them its own way
(`--plan identity` for `wcache`, `model_loader_extra_config` keys for vLLM) with `in_words`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

EXIT_OK = 0
EXIT_DIFFERENCE = 1  # a check found a difference (diff, verify, doctor, provenance)
EXIT_BAD_INPUT = 2  # bad usage or input
EXIT_UNAVAILABLE = 3  # a daemon or engine is unavailable: not there, crashed, killed, or stopped before it was ready
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, what shells report for a process SIGINT ended

# An option inside a message: ⟨name⟩ or ⟨name=value⟩. Marks in the text itself, so a message keeps them across
# everything that carries it as a string: a rank's status line, a TP rank's report, a log line.
_MARK = re.compile(r"⟨([a-z][a-z0-9_]*)(?:=([^⟨⟩]*))?⟩")

# How one front end names option `name` (given `value`, or None when the message names the option alone).
Words = Callable[[str, str | None], str]


def option(name: str, value: object = None) -> str:
    """Option `name` (its API name) in a message, with the value the message suggests, if any."""
    if value is None:
        return f"⟨{name}⟩"
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return f"⟨{name}={text}⟩"


def api_words(name: str, value: str | None) -> str:
    """A Python caller's words: the keyword argument, `layout="identity"`, `tp_size=1`, `fallback=False`."""
    if value is None:
        return name
    if value in ("true", "false"):
        return f"{name}={value.capitalize()}"
    return f"{name}={value}" if value.isdigit() else f'{name}="{value}"'


def in_words(text: str, words: Words) -> str:
    """`text` with every option it names in `words`."""
    return _MARK.sub(lambda m: words(m.group(1), m.group(2)), text)


def marked(exc: BaseException) -> str:
    """An error's message with its options still marked: what crosses to another process or front end."""
    return super(WcacheError, exc).__str__() if isinstance(exc, WcacheError) else str(exc)


class WcacheError(Exception):
    """Base of every error wcache raises on purpose; its message is shown to users as is.

    `str()` names options in a Python caller's words; a front end words `marked(error)` in its own."""

    exit_code: int = EXIT_BAD_INPUT

    def __str__(self) -> str:
        return in_words(super().__str__(), api_words)


class BadInputError(WcacheError):
    """The user's input (a path, a file, an option) cannot be used."""

    exit_code = EXIT_BAD_INPUT


class CheckpointError(BadInputError):
    """A checkpoint is missing, truncated, or its headers or index lie."""


class KeyFileError(BadInputError):
    """A saved key file cannot be read."""


class UnavailableError(WcacheError):
    """A daemon or engine that was needed is not there."""

    exit_code = EXIT_UNAVAILABLE


class ListenError(BadInputError):
    """A server cannot listen where the user asked (a host that does not resolve or is not local, a busy port)."""


@contextlib.contextmanager
def closed_on_error(close: Callable[[], object], unreadable: Callable[[OSError], Exception]) -> Iterator[None]:
    """Run the block; if it raises, `close` what it was opening first (nothing else will), and raise an OSError
    as `unreadable(exc)`: one sentence instead of the system's words."""
    try:
        yield
    except OSError as exc:
        close()
        raise unreadable(exc) from exc
    except BaseException:
        close()
        raise
