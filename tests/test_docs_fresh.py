"""The committed man pages and shell completions match the Typer app, and the completions really complete."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

import pytest
import typer
from wcache_cli import docgen
from wcache_cli.app import app

REPO = Path(__file__).resolve().parents[1]
REGENERATE_HINT = "run `python -m wcache_cli.docgen` and commit man/ and completions/"


def run_docgen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wcache_cli.docgen", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for directory in ("man", "completions")
        for p in sorted((root / directory).rglob("*"))
        if p.is_file()
    }


# --- freshness -------------------------------------------------------------------------------------------------


def test_committed_docs_are_fresh() -> None:
    result = run_docgen("--check")
    assert result.returncode == 0, f"man/ or completions/ is stale; {REGENERATE_HINT}.\n{result.stderr}"


def test_regenerating_into_a_fresh_root_reproduces_the_committed_files(tmp_path: Path) -> None:
    first = run_docgen("--root", str(tmp_path))
    assert first.returncode == 0, first.stderr
    generated = tree(tmp_path)
    assert set(generated) == set(docgen.render(app))
    committed = tree(REPO)
    differing = sorted(name for name, data in generated.items() if committed.get(name) != data)
    assert differing == [], f"committed docs differ from a fresh generation: {differing}; {REGENERATE_HINT}."

    # Byte-identical on a rerun: no dates, no versions, no dict-order or environment leaks.
    second = run_docgen("--root", str(tmp_path))
    assert second.returncode == 0
    assert "0 changed" in second.stdout
    assert tree(tmp_path) == generated
    assert run_docgen("--check", "--root", str(tmp_path)).returncode == 0


def test_check_names_stale_missing_and_extra_files_and_writes_nothing(tmp_path: Path) -> None:
    assert run_docgen("--root", str(tmp_path)).returncode == 0
    (tmp_path / "man" / "wcache-key.1").write_text("stale\n")
    (tmp_path / "completions" / "wcache.fish").unlink()
    (tmp_path / "man" / "wcache-removed.1").write_text(".TH OLD 1\n")
    (tmp_path / "man" / "README").write_text("not generated; never called extra\n")
    before = tree(tmp_path)

    result = run_docgen("--check", "--root", str(tmp_path))

    assert result.returncode == 1
    assert "stale:   man/wcache-key.1" in result.stderr
    assert "missing: completions/wcache.fish" in result.stderr
    assert "extra:   man/wcache-removed.1" in result.stderr
    assert "README" not in result.stderr
    assert "python -m wcache_cli.docgen" in result.stderr
    assert tree(tmp_path) == before

    assert run_docgen("--root", str(tmp_path)).returncode == 0
    assert run_docgen("--check", "--root", str(tmp_path)).returncode == 0
    assert not (tmp_path / "man" / "wcache-removed.1").exists()
    assert (tmp_path / "man" / "README").exists()


def test_a_new_command_that_was_not_regenerated_fails_the_check() -> None:
    extended = copy.copy(app)
    extended.registered_commands = list(app.registered_commands)  # leave the real app untouched

    @extended.command("not-a-command-yet")
    def not_a_command_yet() -> None:
        """A command added without regenerating the docs."""

    report = docgen.problems(REPO, docgen.render(extended))
    assert "missing: man/wcache-not-a-command-yet.1" in report
    for stale in ("man/wcache.1", "completions/wcache.bash", "completions/_wcache", "completions/wcache.fish"):
        assert f"stale:   {stale}" in report


# --- a synthetic app that exercises what the real one does not use yet --------------------------------------------


class Color(StrEnum):
    red = "red"
    green = "green"


def synthetic_app(extra_option: bool = False) -> typer.Typer:
    demo = typer.Typer(name="wcache", add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})

    @demo.callback()
    def root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Say more.")] = False) -> None:
        """A synthetic wcache."""

    things = typer.Typer(help="Manage things.")

    @things.command()
    def paint(
        mode: Annotated[Literal["fast", "slow"], typer.Argument(help="How fast.")],
        files: Annotated[list[Path], typer.Argument(help="What to paint.")],
        color: Annotated[Color, typer.Option("--color", "-c", help="Paint colour [sic].")] = Color.red,
        out: Annotated[Path, typer.Option("--out", file_okay=False, help="Output directory.")] = Path(),
        dry: Annotated[bool, typer.Option("--dry/--no-dry", help="Only pretend.")] = False,
        size: Annotated[tuple[int, int], typer.Option("--size", help="Width and height.")] = (1, 2),
    ) -> None:
        """Paint some files.

        'Quoted' paragraphs stay text.

        .dotted ones too: C:\\back\\slash, --flags, header-only.

        \b
        Examples, kept line by line:
          wcache things paint fast a.png
          wcache things paint slow b.png
        """

    demo.add_typer(things, name="things")

    if extra_option:

        @demo.command()
        def plain(
            path: Annotated[Path, typer.Argument(help="A path.")],
            fast: Annotated[bool, typer.Option("--fast", help="Go fast.")] = False,
        ) -> None:
            """Do a plain thing."""

    else:

        @demo.command()
        def plain(path: Annotated[Path, typer.Argument(help="A path.")]) -> None:
            """Do a plain thing."""

    return demo


@pytest.fixture
def synthetic_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")  # apart from workdir, whose files the path tests list
    docgen.write(root, docgen.render(synthetic_app()))
    return root


def test_a_new_option_that_was_not_regenerated_fails_the_check(synthetic_root: Path) -> None:
    assert docgen.problems(synthetic_root, docgen.render(synthetic_app())) == []
    report = docgen.problems(synthetic_root, docgen.render(synthetic_app(extra_option=True)))
    assert report == [
        "stale:   completions/_wcache",
        "stale:   completions/wcache.bash",
        "stale:   completions/wcache.fish",
        "stale:   man/wcache-plain.1",
    ]


def test_nested_groups_get_their_own_pages(synthetic_root: Path) -> None:
    pages = sorted(p.name for p in (synthetic_root / "man").iterdir())
    assert pages == ["wcache-plain.1", "wcache-things-paint.1", "wcache-things.1", "wcache.1"]
    paint = (synthetic_root / "man" / "wcache-things-paint.1").read_text()
    assert "\\fBwcache things paint\\fR [\\fIOPTIONS\\fR] \\fIMODE\\fR \\fIFILES\\fR..." in paint
    assert "One of: \\fBred\\fR, \\fBgreen\\fR. Default: \\fBred\\fR." in paint
    assert "\\fB\\-\\-size\\fR \\fIINT INT\\fR" in paint
    assert "\\fB\\-\\-dry\\fR, \\fB\\-\\-no\\-dry\\fR" in paint


def test_roff_escaping(synthetic_root: Path) -> None:
    page = (synthetic_root / "man" / "wcache-things-paint.1").read_text()
    assert page.isascii()
    lines = page.splitlines()
    assert "\\&'Quoted' paragraphs stay text." in lines
    assert "\\&.dotted ones too: C:\\eback\\eslash, \\-\\-flags, header-only." in lines
    verbatim = lines.index(".nf")
    assert lines[verbatim : verbatim + 5] == [
        ".nf",
        "Examples, kept line by line:",
        "  wcache things paint fast a.png",
        "  wcache things paint slow b.png",
        ".fi",
    ]
    # Only requests and the comment line may start with a dot or an apostrophe.
    requests = ('.\\"', ".TH", ".nh", ".SH", ".PP", ".TP", ".nf", ".fi")
    assert all(line.startswith(requests) for line in lines if line.startswith((".", "'")))


# --- man pages render ---------------------------------------------------------------------------------------------


def man_pages() -> list[Path]:
    return sorted((REPO / "man").glob("*.1"))


def test_every_command_has_a_page() -> None:
    expected = {"wcache.1"} | {f"wcache-{name}.1" for name in typer.main.get_command(app).commands}
    assert {p.name for p in man_pages()} == expected


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
@pytest.mark.parametrize("page", man_pages(), ids=lambda p: p.name)
def test_man_page_renders_without_warnings(page: Path) -> None:
    result = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(page)], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stderr == ""


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_escaped_text_renders_as_written(synthetic_root: Path) -> None:
    page = synthetic_root / "man" / "wcache-things-paint.1"
    result = subprocess.run(
        ["groff", "-man", "-Tascii", "-P-cbou", "-ww", "-rLL=200n", str(page)],
        capture_output=True,
        text=True,
        check=True,
    )
    text = " ".join(result.stdout.split())
    assert result.stderr == ""
    assert "'Quoted' paragraphs stay text. .dotted ones too: C:\\back\\slash, --flags, header-only." in text
    assert "\n       Examples, kept line by line:\n         wcache things paint fast a.png\n" in result.stdout


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
def test_man_renders_the_key_page() -> None:
    result = subprocess.run(
        ["man", "-l", "-P", "cat", str(REPO / "man" / "wcache-key.1")],
        capture_output=True,
        text=True,
        env={**os.environ, "MANWIDTH": "100"},
    )
    assert result.returncode == 0, result.stderr
    assert "wcache-key - Show the content fingerprint" in result.stdout
    for section in ("SYNOPSIS", "DESCRIPTION", "ARGUMENTS", "OPTIONS", "SEE ALSO"):
        assert section in result.stdout


@pytest.mark.skipif(shutil.which("mandoc") is None, reason="mandoc is not installed")
@pytest.mark.parametrize("page", man_pages(), ids=lambda p: p.name)
def test_mandoc_lint(page: Path) -> None:
    result = subprocess.run(["mandoc", "-T", "lint", "-W", "warning", str(page)], capture_output=True, text=True)
    # The date is left empty on purpose, so that regeneration is byte-identical.
    complaints = [line for line in result.stdout.splitlines() if "missing date" not in line]
    assert complaints == []


def test_root_page_documents_exit_codes_and_environment() -> None:
    page = (REPO / "man" / "wcache.1").read_text()
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "OPTIONS", "EXIT STATUS", "ENVIRONMENT", "SEE ALSO"):
        assert f".SH {section}\n" in page
    for code in ("0", "1", "2", "3"):
        assert f".TP\n\\fB{code}\\fR\n" in page
    for variable in ("WCACHE_CACHE_DIR", "WCACHE_RUN_DIR", "WCACHE_DEBUG", "NO_COLOR"):
        assert f".TP\n\\fB{variable}\\fR\n" in page


# --- bash ---------------------------------------------------------------------------------------------------------

BASH_DRIVER = """
source "$1"
shift
COMP_WORDS=("$@")
COMP_CWORD=$(($# - 1))
COMPREPLY=()
_wcache
printf '%s\\n' "${COMPREPLY[@]}"
"""


def bash_complete(script: Path, cwd: Path, *words: str) -> list[str]:
    """What `_wcache` offers for the command line `words`, the last one being the word under the cursor."""
    result = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", BASH_DRIVER, "bash", str(script), *words],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=30,
        check=True,
    )
    assert result.stderr == ""
    return sorted(line for line in result.stdout.splitlines() if line)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny.key").write_text("{}")
    (tmp_path / "other").write_text("")
    return tmp_path


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def model_options(*path: str) -> list[str]:
    command = next(c for c in docgen.command_model(app).walk() if c.path == path)
    return sorted(name for opt in command.options for name in opt.names)


@needs_bash
@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["wcache", "k"], ["key"]),
        (["wcache", "d"], ["demo", "diff"]),
        (["wcache", "-v", "k"], ["key"]),
        (["wcache", "key", "--tp", ""], []),  # free text: nothing sensible to offer
        (["wcache", "key", "--tp", "2", "ti"], ["tiny", "tiny.key"]),
        (["wcache", "key", "--tp=2", "ti"], ["tiny", "tiny.key"]),
        (["wcache", "key", "--tp", "=", "2", "ti"], ["tiny", "tiny.key"]),  # "=" as its own word (COMP_WORDBREAKS)
        (["wcache", "diff", "tiny.key", "ti"], ["tiny", "tiny.key"]),
        (["wcache", "demo", "--dir", "t"], ["tiny", "tiny.key"]),
        (["wcache", "key", "--", "-"], []),  # after -- everything is positional, and key's one argument is taken
    ],
)
def test_bash_completes_the_real_app(workdir: Path, words: list[str], expected: list[str]) -> None:
    assert bash_complete(REPO / "completions" / "wcache.bash", workdir, *words) == expected


@needs_bash
def test_bash_completes_options_from_the_model(workdir: Path) -> None:
    script = REPO / "completions" / "wcache.bash"
    assert bash_complete(script, workdir, "wcache", "") == sorted(typer.main.get_command(app).commands)
    assert bash_complete(script, workdir, "wcache", "-") == model_options()
    key_t = bash_complete(script, workdir, "wcache", "key", "--t")
    assert {"--tp", "--tensors"} <= set(key_t)
    assert key_t == [name for name in model_options("key") if name.startswith("--t")]
    # Once the positionals are filled, only options can follow.
    assert bash_complete(script, workdir, "wcache", "key", "tiny", "") == model_options("key")
    assert bash_complete(script, workdir, "wcache", "diff", "a", "b", "") == model_options("diff")


@needs_bash
@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["wcache", "th"], ["things"]),
        (["wcache", "things", ""], ["paint"]),
        (["wcache", "things", "paint", ""], ["fast", "slow"]),
        (["wcache", "things", "paint", "--color", ""], ["green", "red"]),
        (["wcache", "things", "paint", "-c", "g"], ["green"]),
        (["wcache", "things", "paint", "--color", "=", "g"], ["green"]),
        (["wcache", "things", "paint", "--color=g"], ["--color=green"]),
        (["wcache", "things", "paint", "--out", ""], ["tiny"]),  # directories only
        (["wcache", "things", "paint", "--size", "1", ""], []),  # the second of two values
        (["wcache", "things", "paint", "--size", "1", "2", "f"], ["fast"]),
        (["wcache", "things", "paint", "fast", "o"], ["other"]),  # the variadic path argument
        (["wcache", "things", "paint", "fast", "other", "t"], ["tiny", "tiny.key"]),
        (["wcache", "things", "paint", "--no-"], ["--no-dry"]),
    ],
)
def test_bash_completes_groups_choices_and_arities(
    synthetic_root: Path, workdir: Path, words: list[str], expected: list[str]
) -> None:
    assert bash_complete(synthetic_root / "completions" / "wcache.bash", workdir, *words) == expected


# --- zsh and fish (optional: `apt-get install zsh fish`) -------------------------------------------------------


needs_zsh = pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
needs_fish = pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")


@needs_zsh
def test_zsh_syntax() -> None:
    subprocess.run(["zsh", "-n", str(REPO / "completions" / "_wcache")], check=True, timeout=30)


@needs_fish
def test_fish_syntax() -> None:
    subprocess.run(["fish", "-n", str(REPO / "completions" / "wcache.fish")], check=True, timeout=30)


FISH_DRIVER = """
source $argv[1]
for line in $argv[2..-1]
    echo "<line>"
    complete -C"$line" | string replace -r '\\t.*' ''
end
"""


def fish_complete(script: Path, cwd: Path, *lines: str) -> dict[str, list[str]]:
    """fish's own completion engine (`complete -C`) on each command line."""
    result = subprocess.run(
        ["fish", "--no-config", "-c", FISH_DRIVER, str(script), *lines],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=True,
        env={**os.environ, "HOME": str(cwd)},
    )
    answers = result.stdout.split("<line>\n")[1:]
    return {line: sorted(a.split()) for line, a in zip(lines, answers, strict=True)}


@needs_fish
def test_fish_completes(workdir: Path, synthetic_root: Path) -> None:
    real = fish_complete(
        REPO / "completions" / "wcache.fish",
        workdir,
        "wcache k",
        "wcache key --t",
        "wcache key --tp ",
        "wcache key --tp 2 ti",
        "wcache -v k",
    )
    assert real["wcache k"] == ["key"]
    assert {"--tp", "--tensors"} <= set(real["wcache key --t"])
    assert real["wcache key --tp "] == []
    assert real["wcache key --tp 2 ti"] == ["tiny.key", "tiny/"]
    assert real["wcache -v k"] == ["key"]

    synthetic = fish_complete(
        synthetic_root / "completions" / "wcache.fish",
        workdir,
        "wcache things ",
        "wcache things paint --color ",
        "wcache things paint --out ",
    )
    assert synthetic["wcache things "] == ["paint"]
    assert synthetic["wcache things paint --color "] == ["green", "red"]
    assert synthetic["wcache things paint --out "] == ["tiny/"]


ZSH_DRIVER = r"""
# Drive real zsh completion in a pseudo-terminal: every match compadd receives is logged to $out.
zmodload zsh/zpty
dir=$1 out=$2
shift 2
zpty z zsh -f -i
zpty -w z "PS1=''; fpath=(${(q)dir} \$fpath); autoload -U compinit; compinit -u -D"
zpty -w z "compadd() { local -a hits; builtin compadd -O hits \"\$@\"; \
  print -rl -- \"\${hits[@]}\" >> ${(q)out}; builtin compadd \"\$@\" }"
zpty -w z "_probe() { zle complete-word; print -r -- '<done>' >> ${(q)out} }; zle -N _probe; bindkey '^X' _probe"
for line in "$@"; do
  : > $out
  zpty -w -n z "$line"$'\C-x'
  for i in {1..400}; do grep -q '^<done>$' $out && break; sleep 0.05; done
  zpty -w -n z $'\C-u\C-g'
  print -r -- '<line>'
  grep -v '^<done>$' $out
done
zpty -d z
"""


def zsh_complete(directory: Path, cwd: Path, *lines: str) -> dict[str, list[str]]:
    """zsh's own completion system (compinit, _arguments) on each command line."""
    driver = cwd / "driver.zsh"
    driver.write_text(ZSH_DRIVER)
    result = subprocess.run(
        ["zsh", "-f", str(driver), str(directory), str(cwd / "matches"), *lines],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=True,
    )
    answers = result.stdout.split("<line>\n")[1:]
    return {line: sorted(set(a.split())) for line, a in zip(lines, answers, strict=True)}


@needs_zsh
def test_zsh_completes(tmp_path: Path, synthetic_root: Path) -> None:
    real = zsh_complete(REPO / "completions", tmp_path, "wcache k", "wcache ", "wcache key --t", "wcache -v d")
    assert real["wcache k"] == ["key"]
    assert real["wcache "] == sorted(typer.main.get_command(app).commands)
    assert {"--tp", "--tensors"} <= set(real["wcache key --t"])
    assert real["wcache -v d"] == ["demo", "diff"]

    synthetic = zsh_complete(
        synthetic_root / "completions", tmp_path, "wcache things ", "wcache things paint ", "wcache things paint -c "
    )
    assert synthetic["wcache things "] == ["paint"]
    assert synthetic["wcache things paint "] == ["fast", "slow"]
    assert synthetic["wcache things paint -c "] == ["green", "red"]
