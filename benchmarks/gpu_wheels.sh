#!/usr/bin/env bash
# The wheels an offline CUDA image without `datasets` needs to run benchmarks/gpu_check.sh,
# downloaded into one folder that travels with the check (docs/gpu.md), from the repo root:
#     bash benchmarks/gpu_wheels.sh                 # -> .whl/ (git-ignored), for Python 3.12
#     PYTHON_VERSION=3.11 bash benchmarks/gpu_wheels.sh /tmp/whl    # another Python, folder
# `datasets` (grpo.data builds its tables with it) and the two packages it needs that such an
# image lacks (dill, multiprocess); everything else it imports (pyarrow, pandas, fsspec, xxhash,
# huggingface_hub, requests, httpx) is on the image. datasets 4.4.2 accepts huggingface_hub
# 1.x. Binary wheels only, no dependencies resolved (the image's own versions stay). Fails if
# the folder reaches LIMIT_MIB (64): what travels with the check has a size limit.
# LIGER=1 adds liger-kernel (optional: the logprobs step then benchmarks it too).
set -euo pipefail
DIR="${1:-.whl}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
LIMIT_MIB="${LIMIT_MIB:-64}"
PY="${PYTHON:-python3}"
PKGS=(datasets==4.4.2 dill==0.4.0 multiprocess==0.70.18)
[[ "${LIGER:-0}" == 1 ]] && PKGS+=(liger-kernel==0.8.5)
mkdir -p "$DIR"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp "${platforms[@]}" -d "$DIR" "${PKGS[@]}"
# one version of each package: a second one would stop the whole install on the image
dupes=$(ls "$DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
if [[ -n "$dupes" ]]; then
    echo "gpu_wheels: $DIR holds two versions of: $dupes (remove the old wheels)" >&2
    exit 1
fi
kib=$(du -sk "$DIR" | cut -f1)
if ((kib >= LIMIT_MIB * 1024)); then
    echo "gpu_wheels: $DIR is $((kib / 1024)) MiB, at or over the ${LIMIT_MIB} MiB limit" >&2
    exit 1
fi
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $kib KiB in $DIR" \
    "(Python $PYTHON_VERSION): $(ls "$DIR"/*.whl | xargs -n1 basename | tr '\n' ' ')"
