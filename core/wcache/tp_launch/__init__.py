"""Run one function on N tensor-parallel CPU ranks joined by a gloo group: rank 0 in the caller, the others spawned.

`run_tensor_parallel(fn, tp_size, *args)` is the one entry: `wcache verify --greedy`, `wcache attach --prompt`
and `--serve` run every TP size through it (TP 1 spawns nothing), and so do the TP tests. Every rank runs
`fn(TensorParallel(rank, size), *args)` and the caller gets the ranks' return values in rank order.

Design choices, and why:

- **Rank 0 runs in the caller.** A server then is the process its user started (its pid, its signals: SIGTERM
  stops it gracefully at every TP size), TP 1 is no special case for anyone, and one interpreter fewer starts.
  It runs on the caller's main thread, where a signal can stop it; it joins the group only once every other
  rank is about to (the group's rendezvous blocks where no signal reaches), leaves it when done, and puts back
  the thread count it changed, so a caller can run ranks again. A caller that cannot give rank 0 its main
  thread passes `isolate_rank0=True` and says why.
- **spawn, never fork.** A forked child inherits the parent's torch thread pools, locks held by other threads,
  and any process group; spawn starts clean interpreters, which is also what CUDA would need. So `fn`, `args`
  and the results must be picklable (a module-level function, not a lambda).
- **A file:// rendezvous in a fresh temporary directory** rather than a TCP port picked in advance: a port found
  free now can be taken by someone else before rank 0 binds it; a new file cannot collide.
- **One pipe per spawned rank** (`spawned`), an anonymous descriptor only the caller and that rank hold, so
  nobody else can put bytes in it. (Spawning on POSIX starts multiprocessing's resource-tracker helper once per
  process; it is shared, idle, and exits with the caller.)
- **Errors cross as names and text** (`failure`): the caller raises a rank's wcache error as the same class and
  message, so a miss or a bad checkpoint found by a rank is the same one sentence and exit code as with
  `--tp 1`; anything else (a bug, a dead rank, a timeout) becomes one TensorParallelError sentence naming the
  rank, with the rank's traceback as a note (shown by `wcache -v`).
- **Any failure stops every rank** (`watch`). When one rank raises, the others are usually blocked in a
  collective that will never complete; rank 0 is stopped by a signal (`here`), the spawned ranks are
  terminated, then killed if they ignore SIGTERM, and always reaped, so no process is left behind. The failure
  that came first is the one reported. Ctrl-C is the caller's: spawned ranks ignore SIGINT and are stopped by
  the caller (or by rank 0, as a server stops its followers). If the caller itself is killed, the kernel
  SIGTERMs the spawned ranks (Linux PR_SET_PDEATHSIG), which matters for servers started with `timeout=None`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcache.lazy_exports import lazy_exports

_EXPORTS = {
    "run_tensor_parallel": "wcache.tp_launch.launch",
    "TensorParallelError": "wcache.tp_launch.failure",
}
__all__ = ["TensorParallelError", "run_tensor_parallel"]
assert set(__all__) == set(_EXPORTS)

if TYPE_CHECKING:
    from wcache.tp_launch.failure import TensorParallelError
    from wcache.tp_launch.launch import run_tensor_parallel

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
