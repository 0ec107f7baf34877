#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a host with CUDA torch and transformers already
# installed. Wheels of what that host lacks travel in .whl/ (pydantic, megatron-core); the tiny
# model's folder in .gpu/tiny. Prints ONE JSON line.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
exec timeout 300 python3 bench/gpu_check.py "${1:-.gpu/tiny}"
