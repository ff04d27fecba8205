"""The root Typer app: global options and the command table."""

from __future__ import annotations

import copy
from typing import Annotated, Any

import typer
import wcache
from typer.completion import completion_init
from typer.core import TyperCommand, TyperGroup
from typer.models import CommandInfo
from wcache.errors import EXIT_OK

from wcache_cli import coercion
from wcache_cli.command_table import LazyCommands, command_function
from wcache_cli.state import state


def _set_verbose(ctx: Any, param: Any, value: bool) -> None:
    if value:
        state.verbose = True


class _WcacheCommand(coercion.PlainValues, TyperCommand):
    """Every subcommand: plain option values are converted without importing pydantic (see coercion)."""


class _WcacheGroup(coercion.PlainValues, TyperGroup):
    """The root group; every subcommand also takes the global `--verbose`, since users add it at the end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verbose = next(p for p in self.params if p.name == "verbose")
        for command in self.commands.values():
            self._take_verbose(command)
        self.commands = LazyCommands(self.commands, self._build)

    def _take_verbose(self, command: Any) -> None:
        option = copy.copy(self._verbose)
        option.expose_value = False
        option.callback = _set_verbose
        command.params.append(option)

    def _build(self, name: str) -> Any:
        """The command `name`, as Typer builds it from its function (imported only now)."""
        info = CommandInfo(callback=command_function(name), cls=_WcacheCommand)
        command = typer.main.get_command_from_info(info, pretty_exceptions_short=app.pretty_exceptions_short,
                                                   rich_markup_mode=app.rich_markup_mode)
        assert command.name == name, f"the command table names {command.name!r} {name!r}"
        self._take_verbose(command)
        return command

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # names only: Typer's own reads every command, importing every module


app = typer.Typer(
    cls=_WcacheGroup,
    name="wcache",
    help="Keep processed LLM weights alive across engine restarts, and prove every reuse is the right checkpoint.",
    no_args_is_help=True,
    add_completion=False,  # one way to get the scripts: `wcache completion SHELL` (also shipped in completions/)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
# Typer registers how it answers bash, zsh and fish only for add_completion=True; the scripts need those answers.
completion_init()


def _print_version(value: bool) -> None:
    if value:
        print(f"wcache {wcache.__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def root(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show tracebacks for errors (also WCACHE_DEBUG=1).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True),
    ] = False,
) -> None:
    """Keep processed LLM weights alive across engine restarts, and prove every reuse is the right checkpoint."""
    state.verbose = state.verbose or verbose

