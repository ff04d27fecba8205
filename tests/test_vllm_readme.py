"""The README's vLLM example, its commands as written, on a float32 checkpoint on CPU (where vLLM's `auto` dtype is
bfloat16): the server hits the daemon the example preloads. The checkpoint is the small preset in float32, in a
Hugging Face cache written by the test under the README's repo id; the server gets a free port and
`--enforce-eager` appended (CPU compilation would only add minutes), nothing else."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from daemon_fixtures import daemon_rig, http_status, nothing_survives, wait_for  # noqa: F401
from helpers import free_port
from hub_cache import write_hub_cache
from safetensors.torch import load_file, save_file
from wcache_dev.synth import write_checkpoint

README = Path(__file__).resolve().parents[1] / "README.md"
SERVER_START_S = 600.0


def _readme_vllm_commands() -> list[str]:
    """The README's vLLM example's lines after the install."""
    block = re.search(r"\*\*vLLM\*\*.*?```bash\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "the README has no vLLM example"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("pip install")]


def _float32_small(dest: Path) -> Path:
    model = write_checkpoint("small", dest)
    for shard in model.glob("*.safetensors"):
        save_file({name: t.to(torch.float32) for name, t in load_file(shard).items()}, shard)
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config.replace('"bfloat16"', '"float32"'))
    return model


def test_the_readme_vllm_example_hits_on_cpu_as_written() -> None:
    preload_line, server_line = _readme_vllm_commands()
    repo_id = preload_line.split()[2]
    with daemon_rig() as rig:
        hub = rig.base / "hub"
        write_hub_cache(hub, repo_id, _float32_small(rig.base / "small-float32"))
        bin_dir = str(Path(sys.executable).parent)
        env = {**os.environ, **rig.env, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        preloaded = subprocess.run(["bash", "-c", preload_line], env=env, capture_output=True, text=True,
                                   timeout=300)
        assert preloaded.returncode == 0, preloaded.stderr
        port = free_port()
        log_path = rig.base / "vllm.log"
        command = server_line.replace("python ", f"{sys.executable} ", 1) + f" --port {port} --enforce-eager"
        with log_path.open("w") as log:
            server = subprocess.Popen(["bash", "-c", f"exec {command}"], stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            wait_for(lambda: server.poll() is not None or _healthy(f"http://127.0.0.1:{port}/health"),
                     timeout=SERVER_START_S, interval=1.0, what="the README's vLLM server")
            log_text = log_path.read_text()
            assert server.poll() is None, log_text[-3000:]
            assert "wcache: weight cache hit from daemon" in log_text, log_text[-3000:]
            assert "weight cache miss" not in log_text
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)  # vLLM's engine core and workers share its session
            server.wait()


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        return http_status(url, timeout=2)[0] == 200
    return False
