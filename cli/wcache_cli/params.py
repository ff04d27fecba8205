"""Options shared by several commands, declared once."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from wcache.attach_options import MODES, AttachOptions
from wcache.monitor.logs import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from wcache.plan.spec import DTYPES, LAYOUTS, QUANTIZATIONS, PlanSpec

from wcache_cli.completers import daemon_ids

# Typer choices built from core's vocabulary (and its defaults), never restated here.
Dtype = StrEnum("Dtype", {name: name for name in DTYPES})  # type: ignore[misc]
Quantization = StrEnum("Quantization", {name: name for name in QUANTIZATIONS})  # type: ignore[misc]
Layout = StrEnum("Layout", {name: name for name in LAYOUTS})  # type: ignore[misc]
LogLevel = StrEnum("LogLevel", {name: name for name in LOG_LEVELS})  # type: ignore[misc]
LogFormat = StrEnum("LogFormat", {name: name for name in LOG_FORMATS})  # type: ignore[misc]
Mode = StrEnum("Mode", {name: name for name in MODES})  # type: ignore[misc]
_PLAN = PlanSpec()
DEFAULT_DTYPE = Dtype(_PLAN.dtype)
DEFAULT_QUANTIZATION = Quantization(_PLAN.quantization)
DEFAULT_LAYOUT = Layout(_PLAN.layout)
DEFAULT_LEVEL = LogLevel(DEFAULT_LOG_LEVEL)
DEFAULT_FORMAT = LogFormat(DEFAULT_LOG_FORMAT)
DEFAULT_MODE = Mode(AttachOptions().mode)


ModelArg = Annotated[
    Path,
    typer.Argument(help="Model directory, .safetensors file, or Hugging Face repo id (Org/Name[@revision]) in the "
                   "local Hugging Face cache.", show_default=False, readable=False),
]
# MODEL where another source may stand in for it (preload --from).
OptionalModelArg = Annotated[Path | None, ModelArg.__metadata__[0]]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size.", min=1)]
RankOpt = Annotated[int, typer.Option("--rank", help="Tensor-parallel rank (0 ≤ rank < tp).", min=0)]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Processed dtype; auto keeps the checkpoint's.")]
QuantizationOpt = Annotated[Quantization, typer.Option("--quantization", help="Weight-only quantization.")]
PlanOpt = Annotated[Layout, typer.Option("--plan", help="Tensor layout: fused (qkv, gate_up) or identity.")]
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


def plan_from_options(tp: int, rank: int, dtype: Dtype, quantization: Quantization, layout: Layout) -> PlanSpec:
    """A validated plan; bad combinations raise BadInputError with the flag to fix."""
    return PlanSpec(tp_size=tp, tp_rank=rank, dtype=dtype.value, quantization=quantization.value,
                    layout=layout.value)


def run_dir_or_default(run_dir: Path | None) -> Path:
    if run_dir is not None:
        return run_dir
    from wcache.ipc.run_dir.directory import (
        default_run_dir,  # it imports psutil, which only commands that look at daemons need
    )

    return default_run_dir()


ModeOpt = Annotated[Mode, typer.Option(
    "--mode", help="zero_copy maps the daemon's memory and holds a lease; copy gives the engine weights of its own "
    "(on CPU a private copy-on-write map, no byte copied) and lets the daemon release them.")]
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

