"""Explain how two keys differ: which fields, which plan and config entries, which tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from wcache.checkpoint.companions import is_companion
from wcache.checkpoint.manifest import TensorDigest
from wcache.key.cache_key import KeyFile
from wcache.schema import Record

_MISSING = object()
Side = TypeVar("Side")
# How many tensor names of each kind (changed, added, removed) a compact diff keeps; the counts stay whole.
MAX_DIFF_TENSORS_IN_EVENT = 50


@dataclass(frozen=True, slots=True)
class Change(Generic[Side]):
    """One named thing that differs, as key `a` and key `b` have it."""

    name: str
    a: Side
    b: Side


# A named value (a key field, a plan or config entry, a tokenizer file's SHA-256); `None` on a side means the value
# is absent there.
ValueChange = Change[Any]


class TensorChange(Change[TensorDigest]):
    """A tensor present on both sides whose dtype, shape or data differ."""

    __slots__ = ()

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
    tokenizer: tuple[ValueChange, ...]  # by file name: its SHA-256 on each side (None: absent there)
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
            changes.append(Change(name, None if left is _MISSING else left,
                                       None if right is _MISSING else right))
    return tuple(changes)


def _tokenizer_files(key_file: KeyFile) -> dict[str, Any]:
    return {f.name: f.sha256 for f in key_file.companions if is_companion(f.name)}


def diff_keys(a: KeyFile, b: KeyFile) -> KeyDiff:
    """Field-level differences, then the plan entries, config entries and tensors behind them."""
    field_changes = tuple(
        Change(name, getattr(a.key, name), getattr(b.key, name)) for name in a.key.mismatched_fields(b.key)
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
        tokenizer=_dict_changes(_tokenizer_files(a), _tokenizer_files(b)),
        changed=changed,
        added=tuple(right[n] for n in sorted(right.keys() - left.keys())),
        removed=tuple(left[n] for n in sorted(left.keys() - right.keys())),
    )


class DiffSummary(Record, frozen=True, omit_defaults=False):
    """A key diff, compact: which fields differ, and the first tensors of each kind with their counts.

    A `Record` (unknown fields skipped) because it is also a field of the `attach_miss` event, and logs outlive
    versions; every field is written, even when empty. Lists, as the event's other fields: its plain form is
    what reading the log back gives.
    """

    fields: list[str] = msgspec.field(default_factory=list)
    # name → [the daemon's value, this checkpoint's]
    plan: dict[str, list[Any]] = msgspec.field(default_factory=dict)
    config: list[str] = msgspec.field(default_factory=list)
    tokenizer: list[str] = msgspec.field(default_factory=list)  # the tokenizer files that differ, by name
    changed: list[str] = msgspec.field(default_factory=list)
    added: list[str] = msgspec.field(default_factory=list)
    removed: list[str] = msgspec.field(default_factory=list)
    num_changed: int = 0
    num_added: int = 0
    num_removed: int = 0


def diff_summary(diff: KeyDiff) -> DiffSummary:
    """A compact diff for events and reports: at most `MAX_DIFF_TENSORS_IN_EVENT` names of each kind."""
    return DiffSummary(
        fields=[c.name for c in diff.fields], plan={c.name: [c.a, c.b] for c in diff.plan},
        config=[c.name for c in diff.config], tokenizer=[c.name for c in diff.tokenizer],
        changed=[c.name for c in diff.changed[:MAX_DIFF_TENSORS_IN_EVENT]],
        added=[e.name for e in diff.added[:MAX_DIFF_TENSORS_IN_EVENT]],
        removed=[e.name for e in diff.removed[:MAX_DIFF_TENSORS_IN_EVENT]],
        num_changed=len(diff.changed), num_added=len(diff.added), num_removed=len(diff.removed))
