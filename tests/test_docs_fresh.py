"""The committed man pages and completion scripts match the app, the pages render, and real shells complete.

The doc tools (groff, man, mandoc, bash, zsh, fish) are optional here: a test whose tool is missing skips,
unless WCACHE_REQUIRE_DOC_TOOLS is set (CI sets it after installing them), when it fails instead.
"""

from __future__ import annotations

import copy
import os
import pty
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

import pytest
import typer
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives  # noqa: F401
from wcache_cli.app import app
from wcache_cli.choices import Dtype, Mode
from wcache_cli.commands.completion import SHELLS
from wcache_dev import docgen

REPO = Path(__file__).resolve().parents[1]
REGENERATE_HINT = "run `python -m wcache_dev.docgen` and commit man/ and completions/"


def tool(name: str) -> str:
    """The path of an external tool; skip the test without it, or fail it under WCACHE_REQUIRE_DOC_TOOLS."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("WCACHE_REQUIRE_DOC_TOOLS", "") not in ("", "0"):
            pytest.fail(f"{name} is not installed, and WCACHE_REQUIRE_DOC_TOOLS is set.")
        pytest.skip(f"{name} is not installed")
    return path


def run_docgen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wcache_dev.docgen", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for directory in ("man", "completions")
        for p in sorted((root / directory).rglob("*"))
        if p.is_file()
    } | {docgen.JSON_OUTPUTS_PAGE: (root / docgen.JSON_OUTPUTS_PAGE).read_bytes()}


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
    assert "python -m wcache_dev.docgen" in result.stderr
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
    assert "stale:   man/wcache.1" in report
    # The scripts ask `wcache` for every candidate, so a new command changes none of them.
    assert not [line for line in report if "completions/" in line]


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
    root = tmp_path_factory.mktemp("synthetic")
    docgen.write(root, docgen.render(synthetic_app()))
    return root


def test_a_new_option_that_was_not_regenerated_fails_the_check(synthetic_root: Path) -> None:
    assert docgen.problems(synthetic_root, docgen.render(synthetic_app())) == []
    report = docgen.problems(synthetic_root, docgen.render(synthetic_app(extra_option=True)))
    assert report == ["stale:   man/wcache-plain.1"]


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


@pytest.mark.parametrize("page", man_pages(), ids=lambda p: p.name)
def test_man_page_renders_without_warnings(page: Path) -> None:
    result = subprocess.run([tool("groff"), "-man", "-Tutf8", "-ww", "-z", str(page)], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stderr == ""


def test_escaped_text_renders_as_written(synthetic_root: Path) -> None:
    page = synthetic_root / "man" / "wcache-things-paint.1"
    result = subprocess.run(
        [tool("groff"), "-man", "-Tascii", "-P-cbou", "-ww", "-rLL=200n", str(page)],
        capture_output=True,
        text=True,
        check=True,
    )
    text = " ".join(result.stdout.split())
    assert result.stderr == ""
    assert "'Quoted' paragraphs stay text. .dotted ones too: C:\\back\\slash, --flags, header-only." in text
    assert "\n       Examples, kept line by line:\n         wcache things paint fast a.png\n" in result.stdout


def test_man_renders_the_key_page() -> None:
    result = subprocess.run(
        [tool("man"), "-l", "-P", "cat", str(REPO / "man" / "wcache-key.1")],
        capture_output=True,
        text=True,
        env={**os.environ, "MANWIDTH": "100"},
    )
    assert result.returncode == 0, result.stderr
    assert "wcache-key - Show the content fingerprint" in result.stdout
    for section in ("SYNOPSIS", "DESCRIPTION", "ARGUMENTS", "OPTIONS", "SEE ALSO"):
        assert section in result.stdout


@pytest.mark.parametrize("page", man_pages(), ids=lambda p: p.name)
def test_mandoc_lint(page: Path) -> None:
    result = subprocess.run([tool("mandoc"), "-T", "lint", "-W", "warning", str(page)], capture_output=True, text=True)
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




# --- the completion command ---------------------------------------------------------------------------------------


def wcache(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wcache_cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.parametrize("shell", SHELLS)
def test_completion_prints_the_committed_script(shell: str) -> None:
    result = wcache("completion", shell)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (REPO / "completions" / docgen.COMPLETION_FILES[shell]).read_text()
    assert "_WCACHE_COMPLETE=complete_" in result.stdout  # it calls back into `wcache`


def test_completion_of_an_unknown_shell_is_one_sentence() -> None:
    result = wcache("completion", "tcsh")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip() == "error: no completion for shell 'tcsh'; choose one of bash, zsh, fish."


@pytest.mark.parametrize("option", ["--install-completion", "--show-completion"])
def test_the_completion_command_is_the_one_way(option: str) -> None:
    result = wcache(option)
    assert result.returncode == 2
    assert "No such option" in result.stderr


# --- real shells complete the real app ----------------------------------------------------------------------------

# What the console script is; the scripts call `wcache` by name, and Typer derives _WCACHE_COMPLETE from it.
CONSOLE_SCRIPT = f"""#!{sys.executable}
import sys
from wcache_cli.main import main
sys.exit(main())
"""


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    """A run dir holding one published daemon; `wcache` on PATH; a working directory with three entries."""
    with daemon_rig() as rig:
        rig.publish_stand_in()
        bin_dir = rig.base / "bin"
        bin_dir.mkdir()
        (bin_dir / "wcache").write_text(CONSOLE_SCRIPT)
        (bin_dir / "wcache").chmod(0o755)
        work = rig.base / "work"
        (work / "tiny").mkdir(parents=True)
        (work / "tiny.key").write_text("{}")
        (work / "other").write_text("")
        (rig.base / "home").mkdir()
        (rig.base / "empty-run").mkdir(mode=0o700)
        rig.env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HOME=str(rig.base / "home"))
        yield rig


def expected(rig: DaemonRig, *, every_case: bool) -> dict[str, list[str]]:
    """Command line → what completing its last word offers (directories without their trailing slash).

    Each shell gets what its script does itself (subcommands, options, choices, files when `wcache` offers
    nothing, daemon ids); `every_case` adds what only `wcache` decides, the same for every shell.
    """
    [daemon] = rig.descriptors()
    cases = {
        "wcache k": ["key"],  # first: zsh's first TAB autoloads the function
        "wcache ": sorted(typer.main.get_command(app).commands),
        "wcache key --t": ["--tensors", "--tp"],
        "wcache key --dtype ": sorted(d.value for d in Dtype),
        "wcache key --tp 2 ti": ["tiny", "tiny.key"],  # no candidates from wcache: the shell completes files
        "wcache key ": ["other", "tiny", "tiny.key"],  # a word that may be a path is one
        "wcache stop ": [daemon.name],
        "wcache key cp": [daemon.name],
    }
    if every_case:
        cases |= {
            "wcache d": ["delta", "demo", "diff", "doctor"],
            "wcache -v k": ["key"],
            "wcache attach tiny --mode ": sorted(m.value for m in Mode),
            "wcache completion ": sorted(SHELLS),
            "wcache stop c": [daemon.name],
            "wcache key 3f": [daemon.key_id],
            "wcache diff tiny.key cp": [daemon.name],
            "wcache attach tiny --daemon ": [daemon.name],
            "wcache verify tiny --daemon c": [daemon.name],
            f"wcache stop --run-dir {rig.base / 'empty-run'} c": [],
        }
    return cases


def _drain(fd: int) -> None:
    """Read what the terminal printed, so the shell never blocks on a full pty."""
    while select.select([fd], [], [], 0.02)[0]:
        try:
            if not os.read(fd, 65536):
                return
        except OSError:  # EIO: the shell has gone
            return


BASH_RC = r"""
PS1='' PS2=''
unset PROMPT_COMMAND HISTFILE
source {script}
bind 'set bell-style none'
bind '"\C-t": insert-completions'
__probe() {{ printf '%s\n<done>\n' "$READLINE_LINE" >> {out}; READLINE_LINE=''; READLINE_POINT=0; }}
bind -x '"\C-x": __probe'
"""


def _inserted(typed: str, line: str) -> list[str]:
    """The words insert-completions put in place of the last word of `typed`."""
    head = typed[: len(typed) - len(typed.rsplit(" ", 1)[-1])]
    if line == typed:
        return []
    assert line.startswith(head), (typed, line)
    return sorted(word.rstrip("/") for word in line[len(head) :].split())


def bash_complete(rig: DaemonRig, *lines: str) -> dict[str, list[str]]:
    """Readline in an interactive bash on a pseudo-terminal: each line is typed, insert-completions (bound to
    C-t) replaces its last word with every candidate, and C-x records the line."""
    script = REPO / "completions" / docgen.COMPLETION_FILES["bash"]
    out, rc = rig.base / "bash-line", rig.base / "bashrc"
    rc.write_text(BASH_RC.format(script=shlex.quote(str(script)), out=shlex.quote(str(out))))
    controller, terminal = pty.openpty()
    shell = subprocess.Popen([tool("bash"), "--noprofile", "--rcfile", str(rc), "-i"], stdin=terminal,
                             stdout=terminal, stderr=terminal, cwd=rig.base / "work", env={**os.environ, **rig.env},
                             start_new_session=True)
    os.close(terminal)
    answers = {}
    try:
        for typed in lines:
            out.write_text("")
            os.write(controller, f"{typed}\x14\x18".encode())
            deadline = time.monotonic() + 60
            while "<done>" not in out.read_text():
                assert time.monotonic() < deadline, f"bash never finished completing {typed!r}"
                _drain(controller)
            answers[typed] = _inserted(typed, out.read_text().split("\n<done>")[0])
    finally:
        shell.kill()
        shell.wait(timeout=10)
        os.close(controller)
    return answers


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
  for i in {1..1200}; do grep -q '^<done>$' $out && break; sleep 0.05; done
  zpty -w -n z $'\C-u\C-g'
  print -r -- '<line>'
  grep -v '^<done>$' $out
done
zpty -d z
"""


def zsh_complete(rig: DaemonRig, *lines: str) -> dict[str, list[str]]:
    """zsh's own completion system, `_wcache` autoloaded by compinit from $fpath as a package installs it."""
    driver = rig.base / "driver.zsh"
    driver.write_text(ZSH_DRIVER)
    result = subprocess.run(
        [tool("zsh"), "-f", str(driver), str(REPO / "completions"), str(rig.base / "matches"), *lines],
        capture_output=True, text=True, cwd=rig.base / "work", env={**os.environ, **rig.env}, timeout=600,
        check=True,
    )
    answers = result.stdout.split("<line>\n")[1:]
    return {line: sorted({a.rstrip("/") for a in answer.split()}) for line, answer in zip(lines, answers, strict=True)}


FISH_DRIVER = """
source $argv[1]
for line in $argv[2..-1]
    echo "<line>"
    complete -C"$line" | string replace -r '\\t.*' ''
end
exit 0  # string replace fails on a line with no candidates
"""


def fish_complete(rig: DaemonRig, *lines: str) -> dict[str, list[str]]:
    """fish's own completion engine (`complete -C`) on each command line."""
    result = subprocess.run(
        [tool("fish"), "--no-config", "-c", FISH_DRIVER, str(REPO / "completions" / docgen.COMPLETION_FILES["fish"]),
         *lines],
        capture_output=True, text=True, cwd=rig.base / "work", env={**os.environ, **rig.env}, timeout=600,
        check=True,
    )
    answers = result.stdout.split("<line>\n")[1:]
    return {line: sorted(a.rstrip("/") for a in answer.split()) for line, answer in zip(lines, answers, strict=True)}


DRIVERS = {"bash": bash_complete, "zsh": zsh_complete, "fish": fish_complete}


@pytest.mark.parametrize("shell", SHELLS)
def test_shell_completes_commands_options_choices_and_daemon_ids(rig: DaemonRig, shell: str) -> None:
    cases = expected(rig, every_case=shell == "bash")  # bash: the quickest session
    assert DRIVERS[shell](rig, *cases) == cases


@pytest.mark.parametrize(
    "run_dir",
    ["missing", "open-to-others", "not-a-directory", "torn-descriptor"],
)
def test_completing_daemon_ids_in_a_bad_run_dir_offers_nothing_and_prints_nothing(
    rig: DaemonRig, run_dir: str
) -> None:
    where = rig.base / run_dir
    if run_dir == "open-to-others":
        where.mkdir(mode=0o755)
        shutil.copy(next(rig.run_dir.glob("*.json")), where)
    elif run_dir == "not-a-directory":
        where.write_text("")
    elif run_dir == "torn-descriptor":
        where.mkdir(mode=0o700)
        (where / "cpu-0123.json").write_text('{"name": "cpu-0123", "pid"')
    words = f"wcache stop --run-dir {where} "
    result = subprocess.run(
        [str(rig.base / "bin" / "wcache")], capture_output=True, text=True, timeout=120,
        env={**os.environ, **rig.env, "_WCACHE_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": "4"},
    )
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "", "")
    if run_dir == "torn-descriptor":
        assert (where / "cpu-0123.json").exists()  # completing only looks


def test_completing_leaves_a_dead_daemons_descriptor_for_status_to_report(rig: DaemonRig) -> None:
    [daemon] = rig.descriptors()
    os.kill(daemon.pid, signal.SIGKILL)
    os.waitpid(daemon.pid, 0)
    result = subprocess.run(
        [str(rig.base / "bin" / "wcache")], capture_output=True, text=True, timeout=120,
        env={**os.environ, **rig.env, "_WCACHE_COMPLETE": "complete_bash", "COMP_WORDS": "wcache stop ",
             "COMP_CWORD": "2"},
    )
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "", "")
    assert rig.settled() == rig.settled([daemon])


def test_the_wheel_installs_every_man_page_and_completion(tmp_path: Path) -> None:
    """pip puts them where man and the shells look: a venv's (or prefix's) share/man/man1 and the completion
    directories, exactly the committed files. Built from a copy, so the tree under test gains no build/."""
    import zipfile

    source = tmp_path / "src"
    for name in ("core", "cli", "man", "completions"):
        shutil.copytree(docgen.REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(docgen.REPO_ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("wcache-*.whl")
    data = {name.split(".data/data/", 1)[1] for name in zipfile.ZipFile(wheel).namelist() if ".data/data/" in name}
    expected = {f"share/man/man1/{page.name}" for page in (docgen.REPO_ROOT / "man").glob("*.1")} | {
        "share/bash-completion/completions/wcache.bash", "share/zsh/site-functions/_wcache",
        "share/fish/vendor_completions.d/wcache.fish"}
    assert data == expected
