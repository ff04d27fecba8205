"""The attach options an engine integration takes from its user (vLLM's extra config, transformers' kwargs).

One owner for their names, defaults and checks, so `--model-loader-extra-config '{"mode": "copy"}'` and
`from_pretrained(..., mode="copy")` accept exactly the same things and say the same sentence when wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from wcache.errors import BadInputError

MODES = ("zero_copy", "copy")
# The longest an attach waits for a daemon that is still loading: a day is far past any real load.
MAX_WAIT_S = 86_400
SHOWN_CHARS = 40


def _shown(value: Any) -> str:
    """A value from the user as an error sentence shows it: its repr, cut short (a 400-digit int, a long list)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4,300-digit limit for conversion to text
        return "an integer of thousands of digits"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}…"


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
        # A chained comparison refuses NaN (every comparison with it is false), infinity and a 400-digit int
        # alike, without turning any of them into a float first (which overflows).
        if type(self.wait_s) not in (int, float) or not 0 <= self.wait_s <= MAX_WAIT_S:
            raise BadInputError(f"wcache option wait_s must be from 0 to {MAX_WAIT_S} seconds, not "
                                f"{_shown(self.wait_s)}.")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str) -> AttachOptions:
        """Options from a user's mapping; `where` names it in the error (e.g. "model_loader_extra_config")."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise BadInputError(f"{where} must be a JSON object of wcache options, not {_shown(data)}.")
        data = dict(data)
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
                raise BadInputError(f"wcache option {name} in {where} cannot be {_shown(value)}.")
        if data.get("run_dir") is not None:
            data["run_dir"] = str(data["run_dir"])
        options = cls(**data)  # checks wait_s before it becomes a float: a huge int would overflow
        return replace(options, wait_s=float(options.wait_s))

    def to_mapping(self) -> dict[str, Any]:
        """The options as a user hands them to another engine's integration (vLLM's extra config, transformers'
        kwargs): `from_mapping(to_mapping())` gives them back; unset (None) options are left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
