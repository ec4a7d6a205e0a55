#!/usr/bin/env bash
# The prepared GPU check, from the repo root, as one command of at most 600 s:
#     bash benchmarks/gpu_check.sh                               # the main plan, $OUT
#     bash benchmarks/gpu_check.sh more                          # the second command
#     DRY_RUN=1 OUT=/tmp/gpu_dry bash benchmarks/gpu_check.sh    # the same steps on the CPU
# Made for an offline CUDA image (Python 3.12, torch 2.11, transformers 5.17, triton 3.6; no
# datasets, fastapi, uvicorn, openai or optuna; no network): the packages the training path
# needs and such an image lacks travel as wheels in .whl/ (`bash benchmarks/gpu_wheels.sh`),
# installed here with --no-index. Everything else is benchmarks/gpu_check.py, one driver
# process: steps in order of value under a running deadline, each measurement appended to
# $OUT/results.jsonl as it is made, $OUT/gpu_summary.md and $OUT/gpu_results.tar.gz rewritten
# after every step, the inductor and Triton caches archived under $OUT/caches/ (carry them
# back in .gpu_cache/ and the next run starts warm). docs/gpu.md has the plans and what each
# step accepts. Extra arguments go to the driver (e.g. --steps env,decode, --budget-s 300).
set -uo pipefail
WHEELS="${WHEELS:-.whl}"
export OUT="${OUT:-runs/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
CACHE="$(mktemp -d /tmp/gpu_check_cache.XXXXXX)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_ROOT_USER_ACTION=ignore \
    TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" TRITON_CACHE_DIR="$CACHE/triton"
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"  # grpo, grpo_kernels: no install
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="$(mktemp -d /tmp/gpu_check_site.XXXXXX)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl ||
        echo "gpu_check: installing $WHEELS/*.whl failed; the steps that need them will fail"
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
"$PY" -m benchmarks.gpu_check "$@"
code=$?
rm -rf "$CACHE"
exit $code
