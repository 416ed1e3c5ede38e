#!/usr/bin/env bash
# The prepared GPU command of issue 35 (benchmarks/gpu.py) on a lent GPU machine: Python 3.12 with torch, lightning,
# torchmetrics, safetensors ..., no network, this package not installed.
#   here, once:  make gpu-wheels                        (.whl/: the wheels that machine lacks, hydra among them)
#   there:       bash benchmarks/gpu.sh OUT [gpu.py options]     (the device tool: carry .whl, OUT the folder it returns)
# Installs .whl/*.whl into /tmp/site ($GPU_SITE), puts it and src/ on PYTHONPATH, then runs gpu.py OUT --allow-dirty
# (that machine's copy of the tree carries older git metadata: the JSON records it) with its log in OUT/gpu.log.
set -euo pipefail
cd "$(dirname "$0")/.."
site="${GPU_SITE:-/tmp/site}" python="${PYTHON:-python3}"
out="${1:?usage: bash benchmarks/gpu.sh OUT [gpu.py options]}"
shift
if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "benchmarks/gpu.sh: no wheels in $PWD/.whl: run 'make gpu-wheels' on a machine with network, then carry .whl" >&2
    exit 2
fi
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
"$python" benchmarks/gpu.py "$out" --allow-dirty "$@" 2>&1 | tee "$out/gpu.log"
