"""The package structure docs/layout.md describes: which part of wcache may import which.

Imports are read from the source (every `import`/`from` statement, including the lazy ones inside
functions), so a new dependency that breaks the layering fails here before it becomes a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "wcache"
CLI = ROOT / "cli" / "wcache_cli"

# Each part of core and the parts it may import (besides itself). Lower layers never import higher ones.
FOUNDATION = {"_version", "errors", "canonical", "lazy_exports", "schema", "bounded_read"}
ALLOWED: dict[str, set[str]] = {
    "_version": set(),
    "errors": set(),
    "schema": set(),
    "canonical": set(),
    "lazy_exports": set(),
    "bounded_read": set(),
    "attach_options": {"errors", "schema"},
    "checkpoint": FOUNDATION,
    "plan": FOUNDATION | {"checkpoint"},
    "key": FOUNDATION | {"checkpoint", "plan"},
    "ipc": FOUNDATION | {"checkpoint", "plan", "key"},
    "monitor": FOUNDATION | {"checkpoint", "plan", "ipc", "key"},
    "load": FOUNDATION | {"checkpoint", "plan", "key", "ipc"},
    "delta": FOUNDATION | {"checkpoint", "plan", "key", "load", "ipc"},
    "daemon": FOUNDATION | {"checkpoint", "plan", "key", "load", "ipc", "monitor", "attach_options", "delta"},
    "daemon_choice": FOUNDATION | {"plan", "key", "ipc"},
    # doctor reads vLLM's supported range from its one owner, `integrations.vllm.version` (which imports errors).
    "doctor": FOUNDATION | {"key", "ipc", "integrations"},
    "attach": FOUNDATION | {"checkpoint", "plan", "key", "load", "ipc", "monitor", "attach_options", "daemon_choice"},
    # The engine's core never imports its serving side (`serving`) or the rank launcher (`tp_launch`).
    "engine": FOUNDATION | {"checkpoint", "plan", "key", "load", "attach", "attach_options"},
    "tp_launch": FOUNDATION | {"engine"},
    "serving": FOUNDATION | {"checkpoint", "plan", "key", "load", "ipc", "monitor", "attach", "attach_options",
                             "daemon_choice", "engine"},
    "integrations": FOUNDATION | {"checkpoint", "plan", "key", "load", "ipc", "monitor", "attach",
                                  "attach_options", "daemon_choice", "engine", "tp_launch"},
    "verify": FOUNDATION | {"checkpoint", "plan", "key", "load", "ipc", "monitor", "attach", "attach_options",
                            "daemon_choice", "engine", "tp_launch", "integrations"},
    # A served vLLM, over HTTP: switched through its endpoints and verified against a vLLM disk load.
    "vllm_served": FOUNDATION | {"checkpoint", "plan", "key", "ipc", "monitor", "daemon_choice", "serving",
                                 "integrations", "verify"},
    "verify_served": FOUNDATION | {"plan", "key", "load", "ipc", "engine", "serving", "integrations", "verify",
                                   "vllm_served"},
    # `wcache serve`: vLLM's options and plan (from children that import vLLM), the daemons, the supervision.
    # `--follow` moves the server through the switch `wcache switch URL` runs.
    "serve": FOUNDATION | {"checkpoint", "plan", "key", "ipc", "daemon", "attach_options", "integrations",
                           "serving", "vllm_served"},
}


def _imports(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            # `from wcache import x` names a part directly
            if node.module == "wcache":
                yield from (f"wcache.{alias.name}" for alias in node.names)


def _part(module: str) -> str | None:
    """The part of core a dotted module name belongs to (`wcache.key.diff` → `key`), None outside core."""
    parts = module.split(".")
    return parts[1] if parts[0] == "wcache" and len(parts) > 1 else None


def _core_files() -> Iterator[tuple[str, Path]]:
    for path in sorted(CORE.rglob("*.py")):
        relative = path.relative_to(CORE)
        if relative.parts == ("__init__.py",):
            continue  # the public API re-exports every part
        yield (relative.parts[0].removesuffix(".py"), path)


def test_every_part_of_core_is_placed() -> None:
    assert {part for part, _ in _core_files()} == set(ALLOWED)


@pytest.mark.parametrize(("part", "path"), list(_core_files()), ids=lambda v: str(v).rsplit("core/", 1)[-1])
def test_core_imports_follow_the_layers(part: str, path: Path) -> None:
    wrong = sorted({module for module in _imports(path)
                    if (target := _part(module)) is not None and target != part and target not in ALLOWED[part]})
    assert wrong == [], f"{part} may not import {wrong}"
    # The package root re-exports every part, so a part importing it (`import wcache`, `from wcache import x`)
    # reaches every layer above its own.
    assert "wcache" not in set(_imports(path)), "the library imports its parts, never the package root"
    outside = sorted({m for m in _imports(path) if m.split(".")[0] in {"wcache_cli", "wcache_dev"}})
    assert outside == [], "the library never imports the CLI or the dev helpers"


def test_the_cli_reaches_dev_helpers_only_for_the_demo() -> None:
    users = sorted(str(path.relative_to(CLI)) for path in CLI.rglob("*.py")
                   if any(m.split(".")[0] == "wcache_dev" for m in _imports(path)))
    assert users == ["commands/demo.py"]


def test_package_inits_import_no_part_eagerly() -> None:
    """Sub-package `__init__`s hold a docstring (and lazy exports), so importing one part loads no other."""
    for init in sorted(CORE.glob("*/__init__.py")):
        tree = ast.parse(init.read_text())
        eager = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
                 and not (isinstance(node, ast.ImportFrom) and node.module in {"__future__", "typing",
                                                                                 "wcache.lazy_exports"})]
        assert eager == [], f"{init.relative_to(ROOT)} imports eagerly"


def _module(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Which module of core imports which (lazy imports included; a package's `__init__` is not followed)."""
    modules = {_module(path): path for path in CORE.rglob("*.py") if path.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The groups of two or more modules that reach each other through imports (strongly connected)."""
    reach = {name: set() for name in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            name = todo.pop()
            if name not in reach[start]:
                reach[start].add(name)
                todo.extend(graph[name])
    groups = {frozenset({name, *(other for other in reach[name] if name in reach[other])}) for name in graph}
    return [group for group in groups if len(group) > 1]


def test_no_modules_import_each_other_in_a_cycle() -> None:
    assert not list(_cycles(_module_graph()))


def test_an_engines_side_of_the_arena_imports_nothing_of_the_daemons() -> None:
    """`ipc.arenas.daemon_side` makes, fills and seals arenas (torch-free); `ipc.arenas.engine_side` maps and views
    them. The daemon's side may borrow the engine's dtype lookup for its own views, never the other way round, and
    asks `ipc.arenas.backing` where its arenas live (memfds, or the directory an operator named)."""
    graph = _module_graph()
    daemon_side, engine_side = "wcache.ipc.arenas.daemon_side", "wcache.ipc.arenas.engine_side"
    backing = "wcache.ipc.arenas.backing"
    assert daemon_side not in graph[engine_side] and backing not in graph[engine_side]
    assert graph[daemon_side] <= {"wcache.errors", engine_side, "wcache.ipc.wire.messages", backing}
    assert graph[backing] <= {"wcache.errors"}


# The sub-packages of ipc and what of ipc each may import (besides itself).
IPC_ALLOWED: dict[str, set[str]] = {
    "wire": set(),
    "http": set(),
    "interpreter": set(),
    "attach_summary": set(),
    "run_dir": {"wire", "attach_summary"},
    "arenas": {"wire"},
}


def test_ipc_sub_packages_import_one_way() -> None:
    ipc = CORE / "ipc"
    modules = [path for path in ipc.rglob("*.py") if path != ipc / "__init__.py"]
    sub = {path: path.relative_to(ipc).parts[0].removesuffix(".py") for path in modules}
    assert set(sub.values()) == set(IPC_ALLOWED)
    wrong = sorted(f"{sub[path]} imports {module}" for path in modules for module in _imports(path)
                   if module.startswith("wcache.ipc.")
                   and module.split(".")[2] not in {sub[path], *IPC_ALLOWED[sub[path]]})
    assert wrong == []


def test_shared_placement_imports_no_engine() -> None:
    """`integrations.placement` is torch only, so any engine's loader can borrow it without importing vLLM."""
    placement = CORE / "integrations" / "placement.py"
    assert {m.split(".")[0] for m in _imports(placement)} <= {"__future__", "contextlib", "collections", "torch"}
