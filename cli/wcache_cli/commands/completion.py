"""`wcache completion SHELL`: the completion script for a shell, which asks `wcache` itself for every candidate."""

from __future__ import annotations

from typing import Annotated

import typer
from typer.completion import get_completion_script
from wcache.errors import BadInputError

PROG = "wcache"
# Typer's protocol: the script runs `wcache` with this variable set to `complete_<shell>`, and Typer answers.
COMPLETE_VAR = "_WCACHE_COMPLETE"
SHELLS = ("bash", "zsh", "fish")


def _shells(incomplete: str) -> list[str]:
    return [shell for shell in SHELLS if shell.startswith(incomplete)]


def completion_script(shell: str) -> str:
    """The script Typer installs for `shell`, with a trailing newline."""
    if shell not in SHELLS:
        raise BadInputError(f"no completion for shell {shell!r}; choose one of {', '.join(SHELLS)}.")
    script = get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell)
    if shell == "zsh":
        # Typer's script only registers its function, so when compinit autoloads it from $fpath (where packages
        # install `_wcache`) the first TAB of every shell completes nothing; complete that one too.
        script += f'\nif [[ $funcstack[1] == _{PROG} ]] && (( $+compstate )); then _{PROG}_completion "$@"; fi'
    return script + "\n"


def completion(
    shell: Annotated[
        str, typer.Argument(help="bash, zsh or fish.", metavar="SHELL", show_default=False, autocompletion=_shells)
    ],
) -> None:
    """Print the shell completion script for SHELL; it asks `wcache` for candidates, daemon ids included.

    \b
    bash:  wcache completion bash > ~/.local/share/bash-completion/completions/wcache
    zsh:   wcache completion zsh > ~/.zfunc/_wcache   (with fpath+=~/.zfunc before compinit in ~/.zshrc)
    fish:  wcache completion fish > ~/.config/fish/completions/wcache.fish

    The same scripts are in the source tree's completions/ directory, for packagers.
    """
    print(completion_script(shell), end="")
