"""Canonical JSON and the one digest function every wcache fingerprint is built from."""

from __future__ import annotations

import json
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
