"""Sizes a user writes on the command line: `3GiB`, `1.5G`, `800MB`, `0`."""

from __future__ import annotations

import re

from wcache.errors import BadInputError

# Binary multiples for the bare letters (what memory is counted in), decimal for the SI names.
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "KIB": 1 << 10, "MIB": 1 << 20,
          "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_byte_size(text: str, option: str) -> int:
    """Bytes in `text`; BadInputError naming `option` when it is not a size."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise BadInputError(f"{option} takes a size such as 3GiB, 1.5G or 800MB, not {text!r}.")
    return int(float(match.group(1)) * _UNITS[unit])
