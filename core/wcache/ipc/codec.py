"""Frozen dataclasses to plain maps (msgpack or JSON) and back, every field checked on the way in.

`Wire` gives a dataclass `to_wire()` and `from_wire()`. The field annotations are the schema: str, int, float,
bool, bytes, None, Literal[...], X | None, tuple[X, ...] (a list on the wire), dict[str, X], and nested
dataclasses (a map); Any passes as it is; a field with `metadata={"wire": False}` is not on the wire. A field
with a default may be left out; anything missing, extra or of another type raises ProtocolError naming the
field. Checkers are built once per class, not per message.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Self

from wcache.errors import WcacheError
from wcache.ipc.protocol import ProtocolError

Check = Callable[[Any, str], Any]


class Wire:
    """Mixin for frozen dataclasses that cross a process boundary as a map."""

    __slots__ = ()
    # Fields left out of the map while they are None (the peer reads their absence as None).
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> dict[str, Any]:
        result: dict[str, Any] = _dumper(type(self))(self)
        return result

    @classmethod
    def from_wire(cls, data: Any) -> Self:
        result: Self = _checker(cls)(data, cls.__name__)
        return result


PLAIN = (str, int, bool, bytes)
Dump = Callable[[Any], Any]


def _wire_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init and f.metadata.get("wire", True))


def _dump_for(hint: Any) -> Dump | None:
    """How a value of `hint` becomes plain data; None where it already is (most fields: no call per field)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (*PLAIN, float, Any) or origin is Literal or (origin is list and args == (Any,)):
        return None
    if origin in (types.UnionType, typing.Union):
        inner = _dump_for(next(a for a in args if a is not type(None)))
        return None if inner is None else _or_none(inner)
    if origin is tuple:
        item = _dump_for(args[0])
        return list if item is None else _each(item)
    if origin is dict:
        item = _dump_for(args[1])
        return dict if item is None else _each_value(item)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dumper(hint)
    raise TypeError(f"no wire form for {hint}")


def _or_none(inner: Dump) -> Dump:
    return lambda v: None if v is None else inner(v)


def _each(item: Dump) -> Dump:
    return lambda v: [item(x) for x in v]


def _each_value(item: Dump) -> Dump:
    return lambda v: {k: item(x) for k, x in v.items()}


_DUMPERS: dict[type, Dump] = {}
_CHECKERS: dict[type, Check] = {}


def _dumper(cls: type) -> Dump:
    found = _DUMPERS.get(cls)
    if found is None:
        found = _DUMPERS[cls] = _build_dumper(cls)
    return found


def _checker(cls: type) -> Check:
    found = _CHECKERS.get(cls)
    if found is None:
        found = _CHECKERS[cls] = _build_checker(cls)
    return found


def _build_dumper(cls: type) -> Dump:
    hints = typing.get_type_hints(cls)
    wire = _wire_fields(cls)
    omit = cls.OMIT_NONE if issubclass(cls, Wire) else frozenset()
    plain = tuple(f.name for f in wire if _dump_for(hints[f.name]) is None and f.name not in omit)
    other = tuple((f.name, _dump_for(hints[f.name]), f.name in omit) for f in wire if f.name not in plain)

    def dump(value: Any) -> dict[str, Any]:
        data = {name: getattr(value, name) for name in plain}
        for name, convert, omitted in other:
            item = getattr(value, name)
            if item is None and omitted:
                continue
            data[name] = item if convert is None or item is None else convert(item)
        return data

    return dump


def _fail(where: str, what: str) -> ProtocolError:
    return ProtocolError(f"{where} {what}")


def _exact(kind: type) -> Check:
    def check(value: Any, where: str) -> Any:
        # type() and not isinstance(): True is an int in Python, and no field here means a flag by a number.
        if type(value) is not kind:
            raise _fail(where, f"is {type(value).__name__}, not {kind.__name__}")
        return value
    return check


def _float(value: Any, where: str) -> float:
    if type(value) not in (int, float):
        raise _fail(where, f"is {type(value).__name__}, not a number")
    try:
        number = float(value)
    except OverflowError:  # an int of hundreds of digits: no float holds it
        raise _fail(where, "is too large for a number") from None
    if not math.isfinite(number):
        raise _fail(where, f"is {number}, not a finite number")
    return number


def _any(value: Any, where: str) -> Any:
    return value


def _options(choices: tuple[Any, ...]) -> Check:
    def check(value: Any, where: str) -> Any:
        if type(value) not in {type(c) for c in choices} or value not in choices:
            raise _fail(where, f"must be one of {', '.join(map(repr, choices))}, not {value!r}")
        return value
    return check


def _optional(inner: Check) -> Check:
    def check(value: Any, where: str) -> Any:
        return None if value is None else inner(value, where)
    return check


def _sequence(inner: Check) -> Check:
    def check(value: Any, where: str) -> tuple[Any, ...]:
        if type(value) not in (list, tuple):
            raise _fail(where, f"is {type(value).__name__}, not a list")
        return tuple(inner(v, where) for v in value)
    return check


def _plain_sequence(kind: type) -> Check:
    def check(value: Any, where: str) -> tuple[Any, ...]:
        if type(value) not in (list, tuple):
            raise _fail(where, f"is {type(value).__name__}, not a list")
        for item in value:
            if type(item) is not kind:
                raise _fail(where, f"holds a {type(item).__name__}, not only {kind.__name__}")
        return tuple(value)
    return check


def _mapping(inner: Check) -> Check:
    def check(value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict or not all(type(k) is str for k in value):
            raise _fail(where, "is not a map of strings")
        return value if inner is _any else {k: inner(v, f"{where}.{k}") for k, v in value.items()}
    return check


def _for(hint: Any) -> Check:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return _any
    if hint is float:
        return _float
    if hint in (str, int, bool, bytes):
        return _exact(hint)
    if origin is Literal:
        return _options(args)
    if origin in (types.UnionType, typing.Union):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"no wire form for {hint}")
        return _optional(_for(rest[0]))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _plain_sequence(args[0]) if args[0] in PLAIN else _sequence(_for(args[0]))
    if origin is list and args == (Any,):
        return _exact(list)  # passed through as it came: a long list of wire lists, no object per item
    if origin is dict and args[0] is str:
        return _mapping(_for(args[1]))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _checker(hint)
    raise TypeError(f"no wire form for {hint}")


def _build_checker(cls: type) -> Check:
    hints = typing.get_type_hints(cls)
    known = _wire_fields(cls)
    # Fields of one exact type are checked inline (a manifest has five per tensor, 100k tensors); the rest by
    # their checker, with the field's path built only for them.
    exact = {f.name: hints[f.name] for f in known if hints[f.name] in PLAIN}
    checks = {f.name: _for(hints[f.name]) for f in known if f.name not in exact}
    names = frozenset(f.name for f in known)
    required = frozenset(f.name for f in known
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)

    def check(value: Any, where: str) -> Any:
        if type(value) is not dict:
            raise _fail(where, f"is {type(value).__name__}, not a map")
        present = value.keys()
        if not (required <= present <= names):
            missing, extra = sorted(required - present), sorted(k for k in present if k not in names)
            raise _fail(where, f"has fields missing {missing}, unexpected {extra}")
        values = {}
        for name, item in value.items():
            kind = exact.get(name)
            if kind is None:
                item = checks[name](item, f"{where}.{name}")
            elif type(item) is not kind:
                raise _fail(f"{where}.{name}", f"is {type(item).__name__}, not {kind.__name__}")
            values[name] = item
        try:
            return cls(**values)
        except (TypeError, ValueError, WcacheError) as exc:  # the class's own checks (a plan's, say)
            raise _fail(where, f"is not valid ({exc})") from None

    return check
