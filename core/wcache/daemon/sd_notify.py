"""systemd readiness notification (sd_notify(3)) without libsystemd.

Under a `Type=notify` unit systemd passes `$NOTIFY_SOCKET`, a datagram socket (a path, or an abstract name
written with a leading `@`); a service says `READY=1` once it serves and `STOPPING=1` when it begins to stop.
Anywhere else the variable is unset and every call here does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("wcache")

ENV_VAR = "NOTIFY_SOCKET"
SEND_TIMEOUT_S = 1.0


class Notifier:
    """Where the service manager listens; a missing or refusing socket is one warning, never an error."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self._warned = False

    @classmethod
    def take_from_environment(cls) -> Notifier:
        """Read `$NOTIFY_SOCKET` and remove it, as sd_notify's unset_environment does: the processes we start
        (supervisor, ranks, anything they run) are not the service and must not report in its name."""
        return cls(os.environ.pop(ENV_VAR, None))

    def ready(self, status: str) -> bool:
        return self.send("READY=1", status)

    def stopping(self, status: str = "stopping every rank") -> bool:
        return self.send("STOPPING=1", status)

    def send(self, state: str, status: str | None = None) -> bool:
        """Send one notification; True if the socket took it. A no-op (False) when not under systemd."""
        if self.address is None:
            return False
        lines = [state]
        if status:
            # One assignment per line: a newline inside the text would start a bogus one.
            lines.append("STATUS=" + " ".join(status.splitlines()))
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto("\n".join(lines).encode(), target)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify the service manager at %s=%s (%s); readiness is not reported.",
                            ENV_VAR, self.address, exc.strerror or exc)
            return False
        return True
