"""Everything that crosses a process boundary: the daemon wire (`wire`), the run dir and what ranks publish in it
(`run_dir`), the shared-memory arenas (`arenas`), the HTTP server base and client (`http`), and the command line
of every Python child (`interpreter`).

The sub-packages import each other one way: `run_dir` and `arenas` may import `wire`; `wire`, `http` and
`interpreter` import nothing else of `ipc` (tests/test_layering.py)."""
