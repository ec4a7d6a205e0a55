#!/usr/bin/env bash
# The one prepared GPU check for kernels/ (about 6-8 minutes on an H200), from the repo root:
#     bash benchmarks/gpu_check.sh
# 1. CUDA kernel tests (pytest -m cuda): Triton bf16 under the error budget, fp32 vs float64.
# 2. bench, main shape N=16384, C=1024, V=151936 bf16: naive, chunked, Liger, ours.
# 3. bench, the other GPU shapes (N=4096 / C=4096, V=128256), same impls.
# 4. bench, torch.compile(naive) at the main shape (slow to compile, so last and on its own).
# Writes gpu_check.log plus logprobs_gpu_{main,shapes,compile}.{json,md} under $OUT (default
# benchmarks/results). Each step has its own timeout, so a slow step cannot eat the others.
# Liger is not on the device image: to include it, first run here
#     pip download liger-kernel==0.8.5 --no-deps -d .whl
# and carry ".whl" with the call; the script installs any wheels found there.
set -uo pipefail
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
: >"$LOG"

step() {  # step SECONDS NAME COMMAND...
    local secs=$1 name=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${secs}s): $*" | tee -a "$LOG"
    timeout "$secs" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}

if compgen -G ".whl/*.whl" >/dev/null; then
    step 60 install-wheels "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
step 20 nvidia-smi nvidia-smi
step 20 versions "$PY" -c "import torch, triton; print(torch.__version__, triton.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"

step 120 pytest-cuda "$PY" -m pytest -m cuda tests/test_kernels.py tests/test_harness.py -q -rs \
    -p no:cacheprovider

BENCH=("$PY" -m benchmarks.bench_logprobs --device cuda --dtype bfloat16 --out-dir "$OUT")
step 90 bench-main "${BENCH[@]}" --name logprobs_gpu_main \
    --shapes 16384x1024x151936 --impls naive,chunked,liger,triton
step 120 bench-shapes "${BENCH[@]}" --name logprobs_gpu_shapes \
    --shapes 4096x1024x151936,4096x4096x128256,16384x4096x128256 --impls naive,chunked,liger,triton
step 120 bench-compile "${BENCH[@]}" --name logprobs_gpu_compile \
    --shapes 16384x1024x151936 --impls naive,compile --modes fwd_bwd,fwd_bwd_frozen --repeats 5
echo "=== done $(date -u +%H:%M:%S); results in $OUT" | tee -a "$LOG"
