"""The multiprocessing context a warm vLLM server starts its engine core and TP workers with: a forkserver
that imported vLLM once.

vLLM's CPU platform starts its engine core and each worker with `spawn`, and each of them re-imports torch,
vLLM and the plugin (7-10 s apiece here) while it unpickles its target. Here they are forked instead, by one
forkserver started once per `WarmStarter` (`start_forkserver`), which imported everything those processes
import (`PRELOAD`) and was single-threaded when it forks (`check_fork_safe`). multiprocessing's own forkserver
protocol carries the process object, so vLLM's `proc.sentinel`, `is_alive`, `join`, `terminate` and exit codes
work as under `spawn`. What a forkserver child would otherwise get wrong is set right in `WarmProcess`: the
environment of the process that started it (a forkserver child inherits the forkserver's), and the process
group of the server it belongs to (so a launcher's `killpg` stops the whole server).

Every process of a warm server (front, engine core, workers) shares the one forkserver the zygote started:
`share_forkserver` makes multiprocessing connect to it instead of starting a forkserver of its own.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys
from multiprocessing import connection, reduction, resource_tracker, spawn, util
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path
from typing import Any

from wcache.errors import EXIT_DIFFERENCE, EXIT_UNAVAILABLE

# Everything the server's front, engine core and CPU workers import while they start, imported once by the
# zygote and the forkserver (a module missing here is imported by each process that needs it, costing time).
PRELOAD = (
    "wcache.integrations.vllm.api",  # first: its version check refuses an untested vLLM in one sentence
    "torch",
    "vllm",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3",
    # Imported lazily while the engine core and a worker start (found by listing the modules they add):
    "setproctitle",
    "vllm.v1.core.sched.scheduler",
    "vllm.plugins.lora_resolvers.filesystem_resolver",
    "vllm.plugins.lora_resolvers.hf_hub_resolver",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.distributed.elastic_ep.elastic_execute",
    "vllm.model_executor.layers.quantization.compressed_tensors.utils",
    "vllm.model_executor.layers.quantization.online.fp8",
    "vllm.v1.pool.flash_maxsim.flash_maxsim_rerank",
    "wcache.integrations.vllm.plugin",
    "wcache.integrations.vllm.loader",
)
# The probe child's exit code when it inherited CUDA (any other failure exits otherwise).
PROBE_FOUND_CUDA = EXIT_DIFFERENCE
# Thread pools native libraries start at import (numpy's and OpenCV's OpenBLAS); one thread each keeps the
# zygote and the forkserver single-threaded when they fork. Set before the imports, in their own environment.
SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1"}


class NotForkSafeError(RuntimeError):
    """A process that is about to fork vLLM's processes has more than one thread or has initialised CUDA."""


def thread_count() -> int:
    return sum(1 for _ in Path("/proc/self/task").iterdir())


def cuda_initialized() -> bool:
    """Whether torch has initialised CUDA in this process (never, in a process that forks vLLM's)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def check_fork_safe(what: str) -> None:
    """Refuse to fork from a process where a child could inherit a held lock or a CUDA context."""
    if cuda_initialized():
        raise NotForkSafeError(f"the {what} has initialised CUDA, so it cannot fork vLLM's processes")
    if (threads := thread_count()) != 1:
        raise NotForkSafeError(f"the {what} runs {threads} threads, so it cannot fork vLLM's processes safely")


def import_preload() -> None:
    for name in PRELOAD:
        __import__(name)


def freeze_imported_objects() -> None:
    """Move every object the imports made into the collector's permanent generation, in a process about to fork.

    vLLM's front, engine core and workers each run a full `gc.collect()` when they have started
    (`freeze_gc_heap`); in a process forked from here that pass would walk every object of torch and vLLM
    again, 0.4-0.6 s apiece on this shape. Frozen objects are never walked, and never written by the
    collector, so their pages also stay shared with the parent. They live as long as the imports anyway."""
    import gc

    gc.collect()
    gc.freeze()


def _cpus_from_openmp_environment() -> set[int] | None:
    """The CPUs vLLM's OpenMP variables bind a process to, in the three forms vLLM writes them (libgomp's
    `GOMP_CPU_AFFINITY="0 1"`, Intel's `KMP_AFFINITY=...proclist=[0,1]`, standard `OMP_PLACES={0,1}`)."""
    text = os.environ.get("GOMP_CPU_AFFINITY")
    if text is None and (kmp := os.environ.get("KMP_AFFINITY")) and "proclist=[" in kmp:
        text = kmp.split("proclist=[", 1)[1].split("]", 1)[0]
    if text is None and (places := os.environ.get("OMP_PLACES")):
        text = places.strip("{}")
    if text is None:
        return None
    try:
        return {int(cpu) for cpu in text.replace(",", " ").split()} or None
    except ValueError:
        return None


def apply_openmp_environment() -> None:
    """Do what the OpenMP runtime does with its variables when a process starts, in a process forked after
    the runtime was loaded (it read them once, in the zygote or the forkserver): vLLM sets a CPU worker's
    thread count and CPU list in them just around `start()`, and relies on nothing else to apply them."""
    if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    if (cpus := _cpus_from_openmp_environment()) is not None:
        os.sched_setaffinity(0, cpus)  # the OpenMP threads made later inherit it


class _Stdio:
    """The starter's stdout and stderr, sent along with a process object as multiprocessing sends a
    connection's descriptor (`DupFd`: duplicated into the forkserver child while it unpickles)."""

    def __init__(self, fds: tuple[int, ...]) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _Stdio._received, tuple(reduction.DupFd(fd) for fd in (1, 2))

    @staticmethod
    def _received(*dup_fds: Any) -> _Stdio:
        return _Stdio(tuple(int(d.detach()) for d in dup_fds))

    def install(self) -> None:
        for target, fd in zip((1, 2), self.fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)


class WarmProcess(ForkServerProcess):
    """A forkserver process that runs like its starter's spawned child would: with the starter's environment,
    stdout and stderr (a forkserver child inherits the forkserver's), and in the starter's process group."""

    _warm_environ: dict[str, str]
    _warm_pgid: int
    _warm_stdio: _Stdio

    def start(self) -> None:
        # vLLM sets per-process variables (OpenMP binding, thread counts) just around `start()`.
        self._warm_environ = dict(os.environ)
        self._warm_pgid = os.getpgrp()
        self._warm_stdio = _Stdio((1, 2))
        sys.stdout.flush()
        sys.stderr.flush()
        super().start()

    def run(self) -> None:
        try:
            os.setpgid(0, self._warm_pgid)
        except OSError:  # the server's group is gone: it was killed while this process started
            os._exit(EXIT_UNAVAILABLE)
        self._warm_stdio.install()
        os.environ.clear()
        os.environ.update(self._warm_environ)
        apply_openmp_environment()
        super().run()


class WarmContext(ForkServerContext):
    Process = WarmProcess


WARM_CONTEXT = WarmContext()


def share_forkserver() -> None:
    """Make multiprocessing in this process use the forkserver it knows (inherited from the zygote, or set by
    the forkserver itself in its children) instead of starting one: its own check waits on a pid that is not
    this process's child, and a forkserver child knows no pid at all."""
    server: Any = multiprocessing.forkserver._forkserver

    def ensure_running() -> None:
        if server._forkserver_address is None or server._forkserver_alive_fd is None:
            raise RuntimeError("this process was not started from wcache's warm forkserver")
        resource_tracker.ensure_running()

    server.ensure_running = ensure_running


def route_vllm_to_warm_context() -> None:
    """vLLM's engine core and workers started from this process come from the warm forkserver."""
    from wcache.integrations.vllm.api import route_mp_context

    route_mp_context(WARM_CONTEXT)


def forkserver_main(listener_fd: int, alive_r: int) -> None:
    """The forkserver's entry (a fresh interpreter): import what vLLM's processes import, check it is safe to
    fork, then serve multiprocessing's forkserver protocol."""
    try:
        import_preload()
        share_forkserver()
        route_vllm_to_warm_context()
        check_fork_safe("warm forkserver")
        freeze_imported_objects()
    except Exception as exc:
        print(f"wcache: the warm forkserver cannot start: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_UNAVAILABLE)
    multiprocessing.forkserver.main(listener_fd, alive_r, preload=[])


def start_forkserver() -> int:
    """Start the warm forkserver as multiprocessing's forkserver for this process (the zygote) and its
    descendants: its listener and the write end of its "alive" pipe are multiprocessing's, so every
    descendant that shares them (`share_forkserver`) reaches it. The forkserver's pid."""
    server: Any = multiprocessing.forkserver._forkserver
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        Path(address).chmod(0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        try:
            command = ("from wcache.integrations.vllm.warm_context import forkserver_main; "
                       f"forkserver_main({listener.fileno()}, {alive_r})")
            executable: Any = spawn.get_executable()  # bytes, as multiprocessing's own forkserver start uses it
            argv = [executable, *util._args_from_interpreter_flags(), "-c", command]  # type: ignore[attr-defined]
            pid = util.spawnv_passfds(executable, argv, [listener.fileno(), alive_r])
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return int(pid)


def stop_forkserver(timeout: float) -> None:
    """Close this process's end of the forkserver's alive pipe and reap it (it exits once no process of a
    warm server holds the pipe); killed when it has not gone after `timeout` seconds."""
    import signal
    import time

    server: Any = multiprocessing.forkserver._forkserver
    pid, alive_w, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
    if pid is None:
        return
    os.close(alive_w)
    server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    if address is not None:
        Path(address).unlink(missing_ok=True)


def probe_target() -> None:
    """Run in a forkserver child at start-up: the fork works, and the child inherited no CUDA context."""
    if cuda_initialized():
        os._exit(PROBE_FOUND_CUDA)
