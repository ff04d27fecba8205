"""The root Typer app: global options and the command table."""

from __future__ import annotations

import copy
from typing import Annotated, Any

import typer
import wcache
from typer.completion import completion_init
from typer.core import TyperCommand, TyperGroup
from wcache.errors import EXIT_OK

from wcache_cli import coercion
from wcache_cli.commands.attach import attach
from wcache_cli.commands.completion import completion
from wcache_cli.commands.delta import delta
from wcache_cli.commands.demo import demo
from wcache_cli.commands.diff import diff
from wcache_cli.commands.doctor import doctor
from wcache_cli.commands.key import key
from wcache_cli.commands.preload import preload
from wcache_cli.commands.status import status, stop
from wcache_cli.commands.switch import switch
from wcache_cli.commands.top import top
from wcache_cli.commands.verify import verify
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
        verbose = next(p for p in self.params if p.name == "verbose")
        for command in self.commands.values():
            option = copy.copy(verbose)
            option.expose_value = False
            option.callback = _set_verbose
            command.params.append(option)


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


# In the order `wcache --help` lists them.
for command in (preload, status, stop, attach, key, diff, switch, delta, verify, top, doctor, demo, completion):
    app.command(cls=_WcacheCommand)(command)
