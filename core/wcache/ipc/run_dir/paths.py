"""Every name in the run dir, in one place: what daemons, supervisors, engines and readers find each other by.

```
<run dir>/
  <daemon>.json, <daemon>.sock, <daemon>.lock   a ready daemon's descriptor, its socket, the lock held for its life
  events.jsonl, events.jsonl.1                  the event log and its rotated generation
  loading/<pid>.json, loading/<pid>.lock        a rank still loading: its progress record and the lock it holds
  engines/<pid>.json                            a serving engine's announcement, for `wcache top`
  engines/<pid>.token                           its control token (0600): what a request that switches it must send
  servers/<pid>.json                            a `wcache serve` launcher's record of the vLLM server it supervises
  servers/<pid>.restart.json                    a restart asked of that launcher (`wcache restart`), with new arguments
  logs/supervisor-<pid>.log, logs/preload-<supervisor pid>-rank<r>.log
  logs/serve-<pid>.log                          the output of every vLLM server a launcher started
```

`RunPaths(run_dir)` spells them; nothing else in wcache joins a file name onto a run dir. Checking the run
dir (owner, mode) and reading what is in it stay with `directory` and the modules of each file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RunPaths:
    """The paths of one run dir."""

    root: Path

    DESCRIPTOR_SUFFIX = ".json"
    SOCKET_SUFFIX = ".sock"
    LOCK_SUFFIX = ".lock"
    TOKEN_SUFFIX = ".token"
    ROTATED_SUFFIX = ".1"
    EVENTS = "events.jsonl"
    LOADING = "loading"
    ENGINES = "engines"
    SERVERS = "servers"
    RESTART_SUFFIX = ".restart.json"
    LOGS = "logs"

    # -- daemons -----------------------------------------------------------------------------------------

    def descriptor(self, name: str) -> Path:
        return self.root / f"{name}{self.DESCRIPTOR_SUFFIX}"

    def socket(self, name: str) -> Path:
        return self.root / f"{name}{self.SOCKET_SUFFIX}"

    def lock(self, name: str) -> Path:
        return self.root / f"{name}{self.LOCK_SUFFIX}"

    def descriptors(self) -> list[Path]:
        """Every daemon descriptor present, sorted by name."""
        return sorted(self.root.glob(f"*{self.DESCRIPTOR_SUFFIX}"))

    @classmethod
    def daemon_of(cls, descriptor: Path) -> str:
        """The daemon a descriptor's file name says it is."""
        return descriptor.name.removesuffix(cls.DESCRIPTOR_SUFFIX)

    # -- the event log -----------------------------------------------------------------------------------

    @property
    def events(self) -> Path:
        return self.root / self.EVENTS

    @classmethod
    def rotated(cls, log: Path) -> Path:
        """Where `log` goes when it is full (the previous generation)."""
        return log.with_name(log.name + cls.ROTATED_SUFFIX)

    # -- ranks still loading -----------------------------------------------------------------------------

    @property
    def loading(self) -> Path:
        return self.root / self.LOADING

    def loading_record(self, pid: int) -> Path:
        return self.loading / f"{pid}{self.DESCRIPTOR_SUFFIX}"

    def loading_lock(self, pid: int) -> Path:
        return self.loading / f"{pid}{self.LOCK_SUFFIX}"

    # -- serving engines ---------------------------------------------------------------------------------

    @property
    def engines(self) -> Path:
        return self.root / self.ENGINES

    def engine(self, pid: int) -> Path:
        return self.engines / f"{pid}{self.DESCRIPTOR_SUFFIX}"

    def engine_token(self, pid: int) -> Path:
        return self.engines / f"{pid}{self.TOKEN_SUFFIX}"

    @classmethod
    def engine_files(cls, engines: Path) -> list[Path]:
        """Every engine announcement in `engines` (the checked directory), sorted."""
        return sorted(engines.glob(f"*{cls.DESCRIPTOR_SUFFIX}"))

    # -- `wcache serve` launchers -----------------------------------------------------------------------

    @property
    def servers(self) -> Path:
        return self.root / self.SERVERS

    def server(self, launcher_pid: int) -> Path:
        return self.servers / f"{launcher_pid}{self.DESCRIPTOR_SUFFIX}"

    def server_restart(self, launcher_pid: int) -> Path:
        return self.servers / f"{launcher_pid}{self.RESTART_SUFFIX}"

    @classmethod
    def server_files(cls, servers: Path) -> list[Path]:
        """Every launcher's record in `servers`, sorted (restart requests left out)."""
        return sorted(p for p in servers.glob(f"*{cls.DESCRIPTOR_SUFFIX}") if not p.name.endswith(cls.RESTART_SUFFIX))

    # -- logs --------------------------------------------------------------------------------------------

    @property
    def logs(self) -> Path:
        return self.root / self.LOGS

    def supervisor_log(self, pid: int) -> Path:
        return self.logs / f"supervisor-{pid}.log"

    def serve_log(self, launcher_pid: int) -> Path:
        return self.logs / f"serve-{launcher_pid}.log"

    def serve_starter_log(self, launcher_pid: int) -> Path:
        """The output of `wcache serve`'s pre-imported zygote and forkserver (its servers log to `serve_log`)."""
        return self.logs / f"serve-{launcher_pid}-starter.log"

    def rank_log(self, supervisor_pid: int, rank: int) -> Path:
        return self.logs / f"preload-{supervisor_pid}-rank{rank}.log"
