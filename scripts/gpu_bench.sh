#!/usr/bin/env bash
# The device-machine benchmarks, each recorded in BENCHMARKS.md (copied to $OUT):
#   scripts/gpu_bench.sh kernels decode     # any of: kernels decode e2e-i e2e-ii adapter-cache
#                                           prefix-cache serving tp demo-tasks lora-qwen3
#                                           lora-gemma2 head-lora quant-kernels quant quant-lora
#                                           fused-moe moe-lora-kernel moe-lora-engine alora (tp: two GPUs;
#                                           demo-tasks: the GGUF in $MANYLORA_CACHE/smollm2;
#                                           moe-lora-engine: an H200's memory)
# BENCH_REPEATS sets the timed passes of the parts that take --repeats (default: theirs).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/manylora-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then   # the server's packages, carried as wheels (see scripts/gpu_check.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
rep=${BENCH_REPEATS:+--repeats $BENCH_REPEATS}
for part in "$@"; do
  case "$part" in
    kernels) python3 -m benchmarks.bench_lora_kernels ;;
    decode) python3 -m benchmarks.bench_decode ;;
    e2e-i) python3 -m benchmarks.bench_e2e --part i ;;
    e2e-ii) python3 -m benchmarks.bench_e2e --part ii ;;
    adapter-cache) python3 -m benchmarks.bench_adapter_cache ;;
    prefix-cache) python3 -m benchmarks.bench_prefix_cache ;;
    serving) python3 -m benchmarks.bench_serving ;;
    tp) python3 -m benchmarks.bench_tp ;;
    demo-tasks) python3 -m benchmarks.bench_demo_tasks ;;
    lora-qwen3) python3 -m benchmarks.bench_lora --parts batch --arch qwen3 $rep ;;
    lora-gemma2) python3 -m benchmarks.bench_lora --parts batch --arch gemma2 $rep ;;
    head-lora) python3 -m benchmarks.bench_head_lora $rep ;;
    quant-kernels) python3 -m benchmarks.bench_quant_kernels --apply ;;
    quant) python3 -m benchmarks.bench_quant --parts gemm decode ;;
    quant-lora) python3 -m benchmarks.bench_quant --parts lora --formats fp8 $rep ;;
    fused-moe) python3 -m benchmarks.bench_fused_moe ;;
    moe-lora-kernel) python3 -m benchmarks.bench_moe_lora --parts kernel ;;
    moe-lora-engine) python3 -m benchmarks.bench_moe_lora --parts engine ;;
    alora) python3 -m benchmarks.bench_alora ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac 2>&1 | tee "$out/bench_$part.log"
  cp BENCHMARKS.md "$out/" 2>/dev/null
done
