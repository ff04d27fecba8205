"""A served engine that follows its weights' newest version (`wcache attach --serve --follow`).

A training loop publishes version N+1 from the daemon holding N (`publish`, `preload --from --delta`); the new
daemon's descriptor names its parent (`parent_key_id`, the one owner of a version's lineage). A following engine
looks at the run dir every `interval` seconds (a `stat` of the directory; descriptors are read again only when a
file came or went there, or the engine's key changed) and, when a live daemon on its device descends from the key
it serves now, switches to the newest such descendant through the same `switch_weights` a POST /v1/weights runs:
one request never sees two versions, and the switch releases the old daemon's lease. Only a version whose parent
chain leads from the engine's current key is followed, never an unrelated checkpoint; among versions branched from
one parent, the one started last. An engine whose weights are known corrupt follows nothing (its completions stay
refused) until it is switched or restarted on good weights.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from wcache.errors import BadInputError, WcacheError, option
from wcache.ipc.run_dir.directory import DaemonDescriptor, census, group_of

log = logging.getLogger("wcache.engine")

FOLLOW_INTERVAL_S = 0.05  # a stat of the run dir, 20 times a second: the follow latency's floor
TIMESTAMP_TICK_NS = 100_000_000  # well above a coarse mtime's granularity (a jiffy)


def check_followable(tp_size: int) -> None:
    """Refuse to follow with an engine that cannot switch (TP > 1 engines do not switch yet)."""
    if tp_size > 1:
        raise BadInputError(f"following new versions with a tensor-parallel engine (TP {tp_size}) is not "
                            f"implemented; serve it without {option('follow')}.")


def newest_descendant(live: Iterable[DaemonDescriptor], key_id: str, device: str) -> DaemonDescriptor | None:
    """The newest version built (one or more steps) from the daemon of `key_id` on `device`, or None: each step a
    live daemon whose `parent_key_id` is the key before it; of several children of one key, the one started last
    (ISO start times, then the name, so the choice is the same on every look). Of a tensor-parallel group, rank 0
    stands for the group (its key is the one rank 0 of an engine serves), and only once every rank is live: an
    engine switched to it attaches each rank to its own."""
    live = list(live)
    daemons = [d for d in live if d.device == device and d.tp_rank == 0 and len(group_of(d, live)) == d.tp_size]
    tip: DaemonDescriptor | None = None
    seen = {key_id}
    while True:
        children = [d for d in daemons if d.parent_key_id == key_id and d.key_id not in seen]
        if not children:
            return tip
        tip = max(children, key=lambda d: (d.started, d.name))
        key_id = tip.key_id
        seen.add(key_id)


class Follower:
    """The thread that moves an engine to its weights' newest version: `served_key` says the key it serves now,
    `corrupt` whether it must not move, `switch` moves it to a daemon (by name) and re-announces it."""

    def __init__(self, run_dir: Path, device: str, served_key: Callable[[], str | None],
                 corrupt: Callable[[], bool], switch: Callable[[str], object],
                 interval: float = FOLLOW_INTERVAL_S) -> None:
        self.run_dir, self.device, self.interval = run_dir, device, interval
        self._served_key, self._corrupt, self._switch = served_key, corrupt, switch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wcache-follow", daemon=True)
        self._looked: tuple[int, str | None] | None = None  # (run dir mtime, key) when last looked
        self._refused: set[str] = set()  # daemons a switch refused: not tried again

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def look(self) -> str | None:
        """Switch once if a newer version of the served key runs; the daemon switched to, or None."""
        key_id = self._served_key()
        if key_id is None or self._corrupt():
            return None
        try:
            mtime = os.stat(self.run_dir).st_mtime_ns
        except OSError:
            return None
        if self._looked == (mtime, key_id):
            return None
        # A change within the filesystem's timestamp tick would leave the mtime as it was: a fresh mtime is not
        # taken as looked at.
        self._looked = (mtime, key_id) if time.time_ns() - mtime > TIMESTAMP_TICK_NS else None
        tip = newest_descendant(census(self.run_dir, clean=False).live, key_id, self.device)
        if tip is None or tip.name in self._refused:
            return None
        try:
            self._switch(tip.name)
        except WcacheError as exc:
            # The version stays refused (another plan, a daemon gone meanwhile); the engine serves what it had.
            self._refused.add(tip.name)
            log.warning("wcache: this engine does not follow %s: %s", tip.name, exc)
            return None
        log.info("wcache: followed %s → %s (daemon %s)", key_id, tip.key_id, tip.name)
        return tip.name

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.look()
            except Exception:  # a follower that died would leave the engine on N without a word
                log.exception("wcache: looking for a newer version failed")
