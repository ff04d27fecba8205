"""`wcache serve`: a vLLM OpenAI server supervised over a daemon group that serves exactly its plan.

The argument check against a saved table of vLLM's options (`server_args`, `option_table`), the plan and the
daemon group (`daemons`), the starters (`starter`: the seam a warm starter plugs into), the supervision loop
(`launcher`, its backoff `backoff` and why a server died `exit_reason`), the run-dir record (`record`) and the
start-up caches keyed by the weights (`cache_roots`).
"""
