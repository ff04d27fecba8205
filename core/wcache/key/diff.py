"""Explain how two keys differ: which fields, which plan and config entries, which tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wcache.checkpoint.manifest import TensorDigest
from wcache.key.cache_key import KeyFile

_MISSING = object()


@dataclass(frozen=True, slots=True)
class ValueChange:
    """One named value that differs; `None` on a side means the value is absent there."""

    name: str
    a: Any
    b: Any


@dataclass(frozen=True, slots=True)
class TensorChange:
    """A tensor present on both sides whose dtype, shape or data differ."""

    name: str
    a: TensorDigest
    b: TensorDigest

    @property
    def what(self) -> str:
        parts = [label for label, differs in (
            ("dtype", self.a.dtype != self.b.dtype),
            ("shape", self.a.shape != self.b.shape),
            ("data", self.a.digest != self.b.digest),
        ) if differs]
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class KeyDiff:
    """Everything that separates key `a` from key `b`."""

    fields: tuple[ValueChange, ...]
    plan: tuple[ValueChange, ...]
    config: tuple[ValueChange, ...]
    changed: tuple[TensorChange, ...]
    added: tuple[TensorDigest, ...]
    removed: tuple[TensorDigest, ...]

    @property
    def identical(self) -> bool:
        return not self.fields


def _dict_changes(a: dict[str, Any] | None, b: dict[str, Any] | None) -> tuple[ValueChange, ...]:
    a, b = a or {}, b or {}
    changes = []
    for name in sorted(set(a) | set(b)):
        left, right = a.get(name, _MISSING), b.get(name, _MISSING)
        if left != right:
            changes.append(ValueChange(name, None if left is _MISSING else left,
                                       None if right is _MISSING else right))
    return tuple(changes)


def diff_keys(a: KeyFile, b: KeyFile) -> KeyDiff:
    """Field-level differences, then the plan entries, config entries and tensors behind them."""
    field_changes = tuple(
        ValueChange(name, getattr(a.key, name), getattr(b.key, name)) for name in a.key.mismatched_fields(b.key)
    )
    left = {e.name: e for e in a.manifest}
    right = {e.name: e for e in b.manifest}
    changed = tuple(
        TensorChange(name, left[name], right[name])
        for name in sorted(left.keys() & right.keys())
        if (left[name].dtype, left[name].shape, left[name].digest)
        != (right[name].dtype, right[name].shape, right[name].digest)
    )
    return KeyDiff(
        fields=field_changes,
        plan=_dict_changes(a.plan.to_json(), b.plan.to_json()),
        config=_dict_changes(a.config, b.config),
        changed=changed,
        added=tuple(right[n] for n in sorted(right.keys() - left.keys())),
        removed=tuple(left[n] for n in sorted(left.keys() - right.keys())),
    )
