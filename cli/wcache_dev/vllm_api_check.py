"""Check vLLM's private API that wcache uses against other vLLM releases' source, without importing them.

    python -m wcache_dev.vllm_api_check /tmp/vllm-wheels/vllm-0.34.0-*.whl [DIR_OR_WHEEL ...]

The baseline is the installed vLLM (the one the tests ran). For each wheel (or unpacked directory holding
`vllm/`) it prints, fact by fact, what holds and what differs: every name `wcache.integrations.vllm.api` and
the plugin import (read from their source, so the list never goes stale), the signatures wcache calls, and
the bodies whose steps the loader repeats (`BaseModelLoader.load_model`'s template,
`process_weights_after_loading`) and the reload and weight-update APIs a switch runs. Exit status 1 when
anything differs: read the differences before widening `wcache.integrations.vllm.version.TESTED_RANGE`.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import wcache.integrations

INTEGRATIONS = Path(wcache.integrations.__file__).parent
# Modules of wcache whose `from vllm… import` statements are the names wcache needs.
USERS = ("vllm/api.py", "vllm/version.py")
# (module, qualified name): callables whose signatures wcache relies on.
SIGNATURES = (
    ("vllm.model_executor.model_loader.utils", "initialize_model"),
    ("vllm.model_executor.model_loader.utils", "process_weights_after_loading"),
    ("vllm.model_executor.model_loader.utils", "get_model_architecture"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.__init__"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.load_model"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.download_model"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.load_weights"),
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader.load_weights"),
    ("vllm.model_executor.model_loader", "register_model_loader"),
    ("vllm.utils.torch_utils", "set_default_torch_dtype"),
    ("vllm.v1.worker.gpu_worker", "Worker.reload_weights"),
    ("vllm.v1.worker.gpu_worker", "Worker.update_config"),
    ("vllm.entrypoints.llm", "LLM.collective_rpc"),
    ("vllm.entrypoints.llm", "LLM.reset_prefix_cache"),
)
# Bodies whose steps wcache's loader repeats or relies on: any change is worth a read.
BODIES = (
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.load_model"),
    ("vllm.model_executor.model_loader.utils", "process_weights_after_loading"),
    ("vllm.model_executor.model_loader.utils", "initialize_model"),
)


@dataclass(frozen=True, slots=True)
class Source:
    """One vLLM release's Python source: a wheel or a directory holding `vllm/`."""

    label: str
    root: Path | None
    wheel: zipfile.ZipFile | None

    def read(self, module: str) -> str | None:
        for relative in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
            if self.wheel is not None:
                try:
                    return self.wheel.read(relative).decode()
                except KeyError:
                    continue
            elif self.root is not None and (self.root / relative).is_file():
                return (self.root / relative).read_text()
        return None


def open_source(text: str) -> Source:
    path = Path(text)
    if path.suffix == ".whl":
        return Source(path.name, None, zipfile.ZipFile(path))
    if (path / "vllm").is_dir():
        return Source(str(path), path, None)
    raise SystemExit(f"{text} is neither a wheel nor a directory holding vllm/.")


def installed() -> Source:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("no vLLM is installed to compare against.")
    return Source("installed", Path(spec.origin).parent.parent, None)


def needed_names() -> list[tuple[tuple[str, str], ...]]:
    """Every `from vllm… import name` in wcache's vLLM fence, as alternatives: one name imported in the branches
    of a `try: … except ImportError: …` (one release's home of it, then another's) is one need, met by any."""
    needs: set[tuple[tuple[str, str], ...]] = set()
    for user in USERS:
        tree = ast.parse((INTEGRATIONS / user).read_text())
        grouped: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
                branches = [node.body, *(h.body for h in node.handlers if _catches_import_error(h))]
                imports = [(i, _vllm_module(i)) for branch in branches for i in branch if _vllm_module(i)]
                grouped.update(id(i) for i, _ in imports)
                homes: dict[str, set[tuple[str, str]]] = {}
                for statement, module in imports:
                    for alias in statement.names:  # type: ignore[attr-defined]
                        homes.setdefault(alias.name, set()).add((module, alias.name))
                needs.update(tuple(sorted(alternatives)) for alternatives in homes.values())
        for node in ast.walk(tree):
            module = _vllm_module(node)
            if module and id(node) not in grouped:
                needs.update(((module, alias.name),) for alias in node.names)  # type: ignore[attr-defined]
    return sorted(needs)


def _vllm_module(node: ast.AST) -> str:
    """The vLLM module a `from vllm… import` statement reads, or "" for any other node."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
        return node.module
    return ""


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    return isinstance(handler.type, ast.Name) and handler.type.id in {"ImportError", "ModuleNotFoundError"}


def _defines(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    # A lazy package (`__getattr__` over a table of names) lists the name as a string.
    return any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree))


def provides(source: Source, module: str, name: str, depth: int = 3) -> bool:
    """Whether `module` of `source` defines or imports `name`, following its `from .x import *`."""
    text = source.read(module)
    if text is None:
        return False
    if source.read(f"{module}.{name}") is not None:  # `from package import submodule`
        return True
    tree = ast.parse(text)
    if _defines(tree, name):
        return True
    package = module if _is_package(source, module) else module.rpartition(".")[0]
    stars = [n for n in tree.body if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)]
    for star in stars if depth else []:
        target = star.module or ""
        if star.level:
            base = package.split(".")[: len(package.split(".")) - (star.level - 1)]
            target = ".".join([*base, *([star.module] if star.module else [])])
        if provides(source, target, name, depth - 1):
            return True
    return False


def _is_package(source: Source, module: str) -> bool:
    relative = module.replace(".", "/") + "/__init__.py"
    if source.wheel is not None:
        return relative in source.wheel.namelist()
    return source.root is not None and (source.root / relative).is_file()


def _find(tree: ast.Module, qualified: str) -> ast.AST | None:
    scope: list[ast.stmt] = tree.body
    found: ast.AST | None = None
    for part in qualified.split("."):
        found = next((n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                      and n.name == part), None)
        if found is None:
            return None
        scope = found.body
    return found


def signature(source: Source, module: str, qualified: str) -> str | None:
    text = source.read(module)
    node = _find(ast.parse(text), qualified) if text is not None else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    return f"{qualified}({ast.unparse(node.args)})"


def body(source: Source, module: str, qualified: str) -> list[str] | None:
    text = source.read(module)
    node = _find(ast.parse(text), qualified) if text is not None else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    node.body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return ast.unparse(node).splitlines()


def differences(base: Source, other: Source) -> Iterator[tuple[bool, str]]:
    """(holds, one line) per fact."""
    for alternatives in needed_names():
        holds = any(provides(other, module, name) for module, name in alternatives)
        names = " or ".join(f"{module}.{name}" for module, name in alternatives)
        yield holds, f"name {names}" + ("" if holds else ": missing")
    for module, qualified in SIGNATURES:
        mine, theirs = signature(base, module, qualified), signature(other, module, qualified)
        yield mine == theirs, (f"signature {module}.{qualified}" if mine == theirs else
                               f"signature {module}.{qualified}: {mine} → {theirs}")
    for module, qualified in BODIES:
        mine_body, theirs_body = body(base, module, qualified), body(other, module, qualified)
        if mine_body == theirs_body:
            yield True, f"body {module}.{qualified}"
            continue
        diff = difflib.unified_diff(mine_body or [], theirs_body or [], base.label, other.label, lineterm="", n=1)
        yield False, f"body {module}.{qualified} changed:\n    " + "\n    ".join(list(diff)[2:])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    base = installed()
    differs = 0
    for text in argv:
        other = open_source(text)
        print(f"== {other.label} against the installed vLLM")
        for holds, line in differences(base, other):
            print(f"  {'holds  ' if holds else 'DIFFERS'} {line}")
            differs += not holds
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
