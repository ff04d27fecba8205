"""The command lines of the supervisor and the rank daemons: written and read by one owner.

`start_daemons` writes the supervisor's, the supervisor writes each rank's from what it parsed, and each
side parses with the same flags and defaults, so a flag added here reaches every process it must.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from pathlib import Path

from wcache.daemon.scrub import DEFAULT_INTERVAL_S, checked_interval
from wcache.errors import BadInputError
from wcache.key.provenance import REQUIREMENTS
from wcache.monitor.logs import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from wcache.plan.spec import PlanSpec

_PLAN = PlanSpec()


@dataclass(frozen=True)  # no slots: the class attributes are the parsers' defaults
class LoadArgs:
    """What both the supervisor and a rank take: the checkpoint, its plan (but the rank), where, and logging."""

    model: Path
    run_dir: Path
    device: str = "cpu"
    tp: int = _PLAN.tp_size
    dtype: str = _PLAN.dtype
    quantization: str = _PLAN.quantization
    plan: str = _PLAN.layout
    log_level: str = DEFAULT_LOG_LEVEL
    log_format: str = DEFAULT_LOG_FORMAT
    log_file: Path | None = None
    require_provenance: str = "warn"  # key.provenance.Requirement
    expected: Path | None = None  # the user's expected digests (SHA256SUMS or a saved key file)
    # A next version: `model` is a delta file, applied to these daemons (one name per rank, comma-separated).
    parents: str = ""
    scrub_interval: float = DEFAULT_INTERVAL_S  # seconds between background re-hashes of the arena; 0: none
    # Bytes of retired arenas a rank keeps to build its next versions in (`wcache.daemon.version_host`); 0: none.
    version_pool: int = 0

    def __post_init__(self) -> None:
        checked_interval(self.scrub_interval)  # every caller's value, before any process starts with it
        if type(self.version_pool) is not int or self.version_pool < 0:
            raise BadInputError(f"version_pool is a number of bytes, 0 or more, not {self.version_pool!r}.")

    def to_argv(self) -> list[str]:
        return [
            "--model", str(self.model), "--run-dir", str(self.run_dir), "--device", self.device,
            "--tp", str(self.tp), "--dtype", self.dtype, "--quantization", self.quantization, "--plan", self.plan,
            "--log-level", self.log_level, "--log-format", self.log_format,
            *(["--log-file", str(self.log_file)] if self.log_file is not None else []),
            "--require-provenance", self.require_provenance,
            *(["--expected", str(self.expected)] if self.expected is not None else []),
            *(["--parents", self.parents] if self.parents else []),
            "--scrub-interval", str(self.scrub_interval),
            *(["--version-pool", str(self.version_pool)] if self.version_pool else []),
        ]

    def for_rank(self, device: str, run_dir: Path, log_file: Path) -> LoadArgs:
        """What the supervisor passes on to a rank: its own device and log file."""
        return replace(self, device=device, run_dir=run_dir, log_file=log_file)

    def parent_of(self, rank: int) -> str | None:
        """The daemon whose arena rank `rank` of a next version starts from; None for a preload from disk."""
        return self.parents.split(",")[rank] if self.parents else None

    def plan_spec(self, rank: int) -> PlanSpec:
        return PlanSpec(tp_size=self.tp, tp_rank=rank, dtype=self.dtype, quantization=self.quantization,
                        layout=self.plan)

    @staticmethod
    def add_to(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", type=Path, required=True)
        parser.add_argument("--run-dir", type=Path, required=True)
        parser.add_argument("--device", default=LoadArgs.device)
        parser.add_argument("--tp", type=int, default=LoadArgs.tp)
        # No choices: a bad plan value fails in PlanSpec, whose sentence the rank reports to the supervisor.
        parser.add_argument("--dtype", default=LoadArgs.dtype)
        parser.add_argument("--quantization", default=LoadArgs.quantization)
        parser.add_argument("--plan", default=LoadArgs.plan)
        parser.add_argument("--log-level", choices=LOG_LEVELS, default=LoadArgs.log_level)
        parser.add_argument("--log-format", choices=LOG_FORMATS, default=LoadArgs.log_format)
        parser.add_argument("--log-file", type=Path, default=None)
        parser.add_argument("--require-provenance", choices=REQUIREMENTS, default=LoadArgs.require_provenance)
        parser.add_argument("--expected", type=Path, default=None)
        parser.add_argument("--parents", default=LoadArgs.parents)
        parser.add_argument("--scrub-interval", type=_interval, default=LoadArgs.scrub_interval)
        parser.add_argument("--version-pool", type=int, default=LoadArgs.version_pool)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> LoadArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _interval(text: str) -> float:
    """argparse's reading of --scrub-interval: a usage error, not a daemon whose re-checks silently never run."""
    try:
        return checked_interval(float(text))
    except (ValueError, BadInputError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
