"""Process-wide CLI settings that the root callback sets and main() reads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(slots=True)
class CliState:
    verbose: bool = field(default_factory=lambda: os.environ.get("WCACHE_DEBUG", "") not in ("", "0"))


state = CliState()
