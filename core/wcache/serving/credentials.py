"""The control token a client of this host sends to the engine at a URL, found without the user doing anything.

The operator's token file (`WCACHE_ENGINE_TOKEN_FILE`) when set; else the token of the engine in the user's run
dir that listens at that URL. A token goes only to the engine that wrote it: the URL's host must resolve only to
addresses that engine listens on (its own address, or any local one of its family when it listens on all), on
its port, and its process must be alive. `localhost` resolving to both ::1 and 127.0.0.1 does not match an
engine on 127.0.0.1 alone: another user could listen on [::1] at that port and collect the token.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import urllib.parse
from pathlib import Path

from wcache.errors import WcacheError
from wcache.ipc.run_dir.directory import check_run_dir, default_run_dir
from wcache.ipc.run_dir.engine_token import operator_token, read_token_file
from wcache.ipc.run_dir.engines import announcer_alive, read_engine_descriptor
from wcache.ipc.run_dir.paths import RunPaths

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def control_token(url: str, run_dir: Path | None = None) -> str | None:
    """The token to send to the engine at `url`, or None when none is known (the engine then answers 401)."""
    operator = operator_token()
    if operator is not None:
        return operator
    run_dir = run_dir if run_dir is not None else default_run_dir()
    pid = engine_pid_at(run_dir, url)
    if pid is None:
        return None
    try:
        return read_token_file(RunPaths(run_dir).engine_token(pid))
    except (FileNotFoundError, WcacheError):
        return None  # stopped meanwhile, or not a file the engine wrote: the engine's own 401 says what to do


def engine_pid_at(run_dir: Path, url: str) -> int | None:
    """The live engine announced in `run_dir` that listens at `url`, or None."""
    try:
        check_run_dir(run_dir)
        files = RunPaths.engine_files(RunPaths(run_dir).engines)
    except (OSError, WcacheError):
        return None
    for path in files:
        try:
            descriptor = read_engine_descriptor(path)
        except (OSError, ValueError):
            continue
        if descriptor.url is not None and announcer_alive(descriptor) and serves_at(descriptor.url, url):
            return descriptor.pid
    return None


def serves_at(engine_url: str, url: str) -> bool:
    """Whether every address `url` may connect to is one the engine announced at `engine_url` listens on."""
    ours, theirs = urllib.parse.urlsplit(engine_url), urllib.parse.urlsplit(url)
    try:
        if ours.port is None or ours.port != theirs.port or not theirs.hostname or not ours.hostname:
            return False
        wanted = _addresses(theirs.hostname, theirs.port)
        listening = _addresses(ours.hostname, ours.port)
    except (OSError, ValueError, UnicodeError):
        return False
    if not wanted:
        return False
    wildcard = {a for a in listening if a.is_unspecified}
    if not wildcard:
        return wanted <= listening
    local = _local_addresses()
    # A server on :: takes IPv4 too (dual stack, Linux's default); one on 0.0.0.0 takes IPv4 only.
    families = {6, 4} if any(a.version == 6 for a in wildcard) else {4}
    return all(a in listening or (a.version in families and (a.is_loopback or a in local)) for a in wanted)


def _addresses(host: str, port: int) -> set[Address]:
    found: set[Address] = set()
    for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with contextlib.suppress(ValueError):
            found.add(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
    return found


def _local_addresses() -> set[Address]:
    import psutil

    found: set[Address] = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(address.address.split("%", 1)[0]))
    return found
