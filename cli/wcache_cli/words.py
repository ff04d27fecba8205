"""Core's options in `wcache`'s words: an API name (`layout`, `tp_size`, `fallback`) becomes the flag that sets
it (`--plan`, `--tp`, `--no-fallback`). Core messages mark options (`wcache.errors.option`); this is the one
place the command line words them, for errors and warnings alike."""

from __future__ import annotations

from wcache.errors import WcacheError, in_words, marked

# API names whose flag is not `--` + the name with dashes.
_FLAGS = {"tp_size": "--tp", "tp_rank": "--rank", "layout": "--plan", "wait_s": "--wait"}


def flag(name: str) -> str:
    """The flag of option `name`."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def flag_words(name: str, value: str | None) -> str:
    """`--plan identity` for ("layout", "identity"); a switch as itself when true, `--no-…` when false."""
    shown = flag(name)
    if value is None or value == "true":
        return shown
    if value == "false":
        return "--no-" + shown.removeprefix("--")
    return f"{shown} {value}"


def cli_text(text: str) -> str:
    """A core message, its options named as flags."""
    return in_words(text, flag_words)


def cli_message(exc: BaseException) -> str:
    """An error's message as `wcache` shows it."""
    return cli_text(marked(exc)) if isinstance(exc, WcacheError) else str(exc)
