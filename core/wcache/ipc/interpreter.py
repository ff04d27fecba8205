"""The command line of every Python child wcache starts: this interpreter, importing only what is installed.

`python -m pkg` puts the working directory first on `sys.path`, so a `wcache/` package or a `wcache.py` in
the directory a user ran a command from would be imported (and executed) in a daemon rank instead of the
installed package. `-P` (Python 3.11+) leaves the working directory off `sys.path`; `PYTHONPATH` and the
installed packages are searched as usual. Children started through multiprocessing's spawn (the TP engine
ranks) copy their parent's `sys.path` and pass `-P` on when the parent has it, so they need nothing here. A
child that runs another project's code, which starts Python children of its own (vLLM's model registry runs
`python -m` to inspect a model class), also gets `PYTHONSAFEPATH` (`safe_path_env`): `-P` for every
interpreter below it, however it is started.
"""

from __future__ import annotations

import sys


def safe_path_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with `PYTHONSAFEPATH` set, which every Python process started under it inherits as `-P`."""
    return {**env, "PYTHONSAFEPATH": "1"}


def python_module_argv(module: str, *args: str) -> list[str]:
    """`[python, -P, -m, module, *args]` for this interpreter: `module` from the installed packages only."""
    return [sys.executable, "-P", "-m", module, *args]
