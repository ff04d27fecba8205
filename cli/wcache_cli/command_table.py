"""Every subcommand by name, its module imported when the command is first looked up.

`wcache status` imports `commands/status.py` alone; `--help`, completion of command names and docgen look every
command up and so import them all. Typer builds each command from its function as it would have at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

# name: the module defining the command's function (named like the command). In the order `wcache --help`
# lists them.
COMMANDS: dict[str, str] = {
    "preload": "wcache_cli.commands.preload",
    "status": "wcache_cli.commands.status",
    "stop": "wcache_cli.commands.status",
    "serve": "wcache_cli.commands.serve",
    "restart": "wcache_cli.commands.serve",
    "attach": "wcache_cli.commands.attach",
    "key": "wcache_cli.commands.key",
    "diff": "wcache_cli.commands.diff",
    "switch": "wcache_cli.commands.switch",
    "delta": "wcache_cli.commands.delta",
    "verify": "wcache_cli.commands.verify",
    "top": "wcache_cli.commands.top",
    "doctor": "wcache_cli.commands.doctor",
    "demo": "wcache_cli.commands.demo",
    "completion": "wcache_cli.commands.completion",
}


def command_function(name: str) -> Callable[..., Any]:
    """The function a command runs, its module imported now."""
    function: Callable[..., Any] = getattr(importlib.import_module(COMMANDS[name]), name)
    return function


class LazyCommands(MutableMapping[str, Any]):
    """A group's commands: the table's, built by `build` on first lookup, then those registered on the app."""

    def __init__(self, registered: MutableMapping[str, Any], build: Callable[[str], Any]) -> None:
        self._built: dict[str, Any] = {}
        self._registered = registered
        self._build = build

    def __getitem__(self, name: str) -> Any:
        if name in self._registered:
            return self._registered[name]
        if name not in COMMANDS:
            raise KeyError(name)
        if name not in self._built:
            self._built[name] = self._build(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._registered[name] = command

    def __delitem__(self, name: str) -> None:
        del self._registered[name]

    def __iter__(self) -> Iterator[str]:
        yield from COMMANDS
        yield from (name for name in self._registered if name not in COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS.keys() | self._registered.keys())
