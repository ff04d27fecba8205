"""Run `wcache ARGS` in this process and swap a checkpoint under it right after it has opened one shard.

    python tests/swap_during_key.py SWAP SHARD FROM TO -- ARGS...

SWAP is `exchange` (renameat2 RENAME_EXCHANGE of the directories FROM and TO, what a deploy's `mv` does),
`flip` (the symlink FROM replaced atomically by one to TO) or `bind` (TO bind-mounted over FROM; needs root).
An audit hook sees the `open` of SHARD (the path as wcache opens it) and swaps at the next audit event that
thread raises, so the descriptor already names the old file: deterministic, with the real CLI and no fake.
The functions that swap are imported by the tests to swap back.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

AT_FDCWD = -100
RENAME_EXCHANGE = 2
MS_BIND = 4096

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def exchange(a: Path, b: Path) -> None:
    """Swap the directory entries `a` and `b` in one step."""
    _check(_libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE),
           f"renameat2({a}, {b}, RENAME_EXCHANGE)")


def flip(link: Path, target: Path) -> None:
    """Point the symlink `link` at `target` in one step (a new link renamed over it)."""
    fresh = link.with_name(link.name + ".flip")
    fresh.symlink_to(target)
    os.replace(fresh, link)


def bind(source: Path, target: Path) -> None:
    """Bind-mount `source` over `target`."""
    _check(_libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None), f"mount --bind {source}")


def unbind(target: Path) -> None:
    _check(_libc.umount2(os.fsencode(target), 0), f"umount {target}")


SWAPS: dict[str, Callable[[Path, Path], None]] = {"exchange": exchange, "flip": flip, "bind": bind}


def swap_after_open(shard: str, swap: Callable[[], None]) -> None:
    """Run `swap` once, at the first audit event after `shard`'s open raised by the thread that opened it."""
    opener: list[int] = []
    done = threading.Event()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if done.is_set():
            return
        if event == "open" and args and args[0] is not None and os.fsdecode(args[0]) == shard:
            opener.append(threading.get_ident())
        elif opener and opener[0] == threading.get_ident():
            done.set()  # first: what the swap itself raises must not come back here
            swap()

    sys.addaudithook(hook)


def main() -> None:
    swap, shard, source, target, separator, *args = sys.argv[1:]
    assert separator == "--", sys.argv
    swap_after_open(shard, lambda: SWAPS[swap](Path(source), Path(target)))
    sys.argv = ["wcache", *args]
    from wcache_cli.main import main as wcache

    wcache()


if __name__ == "__main__":
    main()
