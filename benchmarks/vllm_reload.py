"""vLLM's in-place reload (`reload_weights`) from a wcache daemon against the same reload from disk, in one engine.

What `wcache switch URL` and `wcache serve --follow` cost vLLM itself, apart from wcache's work: one offline
`LLM(load_format="wcache")` (vLLM's CPU build, TP 1) on the ``--preset`` checkpoint's daemon, then ``--repeat``
rounds, each reloading the same weights in place twice, alternately: through the `wcache` load format (the daemon's
tensors as zero-copy views of its arena, mapped anew) and through vLLM's own `auto` loader (the checkpoint's files,
page cache warm). Both run vLLM's post-processing (on CPU its oneDNN repack of every linear layer). The first
round pays vLLM's first reload once, so the medians are of the rounds after it.

Run under the vLLM lock::

    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_reload.py              # qwen3-0.6b, 6 rounds
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from bench_common import benchmark_arguments, fmt_seconds, workspace
from wcache.daemon.launch import start_daemons
from wcache.integrations.vllm.switch import LOAD_FORMAT
from wcache_dev.synth import write_checkpoint


def _reload(llm: object, model: Path, load_format: str, extra: dict[str, object]) -> float:
    override = {"load_config": {"load_format": load_format, "model_loader_extra_config": extra}}
    llm.collective_rpc("update_config", args=(override,))  # type: ignore[attr-defined]
    began = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model),  # type: ignore[attr-defined]
                                                 "is_checkpoint_format": True})
    return time.perf_counter() - began


def main() -> int:
    parser = benchmark_arguments(__doc__.splitlines()[0])
    parser.set_defaults(repeat=6)
    args = parser.parse_args()
    with workspace(args.workdir) as work:
        run_dir = work / "run"
        os.environ.update({"WCACHE_RUN_DIR": str(run_dir), "WCACHE_CACHE_DIR": str(work / "store"),
                           "VLLM_CPU_KVCACHE_SPACE": "1"})
        model = work / args.preset
        if not model.exists():
            write_checkpoint(args.preset, model)
        group = start_daemons(model, run_dir=run_dir, dtype="bfloat16", layout="fused")
        try:
            from vllm import LLM

            extra: dict[str, object] = {"run_dir": str(run_dir), "fallback": False}
            llm = LLM(str(model), load_format=LOAD_FORMAT, model_loader_extra_config=extra, max_model_len=512,
                      enforce_eager=True)
            rounds = [(_reload(llm, model, LOAD_FORMAT, extra), _reload(llm, model, "auto", {}))
                      for _ in range(args.repeat)]
        finally:
            group.terminate()
    daemon = [r[0] for r in rounds[1:]] or [rounds[0][0]]
    disk = [r[1] for r in rounds[1:]] or [rounds[0][1]]
    print(f"vLLM reload_weights in place on {args.preset} (TP 1, CPU), {len(rounds)} rounds, alternately:")
    print(f"  from the daemon (load format wcache): median {fmt_seconds(statistics.median(daemon))} "
          f"({', '.join(fmt_seconds(r[0]) for r in rounds)})")
    print(f"  from disk (vLLM's auto loader):       median {fmt_seconds(statistics.median(disk))} "
          f"({', '.join(fmt_seconds(r[1]) for r in rounds)})")
    print(f"  daemon / disk: {statistics.median(daemon) / statistics.median(disk):.2f}× (rounds after the first); "
          f"{os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
