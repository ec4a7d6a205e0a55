#!/usr/bin/env bash
# The one prepared GPU check for the whole library, from the repo root, as one command:
#     bash benchmarks/gpu_check.sh                               # results under $OUT
#     DRY_RUN=1 OUT=/tmp/gpu_dry bash benchmarks/gpu_check.sh    # the same steps on the CPU
# Made for an offline CUDA image (Python 3.12, torch 2.11, transformers 5.17, triton 3.6,
# pyarrow, pandas; no datasets, fastapi, uvicorn, openai or optuna; no network): the packages
# the training path needs and such an image lacks travel as wheels in .whl/
# (`bash benchmarks/gpu_wheels.sh`), installed by the first step with --no-index.
# Every step runs under its own time limit, so a slow step cannot eat the others; the limits
# sum to at most 540 s (tests/test_gpu_check.py), so the whole check fits a 600 s budget:
#   install-wheels       only where .whl/*.whl exist: pip --no-index --no-deps --target
#   env                  nvidia-smi, versions, packages the later steps need
#   pytest-cuda          pytest -m cuda over every test file holding a cuda-marked test
#   parity               benchmarks.gpu_parity: decoder log-softmax and sampler greedy vs
#                        transformers, tiny + Qwen3-0.6B shape, float32 and bf16 budgets
#   sampler-eager        bench_sampler, Qwen3-0.6B shape, B = 32 and 128: ours vs generate
#   sampler-compiled     the same at B = 128 with our compiled decode step (CUDA graphs)
#   decode-attention     the decode step's attention at B=128, S=1280, Qwen3-0.6B heads, bf16:
#                        the old SDPA call (mask + enable_gqa) beside decode_sdpa
#   logprobs             bench_logprobs at N=16384, C=1024, V=151936 bf16: naive, chunked,
#                        Liger (if carried), ours
#   tiny-model           the tiny random-init checkpoint the next two steps train
#   grpo-ddp, grpo-fsdp  configs/tiny_ci.yaml under `torchrun --standalone --nproc_per_node=1`
#                        with train.parallel=ddp (20 steps) and fsdp (5 steps): the NCCL
#                        process group, DDP and FSDP2 on one GPU; metrics.jsonl summarized:
#                        step time, peak memory, sampler-vs-trainer log-prob diff, and the
#                        run's `run/parallel` (must name nccl)
#   tutorial-model, tutorial-grpo
#                        4 steps of configs/gsm8k_qwen3_0.6b_grpo.yaml as written (fp32 + bf16
#                        autocast + LoRA + gradient checkpointing) at the Qwen3-0.6B shape:
#                        sampler-vs-trainer log-prob diff (bf16 budget 1e-2), step time, peak
#                        memory per phase
#   tutorial-async       the same 4 steps with rollout.async=on, max_staleness 1 (colocated):
#                        step time and the trainer's wait next to the synchronous run's
#   precision            bench_precision at the Qwen3-0.6B shape: sampler vs trainer and bf16
#                        vs float32 log-probs (docs/precision.md)
#   step                 bench_step at the Qwen3-0.6B shape, LoRA and full, with a same-size
#                        reward model scoring each rollout (--reward-model) and PPO's critic
#                        (--critic: values, GAE, its update) beside GRPO's step
#   packing              bench_step --lengths gsm8k,uniform at the Qwen3-0.6B shape (LoRA):
#                        padded vs packed training passes, the measurement that decides
#                        train.pack_sequences: auto on CUDA (docs/benchmarks.md)
# Output: $OUT (default runs/gpu_check) gets gpu_check.log, gpu_summary.md (every step's exit
# and last line, then every table) and gpu_results.tar.gz (every JSON/MD, the runs'
# metrics.jsonl, pytest's JUnit XML: three files to copy back), rewritten after each step so a
# kill keeps what finished; unpacked they are also left in $RES.
# DRY_RUN=1: CPU (gloo), tiny shapes, short lengths, few GRPO steps, limits x3 (a busy 2-core
# machine); the cuda tests skip.
set -uo pipefail
export DRY_RUN="${DRY_RUN:-0}"
WHEELS="${WHEELS:-.whl}"  # the carried wheel folder (benchmarks/gpu_wheels.sh)
OUT="${OUT:-runs/gpu_check}"
RES="${RES:-$(mktemp -d /tmp/gpu_check_results.XXXXXX)}"
WORK="$(mktemp -d /tmp/gpu_check_work.XXXXXX)"
mkdir -p "$OUT" "$RES"
LOG="$OUT/gpu_check.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_ROOT_USER_ACTION=ignore
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
: >"$LOG"

if [[ "$DRY_RUN" == 1 ]]; then
    TAG=dry DEV=cpu SCALE=3 STEPS=4 SIZE=ci
else
    TAG=gpu DEV=cuda SCALE=1 STEPS=20 SIZE=qwen3-0.6b
fi
NAMES=() LIMITS=() CODES=() SECS=() LAST=() MDS=()

cat >"$WORK/env.py" <<'EOF'
import importlib.metadata as md, importlib.util as u, os, platform, subprocess, torch
if os.environ.get('DRY_RUN') == '1':
    print('dry run: no GPU, nvidia-smi skipped')
else:
    subprocess.run(['nvidia-smi'])
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
for m, d in [('triton', 'triton'), ('transformers', 'transformers'), ('safetensors', 'safetensors'),
             ('tokenizers', 'tokenizers'), ('datasets', 'datasets'), ('yaml', 'pyyaml'),
             ('pytest', 'pytest'), ('liger_kernel', 'liger-kernel')]:
    print(f'{m}:', md.version(d) if u.find_spec(m) else 'MISSING')
if u.find_spec('datasets') is None:
    print('datasets is missing: the training steps will fail; carry its wheels '
          '(bash benchmarks/gpu_wheels.sh, docs/gpu.md)')
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, p.multi_processor_count, 'SMs', round(p.total_memory / 2**30), 'GiB')
else:
    print('no CUDA device')
EOF
pack() {  # summary + tarball into $OUT; cheap, so after every step
    tar -czf "$OUT/gpu_results.tar.gz.part" -C "$RES" . && \
        mv "$OUT/gpu_results.tar.gz.part" "$OUT/gpu_results.tar.gz"
    {
        echo "# gpu_check ($TAG) $(date -u +%Y-%m-%dT%H:%M:%SZ)," \
            "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo
        echo "| step | limit_s | seconds | exit | last line |"
        echo "|---|---|---|---|---|"
        for i in "${!NAMES[@]}"; do
            echo "| ${NAMES[$i]} | ${LIMITS[$i]} | ${SECS[$i]} | ${CODES[$i]} | ${LAST[$i]//|//} |"
        done
        for md in "${MDS[@]}"; do
            [[ -e "$md" ]] && { echo; sed 's/^# /## /' "$md"; }
        done
    } >"$OUT/gpu_summary.md"
}

step() {  # step SECONDS NAME COMMAND...
    local secs=$(($1 * SCALE)) name=$2 t0=$SECONDS code cmd
    shift 2
    cmd="$*"
    echo "=== $name ($(date -u +%H:%M:%S), limit ${secs}s): ${cmd:0:400}" | tee -a "$LOG"
    timeout --kill-after=5 "$secs" "$@" 2>&1 | tee -a "$LOG" "$WORK/step.out"
    code=${PIPESTATUS[0]}
    echo "=== $name exit $code$([[ $code == 124 || $code == 137 ]] && echo ' (timed out)')" |
        tee -a "$LOG"
    NAMES+=("$name") LIMITS+=("$secs") CODES+=("$code") SECS+=("$((SECONDS - t0))")
    LAST+=("$(grep -v -e '^\s*$' -e '^|' "$WORK/step.out" | tail -n 1 | cut -c1-160)")
    : >"$WORK/step.out"
    for md in "$RES"/*.md; do  # tables in the order their steps ran
        [[ -e "$md" && " ${MDS[*]} " != *" $md "* ]] && MDS+=("$md")
    done
    pack
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    step 10 install-wheels "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --target "$WORK/site" "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
step 10 env "$PY" "$WORK/env.py"
if [[ "$DRY_RUN" != 1 ]] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"
then
    echo "=== no CUDA device: stopping (DRY_RUN=1 runs the steps on the CPU)" | tee -a "$LOG"
    exit 1
fi

mapfile -t CUDA_TESTS < <(grep -l "pytest.mark.cuda" tests/test_*.py)
step 60 pytest-cuda "$PY" -m pytest -m cuda "${CUDA_TESTS[@]}" -q -rs -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$RES/pytest_cuda_$TAG.xml"

if [[ "$DRY_RUN" == 1 ]]; then
    PARITY=(--device cpu --sizes tiny --seq-len 32 --new-tokens 8)
    SAMPLER=("$PY" -m benchmarks.bench_sampler --cases tiny --device cpu --dtype float32
        --prompt-len 16 --new-tokens 8 --warmup 1 --rounds 2 --out-dir "$RES")
    CASE=tiny SMALL_FIRST=2x2,4x2 BIG=4x2 ATTN=8x256
    LOGPROBS=(--device cpu --dtype float32 --quick --shapes 256x64x1024)
else
    PARITY=(--device cuda --sizes tiny,qwen3-0.6b)
    # float32: greedy parity with generate is exact there (the bench's check before timing)
    # and it is model.dtype of configs/gsm8k_qwen3_0.6b_grpo.yaml; bf16 is judged by parity.
    SAMPLER=("$PY" -m benchmarks.bench_sampler --cases qwen3-0.6b --device cuda --dtype float32
        --warmup 1 --rounds 3 --out-dir "$RES")
    CASE=qwen3-0.6b SMALL_FIRST=4x8,16x8 BIG=16x8 ATTN=128x1280  # P x G: B = 32, 128
    LOGPROBS=(--device cuda --dtype bfloat16 --shapes 16384x1024x151936)
fi
step 30 parity "$PY" -m benchmarks.gpu_parity "${PARITY[@]}" --name "parity_$TAG" \
    --out-dir "$RES"
step 35 sampler-eager "${SAMPLER[@]}" --batches "$SMALL_FIRST" --hf-caches dynamic \
    --name "sampler_${TAG}_eager"
# one compile per batch shape (expected about a minute at 0.6B): B = 128 only, the
# throughput shape; generate's own compiled path (static cache) is left out (docs/gpu.md)
step 60 sampler-compiled "${SAMPLER[@]}" --batches "$BIG" --compile "$CASE" --no-eager \
    --hf-caches dynamic --name "sampler_${TAG}_compiled"
# the decode step's attention at B=128, S=1280, Qwen3-0.6B heads, bf16: before / now
step 15 decode-attention "$PY" -m benchmarks.bench_sampler --cases none --device "$DEV" \
    --dtype bfloat16 --decode-attention "$ATTN" --name "sampler_${TAG}" --out-dir "$RES"
step 35 logprobs "$PY" -m benchmarks.bench_logprobs "${LOGPROBS[@]}" \
    --impls naive,chunked,liger,triton --name "logprobs_${TAG}_main" --out-dir "$RES"

# A process group even on one GPU: torchrun with one rank joins NCCL (gloo on the dry run)
# and trains through DDP, then FSDP2; each run's metrics.jsonl must say so (run/parallel).
BACKEND=$([[ "$DRY_RUN" == 1 ]] && echo gloo || echo nccl)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1)
step 10 tiny-model "$PY" -m grpo tiny-model --out "$WORK/tiny-model"
TINY=(--config configs/tiny_ci.yaml "model.path=$WORK/tiny-model" "model.device=$DEV")
step 40 grpo-ddp "$PY" -m benchmarks.gpu_run --name "grpo_ddp_$TAG" --out-dir "$RES" \
    --metrics "$WORK/grpo-ddp/metrics.jsonl" --accept 1e-4 \
    --parallel "ddp over 1 rank ($BACKEND)" -- "${TORCHRUN[@]}" -m grpo train "${TINY[@]}" \
    "train.output_dir=$WORK/grpo-ddp" "train.max_steps=$STEPS" train.parallel=ddp
step 35 grpo-fsdp "$PY" -m benchmarks.gpu_run --name "grpo_fsdp_$TAG" --out-dir "$RES" \
    --metrics "$WORK/grpo-fsdp/metrics.jsonl" --accept 1e-4 \
    --parallel "fsdp over 1 rank ($BACKEND)" -- "${TORCHRUN[@]}" -m grpo train "${TINY[@]}" \
    "train.output_dir=$WORK/grpo-fsdp" train.max_steps=5 train.save_every=5 train.parallel=fsdp

# The tutorial's own GRPO config as written (fp32 weights + bf16 autocast + LoRA r16 q/k/v/o +
# gradient checkpointing) at the Qwen3-0.6B shape (random init, the ci tokenizer), on the
# repo's GSM8K test split; only the model, data, lengths and step count overridden. Reports
# the sampler-vs-trainer log-prob difference under bf16 (budget 1e-2, docs/precision.md),
# step time and peak memory per phase.
if [[ "$DRY_RUN" == 1 ]]; then
    TUT_SIZE=ci TUT_STEPS=2 TUT_NEW=8
else
    TUT_SIZE=qwen3-0.6b TUT_STEPS=4 TUT_NEW=128
fi
step 25 tutorial-model "$PY" -c "import json, sys; from pathlib import Path
from benchmarks.bench_trl import make_checkpoint
p = make_checkpoint(Path(sys.argv[1]), sys.argv[2]); f = p / 'config.json'
c = json.loads(f.read_text()); c['max_position_embeddings'] = 2048; f.write_text(json.dumps(c))
print(p)" "$WORK/tutorial" "$TUT_SIZE"
TUT=(--config configs/gsm8k_qwen3_0.6b_grpo.yaml model.path="$WORK/tutorial/$TUT_SIZE"
    model.adapter=null model.device="$DEV" data.source=tests/data/gsm8k data.split=test
    data.max_samples=64 data.eval_samples=0 rollout.max_new_tokens="$TUT_NEW"
    rollout.compile=off train.max_steps="$TUT_STEPS" train.log_every=1)
step 50 tutorial-grpo "$PY" -m benchmarks.gpu_run --name "grpo_tutorial_$TAG" \
    --out-dir "$RES" --metrics "$WORK/tutorial-run/metrics.jsonl" --accept 1e-2 \
    --parallel "ddp over 1 rank ($BACKEND)" -- "${TORCHRUN[@]}" -m grpo train "${TUT[@]}" \
    train.output_dir="$WORK/tutorial-run"
# the same run with asynchronous rollouts (colocated producer thread, max_staleness 1): the
# step time next to tutorial-grpo's; log-probs differ from the sampler's by design (stale
# batches), so no acceptance bound on them
step 30 tutorial-async "$PY" -m benchmarks.gpu_run --name "grpo_tutorial_async_$TAG" \
    --out-dir "$RES" --metrics "$WORK/tutorial-async/metrics.jsonl" --accept inf \
    -- "${TORCHRUN[@]}" -m grpo train "${TUT[@]}" train.output_dir="$WORK/tutorial-async" \
    rollout.async=on rollout.max_staleness=1
step 25 precision "$PY" -m benchmarks.bench_precision --size "$TUT_SIZE" --device "$DEV" \
    --no-compile --name "precision_${TAG}_$TUT_SIZE" --out-dir "$RES"

if [[ "$DRY_RUN" == 1 ]]; then
    STEP=(--prompts 2 --group-size 2 --max-new-tokens 8 --micro-batch-size 4 --repeats 1)
else
    STEP=(--prompts 4 --group-size 8 --max-new-tokens 64 --micro-batch-size 16 --repeats 3)
fi
# rollouts eager: the compiled step's cost at this shape is measured by sampler-compiled, and
# two more 0.6B compiles (LoRA and full) would not fit
step 50 step "$PY" -m benchmarks.bench_step --sizes "$SIZE" --device "$DEV" "${STEP[@]}" \
    --rollout-compile off --reward-model --critic --name "step_${TAG}_$SIZE" --out-dir "$RES"
if [[ "$DRY_RUN" == 1 ]]; then
    PACK=(--prompts 2 --group-size 2 --max-new-tokens 32 --micro-batch-size 4 --repeats 1)
else
    PACK=(--prompts 4 --group-size 8 --max-new-tokens 256 --micro-batch-size 16 --repeats 3)
fi
step 20 packing "$PY" -m benchmarks.bench_step --lengths gsm8k,uniform --modes lora \
    --sizes "$SIZE" --device "$DEV" --data gsm8k-test "${PACK[@]}" --name "packing_${TAG}_$SIZE" \
    --out-dir "$RES"

failed=0
for i in "${!CODES[@]}"; do [[ "${CODES[$i]}" == 0 ]] || failed=$((failed + 1)); done
echo "=== done $(date -u +%H:%M:%S): $failed of ${#CODES[@]} steps failed; $OUT/gpu_summary.md," \
    "$OUT/gpu_results.tar.gz; unpacked in $RES" | tee -a "$LOG"
rm -rf "$WORK"
[[ $failed == 0 ]]
