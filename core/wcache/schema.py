"""The one schema system: msgspec Structs for everything that crosses a process boundary or outlives one.

A `Schema` is frozen and strict where it is read: missing fields, unknown fields and values of another type
(a bool where an int is due, a float where an int is due, a string for a list) are refused, each with one
sentence naming the field (`schema_error`). A `Record` is the same for what is read back from a log that
outlives versions (events): unknown fields are skipped there, so a newer writer's lines still read.
Fields at their default are left out of what is written, so an added optional field costs older readers
nothing.
"""

from __future__ import annotations

import re
from typing import Any, Self

import msgspec


class Schema(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A strict value type; `to_wire()` is its plain form (JSON-ready maps, lists, strings and numbers)."""

    def to_wire(self) -> dict[str, Any]:
        # bytes stay bytes (a CUDA handle's fields); no schema written as JSON holds any.
        result: dict[str, Any] = msgspec.to_builtins(self, builtin_types=(bytes,))
        return result

    @classmethod
    def from_wire(cls, data: Any) -> Self:
        """From plain data (parsed JSON, say); ValueError (SchemaError) with one sentence on anything wrong."""
        try:
            return msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise SchemaError(schema_error(cls.__name__, exc), schema_error_field(exc)) from None


class Record(msgspec.Struct, frozen=True, omit_defaults=True):
    """A value read back from a log that outlives versions: fields it does not know are skipped."""


class SchemaError(ValueError):
    """Data that does not fit its schema; the message is one sentence naming the field, `field` the top-level
    field it lies under (None: the whole value, a missing or an unknown field)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


_WHERE = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_TOP_FIELD = re.compile(r"^\.(?P<field>[A-Za-z_][A-Za-z0-9_]*)")


def schema_error(kind: str, exc: msgspec.ValidationError | msgspec.DecodeError) -> str:
    """msgspec's reason as one sentence that names the field by its path under `kind` (`Hello.key.plan`)."""
    text = " ".join(str(exc).split())
    match = _WHERE.match(text)
    where = kind
    if match is not None:
        text, where = match["what"], kind + match["path"]
    return f"{where}: {text[:1].lower()}{text[1:]}"


def schema_error_field(exc: msgspec.ValidationError | msgspec.DecodeError) -> str | None:
    """The top-level field msgspec's reason lies under (`prompt` of `$.prompt[2]`), or None."""
    match = _WHERE.match(" ".join(str(exc).split()))
    top = _TOP_FIELD.match(match["path"]) if match is not None else None
    return top["field"] if top is not None else None
