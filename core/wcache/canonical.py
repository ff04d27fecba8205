"""Canonical JSON and the one digest function every wcache fingerprint is built from."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import blake3


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal values always encode to equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def digest_hex(data: bytes) -> str:
    """BLAKE3 of `data`, as 64 hex digits."""
    return blake3.blake3(data).hexdigest()


def digest_of(value: Any) -> str:
    """BLAKE3 of the canonical JSON of `value`."""
    return digest_hex(canonical_json(value).encode())


# The bits of an int64's magnitude: pids, byte counts and times written by a process of ours fit in them.
INT64_BITS = 63


class NonFiniteNumberError(ValueError):
    """A JSON number without a finite value (NaN, Infinity, 1e400), which canonical JSON cannot hold."""


def loads_finite(text: bytes | str, *, int_bits: int | None = None) -> Any:
    """Parse JSON whose numbers are all finite; ValueError for anything else, including nesting too deep to parse.

    Every reader of a file another process may have written goes through here, so a NaN, an overflowing float or
    ten thousand nested brackets is a value refused, never a crash further on. With `int_bits`, an integer of
    that many bits or more is refused too (a 400-digit count turns into a float nowhere).
    """
    parse_int = None if int_bits is None else _bounded_int(1 << int_bits)
    try:
        return json.loads(text, parse_constant=_non_finite, parse_float=_finite_float, parse_int=parse_int)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None


def _bounded_int(limit: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not -limit < value < limit:
            raise ValueError(f"the integer {text[:12]}… ({len(text)} digits) is too large")
        return value
    return parse


def _non_finite(constant: str) -> float:
    raise NonFiniteNumberError(constant)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumberError(text)
    return value
