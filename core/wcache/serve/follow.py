"""`wcache serve --follow`: the launcher moves its vLLM server to its weights' newest version.

A reference engine follows from inside its own process (`wcache.serving.follow`); a vLLM server is moved from the
launcher, over HTTP, by the switch `wcache switch URL --daemon D` runs (`wcache.vllm_served.switch_served`: pause,
reload in place, reset the prefix cache, resume), so one request never sees two versions. Which version is newest
is `newest_descendant`'s rule, from the key the server's rank 0 announces it serves now (its loader announces
again after every reload); at tensor parallel > 1, the version of rank 0's daemon once its whole group runs, and
the server is restarted on it (each rank attaching its own rank's daemon of that group): vLLM's in-place reload
takes weights in checkpoint form, which a rank's shards are not. A version whose switch is refused is not tried again
by this server, which keeps the weights it had. The launcher's leases move with the server, and a restarted server
attaches the version it was last moved to (a loop that stops the versions its engines left behind stops the one
the server started on too, and no chain leads from it any more).

Moving a vLLM server needs its development endpoints, and those reach every worker: whoever can reach the port
could reload its weights. Following is therefore refused unless the server listens on a loopback address, and the
launcher puts those routes behind its control token (`wcache.integrations.vllm.dev_guard`) against other users of
this host.
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable
from pathlib import Path

from wcache.errors import BadInputError, UnavailableError, WcacheError, marked, option
from wcache.integrations.vllm.announce import FOLLOWS_VARIABLE
from wcache.integrations.vllm.switch import in_place_refusal
from wcache.ipc.run_dir.directory import DaemonDescriptor, census, group_of
from wcache.ipc.run_dir.engines import VLLM_ENGINE, announced_at
from wcache.ipc.run_dir.paths import RunPaths
from wcache.serve.daemons import ServedDaemons
from wcache.serving.follow import TIMESTAMP_TICK_NS, Follower
from wcache.vllm_served import DEV_MODE, switch_served, vllm_version

# What the server's environment gets when it follows: the endpoints a switch drives, and the flag its ranks
# announce (`top` shows which engines follow).
FOLLOW_ENV = {DEV_MODE: "1", FOLLOWS_VARIABLE: "1"}


def check_follow(host: str | None) -> None:
    """Refuse to follow with a server whose switch endpoints others could reach: `host` is the server's --host
    (None: vLLM's default, every interface)."""
    try:
        loopback = host == "localhost" or (host is not None and ipaddress.ip_address(host.strip("[]")).is_loopback)
    except ValueError:
        loopback = False
    if not loopback:
        where = f"vLLM's --host {host}" if host else "any of its interfaces (without vLLM's --host)"
        raise BadInputError(f"{option('follow')} reloads the server's weights through vLLM's development endpoints, "
                            f"which anyone who can reach {where} could call too; give the server vLLM's --host "
                            "127.0.0.1 (behind a proxy for other hosts) to follow.")


def served_key(run_dir: Path, url: str) -> str | None:
    """The key the server at `url` serves now, as its rank 0 last announced it (None: not attached, or not yet)."""
    ranks = [d for d in announced_at(run_dir, url) if d.engine == VLLM_ENGINE and d.tp_rank == 0]
    newest = max(ranks, key=lambda d: d.started, default=None)
    return newest.key_id if newest is not None and newest.attach is not None else None


class AnnouncedKey:
    """`served_key`, read again only when an announcement came, went or was rewritten (each is a rename into the
    engines directory, which changes its mtime): the follower asks 20 times a second, and reading every
    announcement and checking its process each time would cost a share of a core the reload needs."""

    def __init__(self, run_dir: Path, url: str) -> None:
        self.run_dir, self.url = run_dir, url
        self._seen: tuple[int, str | None] | None = None  # (engines dir mtime, key) when last read

    def __call__(self) -> str | None:
        try:
            mtime = os.stat(RunPaths(self.run_dir).engines).st_mtime_ns
        except OSError:
            return None
        if self._seen is not None and self._seen[0] == mtime:
            return self._seen[1]
        key = served_key(self.run_dir, self.url)
        # A rename within the filesystem's timestamp tick leaves the mtime as it was: a fresh one is read again.
        self._seen = (mtime, key) if time.time_ns() - mtime > TIMESTAMP_TICK_NS else None
        return key


def server_follower(url: str, run_dir: Path, device: str, daemons: ServedDaemons, say: Callable[[str], None],
                    moved: Callable[[], None], restart: Callable[[], None]) -> Follower:
    """The follower of the vLLM server at `url`, not started; it moves the server with `server_switch`."""
    return Follower(run_dir, device, AnnouncedKey(run_dir, url), lambda: False,
                    server_switch(url, run_dir, daemons, say, moved, restart))


def server_switch(url: str, run_dir: Path, daemons: ServedDaemons, say: Callable[[str], None],
                  moved: Callable[[], None], restart: Callable[[], None]) -> Callable[[str], None]:
    """What moves the vLLM server at `url` to a daemon (by name); `say` gets one line per move.

    The launcher's leases (`daemons`) move to a version before the server does, and the old ones end then: the
    version a restart attaches (`pinned_restart`) is never unleased, and once the server has moved, the version it
    left is held by nobody here (a loop stops it without --force and its arena goes to the pool). A switch that
    fails moves them back unless the server's rank 0 announces the new version by then (a reload that failed late:
    its weights may be the new version's, or mixed, and a restart attaches the new one whole). `moved` is called
    after each move.

    At TP > 1 the server is restarted on the version instead (`restart`, the launcher's): vLLM's in-place reload
    takes weights in checkpoint form, and each rank's daemon holds its shards in vLLM's form, which only a start
    attaches (`wcache.integrations.vllm.switch.in_place_refusal`, the rule's one owner)."""
    restarting: set[str] = set()  # the version a restart was asked for: this server's follower asks once

    def switch(daemon: str) -> None:
        before = list(daemons.descriptors)
        group = _group_named(run_dir, daemon)
        if in_place_refusal(group[0].tp_size) is not None:
            if daemon not in restarting:
                restarting.add(daemon)
                daemons.move_to(group)
                moved()
                say(f"following {before[0].key_id} → {group[0].key_id} (daemon {daemon}): vLLM restarts on it (at "
                    f"TP {group[0].tp_size} its in-place reload cannot take a daemon's shards).")
                restart()
            return
        daemons.move_to(group)
        try:
            result = switch_served(url, vllm_version(url), None, daemon)
        except BaseException:
            if served_key(run_dir, url) != group[0].key_id:
                try:
                    daemons.move_to(before)
                except WcacheError as exc:
                    say(f"the launcher keeps its leases on {daemon}: those on {before[0].name}, whose weights the "
                        f"server keeps, could not be taken again ({marked(exc)}).")
            raise
        finally:
            moved()
        say(f"followed {result['previous']['key_id']} → {result['current']['key_id']} (daemon {daemon}): vLLM "
            f"reloaded in place in {result['switch_ms'] / 1000:.2f} s.")

    return switch


def _group_named(run_dir: Path, daemon: str) -> list[DaemonDescriptor]:
    """The whole group of daemon `daemon` (the follower's choice: rank 0 of a group whose every rank runs)."""
    live = list(census(run_dir, clean=False).live)
    named = [d for d in live if d.name == daemon]
    if not named:
        raise UnavailableError(f"daemon {daemon} stopped before the server could move to it.")
    return sorted(group_of(named[0], live), key=lambda d: d.tp_rank)
