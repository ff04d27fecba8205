"""Stop signals as an exception: SIGTERM and SIGHUP (systemd, `docker stop`, a closed terminal) unwind a
command as Ctrl-C does, so what it started in sessions of their own (daemon supervisors) is stopped too."""

from __future__ import annotations


class StopSignal(BaseException):
    """A stop signal arrived; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_stop(signum: int, frame: object) -> None:
    """A signal handler: raise StopSignal in the main thread."""
    raise StopSignal(signum)
