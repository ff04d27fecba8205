"""The attach options an engine integration takes from its user (vLLM's extra config, transformers' kwargs).

One owner for their names, defaults and checks, so `--model-loader-extra-config '{"mode": "copy"}'` and
`from_pretrained(..., mode="copy")` accept exactly the same things and say the same sentence when wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from wcache.errors import BadInputError
from wcache.schema import Schema

MODES = ("zero_copy", "copy")
# The longest an attach waits for a daemon that is still loading: a day is far past any real load.
MAX_WAIT_S = 86_400
SHOWN_CHARS = 40
# Where msgspec's reason names the option whose value it refused (an unknown one it names in backquotes only).
_AT = re.compile(r" - at `\$\.(?P<name>[^`]*)`$", re.DOTALL)


def _shown(value: Any) -> str:
    """A value from the user as an error sentence shows it: its repr, cut short (a 400-digit int, a long list)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4,300-digit limit for conversion to text
        return "an integer of thousands of digits"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}…"


class AttachOptions(Schema, frozen=True):
    """How an engine attaches: fall back to disk on a miss, zero-copy or copy, which daemon, how long to wait.

    Change one with `msgspec.structs.replace`, which checks the result as construction does."""

    fallback: bool = True
    mode: str = "zero_copy"
    trust_daemon: bool = False
    daemon: str | None = None
    run_dir: str | None = None
    wait_s: int | float = 0.0  # an int as given is checked before it becomes a float: a huge one would overflow

    def __post_init__(self) -> None:
        # Raised as is through msgspec.convert too (a WcacheError is not one of the errors it rewraps).
        if self.mode not in MODES:
            raise BadInputError(f"wcache option mode must be {' or '.join(MODES)}, not {self.mode!r}.")
        # A chained comparison refuses NaN (every comparison with it is false), infinity and a 400-digit int
        # alike, without turning any of them into a float first (which overflows). A bool is an int, but a wait
        # of True seconds is a mistake, not one second.
        if type(self.wait_s) not in (int, float) or not 0 <= self.wait_s <= MAX_WAIT_S:
            raise BadInputError(f"wcache option wait_s must be from 0 to {MAX_WAIT_S} seconds, not "
                                f"{_shown(self.wait_s)}.")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str) -> AttachOptions:
        """Options from a user's mapping; `where` names it in the error (e.g. "model_loader_extra_config")."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise BadInputError(f"{where} must be a JSON object of wcache options, not {_shown(data)}.")
        # A Path is the one value taken that JSON has no type for: the run dir as a Python caller holds it.
        given = {k: str(v) if k == "run_dir" and isinstance(v, Path) else v for k, v in data.items()}
        try:
            options = msgspec.convert(given, cls, strict=True)  # strict: a bool is no number, a string no bool
        except msgspec.ValidationError as exc:
            raise BadInputError(cls._refusal(str(exc), given, where)) from None
        return msgspec.structs.replace(options, wait_s=float(options.wait_s))

    @classmethod
    def _refusal(cls, reason: str, given: dict[Any, Any], where: str) -> str:
        """msgspec's `reason` for refusing `given` as the sentence a user reads, naming the option."""
        at = _AT.search(reason)
        if at is not None and at["name"] in given:
            return f"wcache option {at['name']} in {where} cannot be {_shown(given[at['name']])}."
        unknown = [name for name in given if name not in cls.names()]
        if not unknown:
            return f"{where} cannot be read as wcache options ({reason})."
        return f"unknown wcache option {unknown[0]!r} in {where}; the options are {', '.join(cls.names())}."

    def to_mapping(self) -> dict[str, Any]:
        """The options as a user hands them to another engine's integration (vLLM's extra config, transformers'
        kwargs): `from_mapping(to_mapping())` gives them back; unset (None) options are left out."""
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) is not None}
