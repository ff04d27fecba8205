"""Option values converted without pydantic where the answer is plain; everything else still goes through Typer.

Typer 0.29 converts each option's value through a pydantic TypeAdapter, and importing pydantic (40–60 ms)
costs more than the rest of `wcache status`. Defaults, paths, plain digits and exact choice names are converted
here by the same rules (Typer's own path and choice checks run unchanged); every other value, and so every
error message but one, is left to the converter Typer would have used. The one: a path holding a NUL byte
(`--run-dir`, MODEL, any path) is one sentence and exit 2, not Typer's usage text. The hook is Typer's lazily built
per-parameter converter, a private API (pyproject pins `typer<0.30`): if it moves, `plain_first` does nothing
and Typer converts everything itself, as before. tests/test_cli_imports.py compares both converters.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin

from wcache.errors import BadInputError

if TYPE_CHECKING:
    from typer._click import Context

try:
    from typer._coercion import RuntimeParam, TypeDescriptor, build_runtime_param
    from typer._param_types import coerce_cli_choice, coerce_cli_path
    from typer.core import _TyperParameter
except ImportError:  # another Typer: it converts on its own
    RuntimeParam = None  # type: ignore[assignment,misc]

_UNSURE = object()  # not a plain value: Typer's converter decides


def _plain_type(annotation: Any) -> type | None:
    """`X` for `X` and `X | None`; None for anything else (lists, tuples, wider unions)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if isinstance(annotation, type) else None


def _number(value: Any, kind: type, info: Any) -> Any:
    """Ints of ASCII digits, floats of digits[.digits] (what pydantic reads the same way), within the range."""
    if info.clamp:
        return _UNSURE
    if isinstance(value, str) and value.isascii():
        whole, dot, fraction = value.partition(".")
        plain = whole.isdigit() and (not dot or (kind is float and fraction.isdigit()))
        value = kind(value) if plain else value
    # Exact types (a bool is not an int here); kept in a name so the checker does not narrow `value` to object.
    exact = type(value) is kind or (kind is float and type(value) is int)
    if not exact:
        return _UNSURE
    inside = (info.min is None or value >= info.min) and (info.max is None or value <= info.max)
    return kind(value) if inside else _UNSURE


def _plain(kind: type, info: Any, value: Any, param: Any, ctx: Context) -> Any:
    if kind is bool or kind is str:
        return value if type(value) is kind else _UNSURE
    if kind is int or kind is float:
        return _number(value, kind, info)
    if issubclass(kind, enum.Enum):
        try:
            return coerce_cli_choice(value, choices=tuple(kind), case_sensitive=info.case_sensitive, ctx=ctx)
        except ValueError:  # not one of the choices: Typer words the error
            return _UNSURE
    if issubclass(kind, Path) and info.path_type is None and isinstance(value, str | Path):
        # The Path pydantic would make from a str; then Typer's own checks (readable, exists…) run.
        try:
            return coerce_cli_path(kind(value), info, path_type=kind, param=param, ctx=ctx)
        except ValueError:  # a NUL byte, which Typer would answer with its usage text
            if "\0" not in str(value):
                return _UNSURE
            raise BadInputError(f"{_name(param)} {str(value)!r} holds a NUL byte, which no path can hold.") from None
    return _UNSURE


def _name(param: Any) -> str:
    """How the command line names `param`: its longest flag (--run-dir), or an argument's metavar (MODEL)."""
    flags = [o for o in getattr(param, "opts", ()) if o.startswith("-")]
    return max(flags, key=len) if flags else str(getattr(param, "metavar", None) or param.name).upper()


if RuntimeParam is not None:

    @dataclass(frozen=True)
    class _PlainFirst(RuntimeParam):
        """Converts plain values itself and hands the rest to the converter Typer would have built."""

        descriptor: TypeDescriptor

        @cached_property
        def _typer(self) -> Any:
            return build_runtime_param(self.descriptor)

        def _coerce_value(self, value: Any, param: Any, ctx: Context) -> Any:
            kind = _plain_type(self.annotation)
            result = _UNSURE if kind is None else _plain(kind, self.parameter_info, value, param, ctx)
            return self._typer._coerce_value(value, param, ctx) if result is _UNSURE else result


def plain_first(param: Any) -> None:
    """Give one of Typer's options or arguments the plain-value converter (others are left as they are)."""
    descriptor = getattr(param, "type_descriptor", None)
    if RuntimeParam is None or not isinstance(param, _TyperParameter) or descriptor is None:
        return
    if getattr(param, "_runtime_param", _UNSURE) is not None:
        return  # already converting (or not the attribute this Typer version uses)
    if descriptor.file_annotation is not None or descriptor.parameter_info.parser is not None:
        return
    param._runtime_param = _PlainFirst(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation,
                                       descriptor=descriptor)


class PlainValues:
    """Mixed into a Typer command or group class: its parameters, --help included, convert plain values here."""

    params: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            plain_first(param)

    def get_help_option(self, ctx: Context) -> Any:
        # A mixin: the command class after it in the MRO has get_help_option; mypy sees only `object`.
        option = super().get_help_option(ctx)  # type: ignore[misc]
        plain_first(option)
        return option
