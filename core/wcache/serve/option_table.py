"""A saved table of vLLM's server options, built once per installed vLLM, so arguments are checked in milliseconds.

Importing vLLM's parser costs 7-15 s (it imports torch); `wcache serve` must refuse a typo within two seconds.
The table is built by a child process (`python -m wcache.serve.option_table`) from vLLM's own `make_arg_parser`
and saved under the wcache cache dir, keyed by vLLM's version and where and when it was installed: an upgrade
or a reinstall builds it anew. Run as a module, this prints the table as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from wcache.errors import UnavailableError
from wcache.ipc.interpreter import python_module_argv, safe_path_env

# Bumped when the table's fields change, so an old saved table is never read as a new one.
TABLE_FORMAT = 1
BUILD_TIMEOUT_S = 300.0
TABLE_DIR = "vllm-server-options"


class ServerOption(msgspec.Struct, frozen=True):
    """One option of vLLM's server: its flags, where argparse stores it, how many values it takes, their kind."""

    flags: tuple[str, ...]
    dest: str
    nargs: str  # "0" (a switch), "1", "?", "+" or "*"
    kind: str  # "int", "float", "json_or_text" (vLLM keeps what is not a JSON object as text), "text"
    choices: tuple[str, ...] | None = None


class OptionTable(msgspec.Struct, frozen=True):
    """Every option of one installed vLLM's server parser."""

    format: int
    vllm_version: str
    allow_abbrev: bool
    options: tuple[ServerOption, ...]

    def by_flag(self) -> dict[str, ServerOption]:
        return {flag: option for option in self.options for flag in option.flags}


def _kind(action: argparse.Action) -> str:
    kind = getattr(action.type, "__name__", "")
    return {"int": "int", "float": "float", "union_dict_and_str": "json_or_text"}.get(kind, "text")


def _nargs(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "0"
    return "1" if action.nargs is None else str(action.nargs)


def table_of(parser: argparse.ArgumentParser, vllm_version: str) -> OptionTable:
    """The options of `parser` (vLLM's server parser), positional arguments and help left out."""
    options = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        choices = action.choices
        plain = choices is not None and all(isinstance(c, str) or c is None for c in choices)
        options.append(ServerOption(
            flags=tuple(action.option_strings), dest=action.dest, nargs=_nargs(action), kind=_kind(action),
            choices=tuple(c for c in choices if c is not None) if plain and choices is not None else None))
    return OptionTable(TABLE_FORMAT, vllm_version, parser.allow_abbrev, tuple(options))


def installed_vllm() -> tuple[str, Path] | None:
    """The installed vLLM's version and package directory, found without importing it; None without one."""
    from wcache.integrations.vllm.version import installed_version

    version = installed_version()
    spec = importlib.util.find_spec("vllm")
    if version is None or spec is None or spec.origin is None:
        return None
    return version, Path(spec.origin).parent


def table_path(cache_dir: Path, version: str, package: Path) -> Path:
    """Where the table of the vLLM installed in `package` is saved: a reinstall changes its files' times."""
    stamp = "|".join(f"{p}:{p.stat().st_mtime_ns}" for p in (package.resolve() / "__init__.py",))
    digest = hashlib.sha256(f"{TABLE_FORMAT}|{version}|{stamp}".encode()).hexdigest()[:16]
    return cache_dir / TABLE_DIR / f"vllm-{version}-{digest}.json"


def _read(path: Path) -> OptionTable | None:
    try:
        table = msgspec.json.decode(path.read_bytes(), type=OptionTable)
    except (OSError, msgspec.DecodeError):
        return None  # none yet, or unreadable: built again
    return table if table.format == TABLE_FORMAT else None


def _build(env: dict[str, str]) -> OptionTable:
    """Run the child that imports vLLM and prints its table; one sentence when it fails."""
    try:
        done = subprocess.run(python_module_argv(__name__), capture_output=True, text=True, env=safe_path_env(env),
                              timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise UnavailableError(f"reading vLLM's server options took more than {BUILD_TIMEOUT_S:g} s.") from None
    if done.returncode != 0:
        last = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
        raise UnavailableError(f"cannot read vLLM's server options ({last}).")
    try:
        return msgspec.json.decode(done.stdout.strip().splitlines()[-1], type=OptionTable)
    except (IndexError, msgspec.DecodeError) as exc:
        raise UnavailableError(f"vLLM's server options came back unreadable ({exc}).") from None


def load_table(cache_dir: Path, on_build: Callable[[], None] | None = None,
               env: dict[str, str] | None = None) -> OptionTable:
    """The saved table of the installed vLLM, built now (saying so through `on_build`) if there is none yet."""
    from wcache.integrations.vllm.version import check_version

    check_version()  # no vLLM, or one outside the tested range: its sentence
    found = installed_vllm()
    if found is None:
        raise UnavailableError("vLLM's package metadata is installed but its package cannot be found.")
    version, package = found
    path = table_path(cache_dir, version, package)
    table = _read(path)
    if table is not None:
        return table
    if on_build is not None:
        on_build()
    table = _build(dict(os.environ if env is None else env))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole then renamed: two launchers building at once never read half a table.
    with tempfile.NamedTemporaryFile("wb", dir=path.parent, delete=False, prefix=".tmp-") as tmp:
        tmp.write(msgspec.json.encode(table))
    try:
        Path(tmp.name).replace(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            Path(tmp.name).unlink()
    return table


def _main() -> None:
    from wcache.integrations.vllm.api import server_arg_parser
    from wcache.integrations.vllm.version import installed_version

    table = table_of(server_arg_parser(), installed_version() or "unknown")
    sys.stdout.write(json.dumps(msgspec.to_builtins(table)) + "\n")


if __name__ == "__main__":
    _main()
