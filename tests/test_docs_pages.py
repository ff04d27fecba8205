"""The README and the pages under docs/: every link resolves inside the repository, the commands page names only
commands and options the CLI has (and every command), and CI runs the README's test command verbatim."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from wcache_cli.app import app

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "benchmarks" / "README.md",
                REPO / "deploy" / "README.md"])
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^()\s]+)\)")


def prose(page: Path) -> str:
    """The page without fenced blocks and code spans, where `](` is text, not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page)) if not re.match(r"[a-z]+://|mailto:", target)]


def test_the_pages_link_to_each_other() -> None:
    readme = set(links(REPO / "README.md"))
    docs = {f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")}
    assert docs and docs <= readme, f"README.md links to none of {sorted(docs - readme)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if target.startswith("/") or not resolved.is_relative_to(REPO):
            broken.append(f"{target}: outside the repository")
        elif not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_page_names_a_path_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    outside = re.findall(r"(?<![\w.~])/(?:work|home|root|Users|mnt)/\S*|\.\./shared\S*", text)
    assert outside == []


# --- the commands page against the CLI ------------------------------------------------------------------------


def cli_options() -> dict[str, set[str]]:
    """Each command's option names, the root's global ones included."""
    root = typer.main.get_command(app)
    shared = {name for param in root.params for name in (*param.opts, *param.secondary_opts)}
    return {name: shared | {option for param in command.params if param.param_type_name == "option"
                            for option in (*param.opts, *param.secondary_opts)}
            for name, command in root.commands.items()}  # type: ignore[attr-defined]


def command_rows() -> list[str]:
    """The first cell of each row of docs/commands.md's table of commands."""
    text = (REPO / "docs" / "commands.md").read_text()
    return [line.split(" | ")[0].removeprefix("| ") for line in text.splitlines()
            if line.startswith("| `wcache ")]


def test_the_commands_page_names_every_command() -> None:
    named = {word for row in command_rows() for word in re.findall(r"`wcache ([a-z-]+)", row)}
    assert named == set(cli_options())


@pytest.mark.parametrize("row", command_rows(), ids=lambda row: row.split()[1].strip("`"))
def test_every_option_on_the_commands_page_exists(row: str) -> None:
    options = cli_options()
    # A cell may show several forms of one command (`wcache delta OLD NEW` / `wcache delta --apply …`).
    for form in re.findall(r"`wcache ([a-z-]+)([^`]*)`((?: / `[^`]*`| \[`[^`]*`\])*)", row):
        command, rest = form[0], form[1] + form[2]
        unknown = sorted(set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", rest)) - options[command])
        assert unknown == [], f"wcache {command} has no {unknown}"


# --- the processing plan's page against the code --------------------------------------------------------------


def test_the_plan_page_names_every_module_of_plan_and_every_spec_field() -> None:
    from wcache.plan.spec import PlanSpec

    text = (REPO / "docs" / "plan.md").read_text()
    first_cells = {line.split(" | ")[0].removeprefix("| ").strip("`") for line in text.splitlines()
                   if line.startswith("| `")}
    modules = {path.name for path in (REPO / "core" / "wcache" / "plan").glob("*.py") if path.name != "__init__.py"}
    assert modules <= first_cells
    assert set(PlanSpec.__struct_fields__) <= first_cells
    assert "plan.md" in links(REPO / "docs" / "layout.md")


# --- the quick start ------------------------------------------------------------------------------------------


def quick_start() -> list[str]:
    section = (REPO / "README.md").read_text().split("## Quick start\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    return block.group(1).splitlines()


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    demo, suite = quick_start()
    assert suite in (REPO / ".ci" / "run").read_text().splitlines()
    assert shlex.split(demo)[-2:] == [".venv/bin/wcache", "demo"]
