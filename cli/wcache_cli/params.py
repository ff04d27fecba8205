"""Options shared by several commands, declared once. Those whose choices are core's vocabulary (dtype,
quantization, plan, log level and format, attach mode) are `choices`: they import the plan and the attach
options, which `status`, `stop` and `doctor` do not need."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wcache_cli.completers import daemon_ids

ModelArg = Annotated[
    Path,
    typer.Argument(help="Model directory, .safetensors file, or Hugging Face repo id (Org/Name[@revision]) in the "
                   "local Hugging Face cache.", show_default=False, readable=False),
]
# MODEL where another source may stand in for it (preload --from).
OptionalModelArg = Annotated[Path | None, ModelArg.__metadata__[0]]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size.", min=1)]
RankOpt = Annotated[int, typer.Option("--rank", help="Tensor-parallel rank (0 ≤ rank < tp).", min=0)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, or cuda:N[,M...] (one per rank).")]
RunDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--run-dir",
        help="Where daemons publish sockets and descriptors [default: $WCACHE_RUN_DIR, "
        "else $XDG_RUNTIME_DIR/wcache, else /tmp/wcache-<uid>].",
        show_default=False,
    ),
]


def run_dir_or_default(run_dir: Path | None) -> Path:
    if run_dir is not None:
        return run_dir
    from wcache.ipc.run_dir.directory import (
        default_run_dir,  # it imports psutil, which only commands that look at daemons need
    )

    return default_run_dir()


TrustDaemonOpt = Annotated[
    bool, typer.Option("--trust-daemon", help="Skip the checkpoint stat pass; still compare config and plan.")
]
DaemonOpt = Annotated[
    str | None,
    typer.Option("--daemon", help="Use this daemon (name or key id prefix).", show_default=False,
                 autocompletion=daemon_ids),
]
ExpectedOpt = Annotated[
    Path | None,
    typer.Option("--expected", help="Each file's expected SHA-256, for a checkpoint outside the Hugging Face cache: "
                 "a SHA256SUMS-style file (sha256sum output) or a saved key file.", show_default=False,
                 readable=False),
]
VersionPoolOpt = Annotated[
    str, typer.Option("--version-pool", metavar="SIZE",
                      help="Memory each rank may keep of retired versions' arenas (e.g. 3GiB) to build the "
                      "next versions a training loop publishes in, writing only what changed; 0 keeps none.")
]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt.", min=1)]


def warn_if_exposed(host: str, flag: str, what: str) -> None:
    """One warning when a server without authentication listens beyond this machine's loopback."""
    import ipaddress

    from wcache_cli.output import out

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        loopback = False
    if not loopback:
        out.warning(f"{flag} {host} serves {what} without authentication to every network that reaches it.")

