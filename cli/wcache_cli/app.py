"""The root Typer app: global options and the command table."""

from __future__ import annotations

from typing import Annotated

import typer
import wcache

from wcache_cli.commands.attach import attach
from wcache_cli.commands.demo import demo
from wcache_cli.commands.diff import diff
from wcache_cli.commands.key import key
from wcache_cli.commands.preload import preload
from wcache_cli.commands.status import status, stop
from wcache_cli.commands.top import top
from wcache_cli.commands.verify import verify
from wcache_cli.state import state

app = typer.Typer(
    name="wcache",
    help="Keep processed LLM weights alive across engine restarts, and prove every reuse is the right checkpoint.",
    no_args_is_help=True,
    add_completion=False,  # completions are generated into completions/ and shipped as files
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)


def _print_version(value: bool) -> None:
    if value:
        print(f"wcache {wcache.__version__}")
        raise typer.Exit()


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
    state.verbose = verbose


app.command()(preload)
app.command()(status)
app.command()(stop)
app.command()(attach)
app.command()(key)
app.command()(diff)
app.command()(verify)
app.command()(top)
app.command()(demo)
