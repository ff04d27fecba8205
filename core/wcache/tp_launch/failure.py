"""A rank's failure as the caller reports it: the rank's own wcache error class, or one TensorParallelError sentence.

Errors cross as names and text, never as pickled exceptions: unpickling an exception would call its constructor
with its args, which breaks for errors with extra arguments and would run any class a rank names.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from typing import Any

from wcache.errors import UnavailableError, WcacheError, marked


class TensorParallelError(UnavailableError):
    """A rank crashed, died or did not finish in time; every rank was stopped. Its traceback is a note."""


@dataclass(frozen=True, slots=True)
class Failure:
    rank: int
    at: float  # time.time() when it failed (the rank's own clock reading, or when the caller noticed)
    silent: bool  # died without sending anything: a crash, a kill, os._exit
    text: str  # what happened, to follow "tensor-parallel rank N "
    error_classes: tuple[str, ...] = ()  # a wcache error's class path and its wcache bases', most derived first
    message: str = ""  # that error's own message
    detail: str = ""  # the rank's traceback

    def order(self) -> tuple[bool, float]:
        # A silent death is almost always a cause (a rank whose peer vanished raises, it does not vanish);
        # among raised errors the earliest is the cause, the later ones its echo in the other ranks.
        return (not self.silent, self.at)


def describe(exc: BaseException) -> dict[str, Any]:
    """A rank's error as plain strings (call it where `exc` is being handled: it takes the traceback)."""
    classes = [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__
               if isinstance(c, type) and issubclass(c, WcacheError)]
    message = marked(exc)  # options still marked: the caller words them for its user
    lines = message.strip().splitlines()
    summary = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return {"error_classes": classes, "message": message, "summary": summary,
            "traceback": traceback.format_exc()}


def failure_from_report(rank: int, at: float, report: Any) -> Failure:
    """A rank's error report (see `describe`) as a failure; a report of another shape is itself the failure."""
    if not isinstance(report, dict):
        return Failure(rank, at, False, f"sent an error report the launcher cannot read: {report!r}"[:500])
    classes = report.get("error_classes", ())
    text = str(report.get("summary", "failed"))
    return Failure(rank, at, False, f"failed: {text}", tuple(str(c) for c in classes),
                   str(report.get("message", "")), str(report.get("traceback", "")))


def first_failure(failures: list[Failure]) -> tuple[Failure, list[int]]:
    """The failure that came first (the one to report) and the ranks that failed after it."""
    first = min(failures, key=Failure.order)
    return first, sorted(f.rank for f in failures if f is not first)


def also_failed(others: list[int]) -> str:
    return f" (rank {', '.join(map(str, others))} failed too)" if others else ""


def error_for(failure: Failure, others: list[int]) -> WcacheError:
    """The exception the caller sees: the rank's own wcache error class if it had one, else one sentence."""
    also = also_failed(others)
    error: WcacheError | None = None
    for path in failure.error_classes:
        cls = _wcache_error_class(path)
        if cls is not None:
            # Built without calling the class's constructor: some take more than a message (a report, a log).
            error = cls.__new__(cls)
            Exception.__init__(error, failure.message)
            break
    if error is None:
        error = TensorParallelError(f"tensor-parallel rank {failure.rank} {failure.text.rstrip('.')}{also}.")
    if failure.detail:
        error.add_note(f"raised on tensor-parallel rank {failure.rank}{also}:\n{failure.detail.rstrip()}")
    return error


def _wcache_error_class(path: str) -> type[WcacheError] | None:
    """The WcacheError subclass named "module.Class" if it is one of wcache's own; None for anything else."""
    module_name, _, name = path.rpartition(".")
    if module_name != "wcache" and not module_name.startswith("wcache."):
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    cls = getattr(module, name, None)
    if isinstance(cls, type) and issubclass(cls, WcacheError) and cls.__module__ == module_name:
        return cls
    return None
