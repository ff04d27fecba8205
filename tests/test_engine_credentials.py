"""Which control token a client sends where (`wcache.serving.credentials`), and which token files it trusts
(`wcache.ipc.run_dir.engine_token`): in-process, with real files and a live pid (this process)."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest
from wcache.ipc.run_dir.engine_token import TOKEN_FILE_ENV, TokenFileError, read_token_file, write_engine_token
from wcache.ipc.run_dir.engines import EngineDescriptor, write_engine_descriptor
from wcache.serving.credentials import control_token, serves_at

TOKEN = "t" * 43


@pytest.mark.parametrize(("engine", "url", "sent"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000", True),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1/weights", True),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8001", False),
    ("http://127.0.0.1:8000", "http://127.0.0.2:8000", False),  # another address: another listener may be there
    ("http://0.0.0.0:8000", "http://127.0.0.1:8000", True),
    ("http://0.0.0.0:8000", "http://[::1]:8000", False),  # 0.0.0.0 is IPv4 only: [::1] may be another's
    ("http://[::]:8000", "http://[::1]:8000", True),
    ("http://[::]:8000", "http://127.0.0.1:8000", True),  # dual stack
    ("http://127.0.0.1:8000", "http://192.0.2.1:8000", False),
    ("http://127.0.0.1:8000", "http://127.0.0.1", False),
])
def test_a_token_goes_only_where_its_engine_listens(engine: str, url: str, sent: bool) -> None:
    assert serves_at(engine, url) is sent


def test_localhost_gets_a_token_only_when_all_its_addresses_are_the_engines() -> None:
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", 8000, type=socket.SOCK_STREAM)}
    expected = addresses <= {"127.0.0.1"}
    assert serves_at("http://127.0.0.1:8000", "http://localhost:8000") is expected
    assert serves_at("http://[::]:8000", "http://localhost:8000")


def _announce(run_dir: Path, url: str, pid: int) -> None:
    write_engine_descriptor(run_dir, EngineDescriptor(pid=pid, url=url, model="m", source="/m", attach=None,
                                                      key_id=None, started=time.time()))


def test_the_run_dirs_engine_token_is_found_for_its_url_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    _announce(run_dir, "http://127.0.0.1:8000", os.getpid())
    path = write_engine_token(run_dir, os.getpid(), TOKEN)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert control_token("http://127.0.0.1:8000", run_dir) == TOKEN
    assert control_token("http://127.0.0.1:8001", run_dir) is None
    assert control_token("http://127.0.0.1:8000", tmp_path / "elsewhere") is None
    path.unlink()
    assert control_token("http://127.0.0.1:8000", run_dir) is None  # the engine stopped meanwhile


def test_a_dead_engines_leftover_token_is_not_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    dead = (1 << 22) - 1  # above any pid this host hands out
    _announce(run_dir, "http://127.0.0.1:8000", dead)
    write_engine_token(run_dir, dead, TOKEN)
    assert control_token("http://127.0.0.1:8000", run_dir) is None


def test_a_token_file_left_at_the_engines_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "engines").mkdir(parents=True, mode=0o700)
    target = tmp_path / "elsewhere"
    (run_dir / "engines" / "42.token").symlink_to(target)
    write_engine_token(run_dir, 42, TOKEN)
    assert not target.exists() and read_token_file(run_dir / "engines" / "42.token") == TOKEN


@pytest.mark.parametrize(("content", "mode", "words"), [
    (TOKEN, 0o644, "open to others"),
    ("short", 0o600, "shorter than 16"),
    ("two words " * 4, 0o600, "printable ASCII"),
    ("x" * 5000, 0o600, "at most 4096"),
])
def test_an_operators_token_file_that_cannot_serve_is_one_sentence(tmp_path: Path, content: str, mode: int,
                                                                   words: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    path.chmod(mode)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    with pytest.raises(TokenFileError, match=words) as raised:
        control_token("http://127.0.0.1:8000")
    assert "\n" not in str(raised.value)


def test_an_operators_token_file_is_sent_to_any_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o640)  # a group the operator names may read it
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    assert control_token("http://192.0.2.1:8000") == TOKEN
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(TokenFileError, match="does not exist"):
        control_token("http://127.0.0.1:8000")
