#!/usr/bin/env bash
# The one prepared GPU check for the whole library (about 7 minutes on one H200 as estimated,
# not yet measured with the tutorial steps; the step limits sum to 10), from the repo root:
#     bash benchmarks/gpu_check.sh                               # results under $OUT
#     DRY_RUN=1 OUT=/tmp/gpu_dry bash benchmarks/gpu_check.sh    # the same steps on the CPU
# Steps, in order, each under its own timeout (a slow step cannot eat the others):
#   nvidia-smi, env      GPU, versions, packages the later steps need
#   pytest-cuda          pytest -m cuda over every test file holding a cuda-marked test
#   parity               benchmarks.gpu_parity: decoder log-softmax and sampler greedy vs
#                        transformers, tiny + Qwen3-0.6B shape, float32 and bf16 budgets
#   sampler-eager        bench_sampler, Qwen3-0.6B shape, B = 32 and 128: ours vs generate
#   sampler-compiled     the same with our compiled decode step (CUDA graphs)
#   logprobs             bench_logprobs at N=16384, C=1024, V=151936 bf16: naive, chunked,
#                        Liger (if carried), ours
#   tiny-model, grpo-train, grpo-summary
#                        20 GRPO steps of configs/tiny_ci.yaml on CUDA under torchrun
#                        (one process, NCCL); metrics.jsonl summarized: step time, peak memory,
#                        sampler-vs-trainer log-prob diff
#   tutorial-model, tutorial-grpo, tutorial-summary
#                        4 steps of configs/gsm8k_qwen3_0.6b_grpo.yaml as written (fp32 + bf16
#                        autocast + LoRA + gradient checkpointing) at the Qwen3-0.6B shape:
#                        sampler-vs-trainer log-prob diff (bf16 budget 1e-2), step time, peak
#                        memory per phase, the compiled sampler's kept KV cache
#   tutorial-async, tutorial-async-summary
#                        the same 4 steps with rollout.async=on, max_staleness 1 (colocated):
#                        step time and the trainer's wait next to the synchronous run's
#   precision            bench_precision at the Qwen3-0.6B shape: sampler vs trainer and bf16
#                        vs float32 log-probs (docs/precision.md)
#   step                 bench_step at the Qwen3-0.6B shape, LoRA and full
# Output: $OUT (default runs/gpu_check) gets gpu_check.log, gpu_summary.md (every step's exit
# and last line, then every table) and gpu_results.tar.gz (every JSON/MD, the run's
# metrics.jsonl, pytest's JUnit XML), rewritten after each step so a kill keeps what finished;
# unpacked they are also left in $RES. The device tool returns at most 8 files: hence the tar.
# DRY_RUN=1: CPU, tiny shapes, short lengths, 4 GRPO steps, limits x3 (a busy 2-core machine);
# the cuda tests skip. Needs nothing beyond the project's dependencies; where one is missing
# (the device image lacks `datasets`), put wheels in .whl/ and carry it (docs/gpu.md): the
# script installs any wheels found there. Liger likewise: `pip download liger-kernel==0.8.5
# --no-deps -d .whl`.
set -uo pipefail
DRY_RUN="${DRY_RUN:-0}"
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
import importlib.metadata as md, importlib.util as u, platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
for m, d in [('triton', 'triton'), ('transformers', 'transformers'), ('safetensors', 'safetensors'),
             ('tokenizers', 'tokenizers'), ('datasets', 'datasets'), ('yaml', 'pyyaml'),
             ('pytest', 'pytest'), ('liger_kernel', 'liger-kernel')]:
    print(f'{m}:', md.version(d) if u.find_spec(m) else 'MISSING')
if u.find_spec('datasets') is None:
    print('datasets is missing: grpo-train and step will fail; carry its wheels (docs/gpu.md)')
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, p.multi_processor_count, 'SMs', round(p.total_memory / 2**30), 'GiB')
else:
    print('no CUDA device')
EOF
cat >"$WORK/grpo_summary.py" <<'EOF'
"""metrics.jsonl of the GRPO run -> one row: step time, peak memory, on-policy log-prob diff."""
import shutil, statistics as st, sys
from benchmarks.harness import write_results
from grpo.metrics import read_metrics
src, res, name, config = sys.argv[1:5]
accept = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-4  # max diff: 1e-4 fp32, 1e-2 bf16
recs = read_metrics(src)
shutil.copy(src, f'{res}/{name}_metrics.jsonl')
later = recs[1:] or recs  # step 1 pays for compiling the decode step
med = lambda k: st.median(r[k] for r in later)
row = {
    'steps': len(recs), 'first_step_s': recs[0]['perf/step_s'], 'step_s': med('perf/step_s'),
    'rollout_s': med('perf/rollout_s'), 'logprob_s': med('perf/logprob_s'),
    'update_s': med('perf/update_s'), 'tokens_per_s': med('perf/tokens_per_s'),
    'peak_mem_mib': max(r['perf/peak_mem_mib'] for r in recs),
    'logprob_diff_max': max(r['rollout/logprob_diff_max'] for r in recs),
    'logprob_diff_mean': st.mean(r['rollout/logprob_diff_mean'] for r in recs),
    'first_pass_ratio_mean': st.mean(r['rollout/first_pass_ratio_mean'] for r in recs),
    'ratio_min': min(r['rollout/first_pass_ratio_mean'] for r in recs),
    'ratio_max': max(r['rollout/first_pass_ratio_mean'] for r in recs),
    'reward_first': recs[0]['rollout/reward_mean'], 'reward_last': recs[-1]['rollout/reward_mean'],
}
for phase in ('rollout', 'logprob', 'update'):  # per-phase peaks (CUDA: restarted per phase)
    key = f'perf/peak_mem_{phase}_mib'
    if key in recs[0]:
        row[f'peak_{phase}_mib'] = max(r[key] for r in recs)
if 'perf/sampler_cache_mib' in recs[0]:
    row['sampler_cache_mib'] = recs[-1]['perf/sampler_cache_mib']
meta = {'command': f'torchrun --nproc_per_node=1 -m grpo train --config {config} '
        + ' '.join(sys.argv[6:]), 'medians': 'over steps 2..N (step 1 compiles)',
        'logprob_diff': 'max / mean over steps of the first pass vs the sampler (per token)',
        'acceptance': f'logprob_diff_max <= {accept} and |first_pass_ratio_mean - 1| <= {accept}'}
write_results(name, [row], list(row), out_dir=res, meta=meta)
ok = row['logprob_diff_max'] <= accept and abs(row['first_pass_ratio_mean'] - 1) <= accept
print(f"grpo {row['steps']} steps: median step {row['step_s']:.3f} s, peak "
      f"{row['peak_mem_mib']:.0f} MiB, logprob diff max {row['logprob_diff_max']:.2e} (ok {ok})")
sys.exit(0 if ok else 1)
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

if compgen -G ".whl/*.whl" >/dev/null; then
    step 15 install-wheels "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --target "$WORK/site" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
if [[ "$DRY_RUN" == 1 ]]; then
    step 10 nvidia-smi echo "dry run: no GPU, nvidia-smi skipped"
else
    step 10 nvidia-smi nvidia-smi
fi
step 10 env "$PY" "$WORK/env.py"
if [[ "$DRY_RUN" != 1 ]] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"
then
    echo "=== no CUDA device: stopping (DRY_RUN=1 runs the steps on the CPU)" | tee -a "$LOG"
    exit 1
fi

mapfile -t CUDA_TESTS < <(grep -l "pytest.mark.cuda" tests/test_*.py)
step 90 pytest-cuda "$PY" -m pytest -m cuda "${CUDA_TESTS[@]}" -q -rs -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$RES/pytest_cuda_$TAG.xml"

if [[ "$DRY_RUN" == 1 ]]; then
    step 40 parity "$PY" -m benchmarks.gpu_parity --device cpu --sizes tiny --seq-len 32 \
        --new-tokens 8 --name "parity_$TAG" --out-dir "$RES"
    SAMPLER=("$PY" -m benchmarks.bench_sampler --cases tiny --device cpu --dtype float32
        --prompt-len 16 --new-tokens 8 --warmup 1 --rounds 2 --out-dir "$RES")
    CASE=tiny SMALL_FIRST=2x2,4x2 BIG_FIRST=4x2,2x2
else
    step 40 parity "$PY" -m benchmarks.gpu_parity --device cuda --sizes tiny,qwen3-0.6b \
        --name "parity_$TAG" --out-dir "$RES"
    # float32: greedy parity with generate is exact there (the bench's check before timing)
    # and it is model.dtype of configs/gsm8k_qwen3_0.6b_grpo.yaml; bf16 is judged by parity.
    SAMPLER=("$PY" -m benchmarks.bench_sampler --cases qwen3-0.6b --device cuda --dtype float32
        --warmup 1 --rounds 3 --out-dir "$RES")
    CASE=qwen3-0.6b SMALL_FIRST=4x8,16x8 BIG_FIRST=16x8,4x8  # P x G: B = 32, 128
fi
step 45 sampler-eager "${SAMPLER[@]}" --batches "$SMALL_FIRST" --hf-caches dynamic \
    --name "sampler_${TAG}_eager"
# one compile per batch shape (expected about a minute each at 0.6B), so generate's own
# compiled path (static cache) is left out: see docs/gpu.md
# B=128 first: if only one compile fits, it is the throughput one
step 100 sampler-compiled "${SAMPLER[@]}" --batches "$BIG_FIRST" --compile "$CASE" --no-eager \
    --hf-caches dynamic --name "sampler_${TAG}_compiled"

if [[ "$DRY_RUN" == 1 ]]; then
    step 45 logprobs "$PY" -m benchmarks.bench_logprobs --device cpu --dtype float32 --quick \
        --shapes 256x64x1024 --impls naive,chunked,liger,triton --name "logprobs_${TAG}_main" \
        --out-dir "$RES"
else
    step 45 logprobs "$PY" -m benchmarks.bench_logprobs --device cuda --dtype bfloat16 \
        --shapes 16384x1024x151936 --impls naive,chunked,liger,triton \
        --name "logprobs_${TAG}_main" --out-dir "$RES"
fi

step 10 tiny-model "$PY" -m grpo tiny-model --out "$WORK/tiny-model"
step 60 grpo-train "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m grpo train --config configs/tiny_ci.yaml "model.path=$WORK/tiny-model" \
    "model.device=$DEV" "train.output_dir=$WORK/grpo-run" "train.max_steps=$STEPS"
step 10 grpo-summary "$PY" "$WORK/grpo_summary.py" "$WORK/grpo-run/metrics.jsonl" "$RES" \
    "grpo_tiny_$TAG" configs/tiny_ci.yaml 1e-4 "model.device=$DEV" "train.max_steps=$STEPS"

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
step 40 tutorial-model "$PY" -c "import json, sys; from pathlib import Path
from benchmarks.bench_trl import make_checkpoint
p = make_checkpoint(Path(sys.argv[1]), sys.argv[2]); f = p / 'config.json'
c = json.loads(f.read_text()); c['max_position_embeddings'] = 2048; f.write_text(json.dumps(c))
print(p)" "$WORK/tutorial" "$TUT_SIZE"
TUT=(model.path="$WORK/tutorial/$TUT_SIZE" model.adapter=null model.device="$DEV"
    data.source=tests/data/gsm8k data.split=test data.max_samples=64 data.eval_samples=0
    rollout.max_new_tokens="$TUT_NEW" rollout.compile=off train.max_steps="$TUT_STEPS"
    train.output_dir="$WORK/tutorial-run")
step 60 tutorial-grpo "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m grpo train --config configs/gsm8k_qwen3_0.6b_grpo.yaml "${TUT[@]}"
step 10 tutorial-summary "$PY" "$WORK/grpo_summary.py" "$WORK/tutorial-run/metrics.jsonl" \
    "$RES" "grpo_tutorial_$TAG" configs/gsm8k_qwen3_0.6b_grpo.yaml 1e-2 "${TUT[@]}"
# the same run with asynchronous rollouts (colocated producer thread, max_staleness 1): the
# step time next to tutorial-grpo's; log-probs differ from the sampler's by design (stale
# batches), so no acceptance bound on them
step 45 tutorial-async "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m grpo train --config configs/gsm8k_qwen3_0.6b_grpo.yaml "${TUT[@]}" \
    train.output_dir="$WORK/tutorial-async" rollout.async=on rollout.max_staleness=1
step 10 tutorial-async-summary "$PY" "$WORK/grpo_summary.py" \
    "$WORK/tutorial-async/metrics.jsonl" "$RES" "grpo_tutorial_async_$TAG" \
    configs/gsm8k_qwen3_0.6b_grpo.yaml inf "${TUT[@]}" rollout.async=on rollout.max_staleness=1
step 40 precision "$PY" -m benchmarks.bench_precision --size "$TUT_SIZE" --device "$DEV" \
    --no-compile --name "precision_${TAG}_$TUT_SIZE" --out-dir "$RES"

if [[ "$DRY_RUN" == 1 ]]; then
    STEP=(--prompts 2 --group-size 2 --max-new-tokens 8 --micro-batch-size 4 --repeats 1)
else
    STEP=(--prompts 4 --group-size 8 --max-new-tokens 64 --micro-batch-size 16 --repeats 3)
fi
# rollouts eager: the compiled step's cost at this shape is measured by sampler-compiled, and
# two more 0.6B compiles (LoRA and full) would not fit the 8 minutes
step 45 step "$PY" -m benchmarks.bench_step --sizes "$SIZE" --device "$DEV" "${STEP[@]}" \
    --rollout-compile off --name "step_${TAG}_$SIZE" --out-dir "$RES"

failed=0
for i in "${!CODES[@]}"; do [[ "${CODES[$i]}" == 0 ]] || failed=$((failed + 1)); done
echo "=== done $(date -u +%H:%M:%S): $failed of ${#CODES[@]} steps failed; $OUT/gpu_summary.md," \
    "$OUT/gpu_results.tar.gz; unpacked in $RES" | tee -a "$LOG"
rm -rf "$WORK"
[[ $failed == 0 ]]
