"""Typed errors: each one carries a one-sentence message and the exit code the CLI maps it to."""

from __future__ import annotations

EXIT_OK = 0
EXIT_DIFFERENCE = 1
EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 3


class WcacheError(Exception):
    """Base of every error wcache raises on purpose; its message is shown to users as is."""

    exit_code: int = EXIT_BAD_INPUT


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
