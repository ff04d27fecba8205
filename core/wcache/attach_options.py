"""The attach options an engine integration takes from its user (vLLM's extra config, transformers' kwargs).

One owner for their names, defaults and checks, so `--model-loader-extra-config '{"mode": "copy"}'` and
`from_pretrained(..., mode="copy")` accept exactly the same things and say the same sentence when wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from wcache.errors import BadInputError

MODES = ("zero_copy", "copy")
# The engines that attach (wcache's reference engine first: the default), as `verify --engine` names them.
ENGINES = ("reference", "vllm", "transformers")


@dataclass(frozen=True, slots=True)
class AttachOptions:
    """How an engine attaches: fall back to disk on a miss, zero-copy or copy, which daemon, how long to wait."""

    fallback: bool = True
    mode: str = "zero_copy"
    trust_daemon: bool = False
    daemon: str | None = None
    run_dir: str | None = None
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadInputError(f"wcache option mode must be {' or '.join(MODES)}, not {self.mode!r}.")
        if self.wait_s < 0:
            raise BadInputError(f"wcache option wait_s must be zero or more seconds, not {self.wait_s}.")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str) -> AttachOptions:
        """Options from a user's mapping; `where` names it in the error (e.g. "model_loader_extra_config")."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(cls.names()))
        if unknown:
            raise BadInputError(
                f"unknown wcache option {unknown[0]!r} in {where}; the options are {', '.join(cls.names())}."
            )
        expected: dict[str, tuple[type, ...]] = {
            "fallback": (bool,), "mode": (str,), "trust_daemon": (bool,), "daemon": (str, type(None)),
            "run_dir": (str, Path, type(None)), "wait_s": (int, float),
        }
        for name, value in data.items():
            # bool is an int: a wait of True seconds is a mistake, not one second.
            if not isinstance(value, expected[name]) or (name == "wait_s" and isinstance(value, bool)):
                raise BadInputError(f"wcache option {name} in {where} cannot be {value!r}.")
        if data.get("run_dir") is not None:
            data["run_dir"] = str(data["run_dir"])
        if "wait_s" in data:
            data["wait_s"] = float(data["wait_s"])
        return cls(**data)

    def to_mapping(self) -> dict[str, Any]:
        """The options as a user hands them to another engine's integration (vLLM's extra config, transformers'
        kwargs): `from_mapping(to_mapping())` gives them back; unset (None) options are left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
