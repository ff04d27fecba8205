"""Turn a command-line operand (a checkpoint path, a saved key file or a running daemon) into a key."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wcache.errors import BadInputError

from wcache_cli.params import run_dir_or_default

if TYPE_CHECKING:
    from wcache.ipc.run_dir.directory import DaemonDescriptor
    from wcache.key.cache_key import KeyFile
    from wcache.plan.spec import PlanSpec


def key_of_checkpoint(path: Path, plan: PlanSpec, *, rehash: bool = False) -> KeyFile:
    """Compute a checkpoint's key through the default digest store, with a progress bar."""
    # Each operand kind imports only its own machinery: a checkpoint's key needs no sockets or psutil.
    from wcache.key.compute import compute_key
    from wcache.key.digest_store import DigestStore

    from wcache_cli.progress import hash_bar

    with DigestStore.open() as store, hash_bar(path.name or str(path)) as bar:
        return compute_key(path, plan, store=store, rehash=rehash, progress=bar)


def check_tp_fits(model: Path, spec: PlanSpec) -> None:
    """Refuse a --tp the model cannot be split by before a process per rank starts (reads config.json only)."""
    if spec.tp_size > 1:
        from wcache.checkpoint.files import locate
        from wcache.plan.processing import check_tp_split

        check_tp_split(spec, locate(model).config)


def find_daemons(run_dir: Path, ident: str) -> list[DaemonDescriptor]:
    """Live daemons whose name or key id starts with `ident`."""
    from wcache.ipc.run_dir.directory import census, matches

    live = census(run_dir).live if run_dir.exists() else ()
    return [d for d in live if matches(d, ident)]


def key_of_daemon(descriptor: DaemonDescriptor) -> KeyFile:
    from wcache.ipc.run_dir.remote_key import daemon_key_file
    from wcache.ipc.wire.client import request_once
    from wcache.ipc.wire.messages import Manifest

    return daemon_key_file(descriptor, request_once(descriptor.socket, Manifest()).tensors)


def daemon_named(operand: Path, run_dir: Path | None) -> DaemonDescriptor | None:
    """The running daemon a bare operand names (a name or key id prefix that is not a path), if any.

    `run_dir` None means the default one, looked up only once the operand is not a path.
    """
    if operand.exists() or len(operand.parts) != 1:
        return None
    daemons = find_daemons(run_dir_or_default(run_dir), str(operand))
    if len(daemons) > 1:
        names = ", ".join(d.name for d in daemons)
        raise BadInputError(f"{operand} matches {len(daemons)} daemons ({names}); give more of the id.")
    return daemons[0] if daemons else None


def key_of_operand(operand: Path, plan: PlanSpec, run_dir: Path | None, *, rehash: bool = False) -> KeyFile:
    """A saved key file is read as is, a daemon id asks that daemon, anything else is a checkpoint."""
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.key.cache_key import is_key_file, load_key_file

    if is_key_file(operand):
        return load_key_file(operand)
    daemon = daemon_named(operand, run_dir)
    if daemon is not None:
        return key_of_daemon(daemon)
    return key_of_checkpoint(resolve_model_path(operand), plan, rehash=rehash)
