#!/usr/bin/env bash
# The prepared GPU command of issue 35 on a lent GPU machine (no network, this package not installed; docs/benchmarks.md):
#   here, once: make gpu-wheels (.whl/)    there: bash benchmarks/gpu.sh OUT [gpu.py options]   (carry .whl)
# Installs .whl/*.whl into $GPU_SITE (/tmp/site), puts it and src/ on PYTHONPATH, runs gpu.py OUT --allow-dirty (that
# machine's tree carries older git metadata: the JSON records it), its log in OUT/gpu.log.
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
