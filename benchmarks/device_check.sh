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
# and wcache's dependencies. DEVICE_CHECK_TIMEOUT_S caps the run (default 300).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-$repo/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
    echo "device_check: no Python interpreter at $python; set PYTHON to one with torch and wcache's dependencies." >&2
    exit 2
fi
exec timeout --signal=TERM --kill-after=15 "${DEVICE_CHECK_TIMEOUT_S:-300}" "$python" "$here/device_check.py" "$@"
