"""Our GRPO step, as `grpo train` runs it, against TRL's `GRPOTrainer`, side by side.

    OMP_NUM_THREADS=2 /tmp/cmpenv/bin/python -m benchmarks.bench_trl --shapes ci,qwen3-0.6b \
        --modes full --prompts 8 --group-size 4 --data gsm8k --name step_trl_cpu_gsm8k

Same checkpoint, prompts (minimath or GSM8K, rendered by `grpo.loading.load_rows`), P, G, max
new tokens, beta, optimizer (AdamW, lr, grad clip 1.0), fp32, no gradient checkpointing,
token-mean loss (TRL's "dapo"), LoRA (r16, alpha 32, q/k/v/o) or full fine-tuning, and one
reward function (completion length in characters) for both. TRL runs in a separate venv (trl
is not a project dependency), transformers `generate` for sampling, no vLLM.

Ours is measured the way a user runs it: the settings above are written to a config file and
`python -m grpo train --config FILE` runs in a fresh process with every other setting at its
default (rollout.compile, train.shared_prefix, micro-batching, ...); a step's time is the run's
own `perf/step_s` (rollout + reference + advantage + update) from metrics.jsonl. TRL: one step
= `Trainer` step from `on_step_begin` to `on_step_end` (generation, reference log-probs, loss,
backward, optimizer), timed by a callback. Every step counts, the first one included
(`--warmup 0`): `step_s` is the median over all steps, `first_s` and `steady_s` (the median of
the others) are reported apart, and ours adds `compile_s` (its perf/compile_s) and the whole
command's wall time. Both stop rows at eos, so the completion lengths of the two differ; each
side's mean completion length is reported and tokens/s counts each side's own completion
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import (
    _CpuPeak,
    _percentile,
    matmul_ceiling_tflops,
    measure,
    write_results,
)
from benchmarks.models import DATA, make_checkpoint
from grpo.config import load_config, save_config
from grpo.loading import load_rows
from grpo.models import ModelConfig
from grpo.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def length_reward(completions, **kwargs) -> list[float]:
    """Completion length in characters / 100: cheap, and non-zero advantages for both sides."""
    return [len(c) / 100 for c in completions]


def ours_config(model_dir: Path, lora: bool, args, shared: str = "auto", base: dict | None = None):
    B = args.prompts * args.group_size
    return load_config(
        base={"model": {"path": str(model_dir), "device": "cpu"}, **(base or {})},
        overrides=[
            f"lora.enabled={str(lora).lower()}",
            f"lora.targets=[{','.join(LORA_TARGETS)}]",
            "lora.rank=16",
            "lora.alpha=32",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            "rollout.temperature=1.0",
            f"train.batch_size={B}",
            f"train.micro_batch_size={B}",  # TRL does the whole batch in one forward
            "loss.beta=0.04",
            "loss.aggregation=token_mean",
            f"optim.lr={args.lr}",
            "data.max_samples=256",
            f"train.shared_prefix={shared}",
            *DATA[args.data],
        ],
    )


def ours_case(model_dir: Path, shape: str, lora: bool, args, tmp: Path) -> dict:
    """`grpo train` as a user runs it: a config file, the CLI in a fresh process, its defaults
    (rollout.compile auto, train.shared_prefix auto, ...); each step's time is the run's own
    `perf/step_s` from metrics.jsonl, every step counted (the first one's warm-up included;
    `perf/compile_s` says how much of it was compiling)."""
    out = tmp / f"ours_{shape}_{lora}"
    cfg = ours_config(
        model_dir,
        lora,
        args,
        base={
            "rewards": [{"name": "benchmarks.bench_trl:length_reward"}],
            "train": {
                "output_dir": str(out),
                "max_steps": args.warmup + args.repeats,
                "progress": False,
                "save_every": 0,
            },
            "data": {"eval_samples": 0},
        },
    )
    cfg_file = save_config(cfg, tmp / f"ours_{shape}_{lora}.yaml")
    cmd = [sys.executable, "-m", "grpo", "train", "--config", str(cfg_file)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GRPO_COMPILE", None)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"grpo train failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    times_ms = [r["perf/step_s"] * 1e3 for r in rows]
    lengths = [r["rollout/completion_len_mean"] for r in rows]
    B = args.prompts * args.group_size
    tokens = [round(x * B) for x in lengths]
    row = _row(shape, lora, "ours grpo train", [], times_ms, None, tokens, lengths)
    row["compile_s"] = round(sum(r.get("perf/compile_s", 0.0) for r in rows), 2)
    row["process_wall_s"] = round(wall, 1)
    row["peak_rss_mib"] = round(max(r.get("perf/peak_mem_mib", 0.0) for r in rows), 1)
    # the physical floor: the FLOPs of the tokens a step must compute (each prompt once) at
    # the measured matmul rate, except that each decode step must also read every weight
    # once (memory-bound at small batch): max(its FLOPs / rate, weight bytes / bandwidth)
    mc = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    rate = args.tflops * 1e12
    weight_bytes = 4 * n_params(mc)
    prompt_tokens = args.prompts * mean_prompt_tokens(cfg)
    floors = []
    for r, ct in zip(rows, tokens):
        n = r["rollout/completion_len_max"]  # decode steps the sampler ran
        compute = step_flops(mc, prompt_tokens, ct, args.prompts, lora) / rate
        decode_compute = step_flops(mc, 0, ct, args.prompts, lora, rollout_only=True) / rate
        decode_memory = n * weight_bytes / (args.bandwidth_gbs * 1e9)
        floors.append(compute + max(0.0, decode_memory - decode_compute))
    row["floor_s"] = round(statistics.mean(floors), 3)
    row["prompt_tokens"] = round(prompt_tokens, 1)
    return row


def n_params(mc) -> int:
    """Parameters of a decoder of config `mc` (a tied head counted once)."""
    C, L, I, V = mc.hidden_size, mc.num_hidden_layers, mc.intermediate_size, mc.vocab_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    body = L * (C * q + 2 * C * kv + q * C + 3 * C * I)
    return body + V * C * (1 if mc.tie_word_embeddings else 2)


def mean_prompt_tokens(cfg) -> float:
    """Mean prompt length (tokens) of the run's training rows."""
    tok = load_tokenizer(cfg.model.path)
    rows = load_rows(cfg.data, "train", 256, "rl", tok)
    return statistics.mean(len(r["prompt_ids"]) for r in rows)


def step_flops(
    mc, prompt_tokens: int, completion_tokens: int, P: int, lora: bool, rollout_only: bool = False
) -> float:
    """FLOPs a GRPO step cannot avoid: every prompt token once (sampler prefill, reference
    forward, policy forward + backward) and every completion token in each of those passes;
    the lm_head only where a token is predicted. 2 FLOPs per weight per token forward; the
    backward is 2x the forward with full fine-tuning (activation + weight gradients) and 1x
    with LoRA (activation gradients; the adapters' own are negligible); attention's score and
    value products over the average context are included.

    Args:
        mc: the model's `ModelConfig`.
        prompt_tokens: real prompt tokens of the step's P prompts (each counted once).
        completion_tokens: generated tokens of the step's B rows.
        P: prompts (the sampler's prefill predicts one token per prompt).
        lora: LoRA (frozen base) or full fine-tuning.
        rollout_only: the sampler's share only.
    """
    C, L, I = mc.hidden_size, mc.num_hidden_layers, mc.intermediate_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    body = L * (C * q + 2 * C * kv + q * C + 3 * C * I)  # weights a token multiplies
    ctx = prompt_tokens / P + completion_tokens / (2 * P)  # mean attended length, roughly
    per_token = 2 * body + 4 * L * q * ctx
    head = 2 * C * mc.vocab_size  # lm_head per predicted token
    tokens = prompt_tokens + completion_tokens
    forward = tokens * per_token + completion_tokens * head  # one training-side forward
    rollout = tokens * per_token + (completion_tokens + P) * head
    if rollout_only:
        return rollout
    backward = (1 if lora else 2) * forward
    return rollout + forward + forward + backward  # sampler, reference, update fwd + bwd


def memory_bandwidth_gbs(size_mib: int = 1024) -> float:
    """Measured memory bandwidth (GB/s): bytes read + written by a large tensor copy."""
    src = torch.ones(size_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=1, repeats=5)
    return 2 * src.numel() * 4 / (t.median_ms * 1e-3) / 1e9


def check_agreement(model_dir: Path, args) -> float:
    """Before timing: our decoder and transformers (which TRL runs) give the same completion
    log-probs on the benchmark's checkpoint and a sampled batch; returns the max |diff|."""
    from transformers import AutoModelForCausalLM

    from grpo.algo.logprobs import completion_logprobs
    from grpo.models import load_model
    from grpo.rollout import sample

    ours = load_model(model_dir)
    r = sample(
        ours,
        [[5, 17, 33, 9, 12], [101, 7, 8]],
        group_size=2,
        max_new_tokens=8,
        temperature=1.0,
        stop_ids=[],
        seed=0,
    )
    with torch.no_grad():
        lp = completion_logprobs(ours, r.ids, r.attention_mask(), r.prompt_width, r.completion_mask)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        mask = r.attention_mask()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = hf(input_ids=r.ids, attention_mask=mask.long(), position_ids=pos).logits
        logp = torch.log_softmax(logits[:, r.prompt_width - 1 : -1].float(), -1)
        ref = logp.gather(-1, r.ids[:, r.prompt_width :, None])[..., 0]
    diff = float((lp - ref)[r.completion_mask].abs().max())
    if diff > 1e-4:
        raise SystemExit(f"our decoder and transformers disagree on {model_dir}: {diff:.2e}")
    return diff


def trl_case(model_dir: Path, shape: str, lora: bool, args, tmp: Path) -> dict:
    """TRL GRPOTrainer on the same checkpoint and prompts, timed per step by a callback."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = ours_config(model_dir, lora, args)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(cfg.data, "train", 256, "rl", tok)
    ds = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])  # the same rendered prompts
    B = args.prompts * args.group_size
    gcfg = GRPOConfig(
        output_dir=str(tmp / f"trl_{shape}_{lora}"),
        per_device_train_batch_size=B,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        gradient_accumulation_steps=1,
        beta=0.04,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        loss_type="dapo",  # = our token_mean on one process
        num_iterations=1,
        use_vllm=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        max_steps=args.warmup + args.repeats,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    peft_config = None
    if lora:
        peft_config = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            task_type="CAUSAL_LM",
        )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times_ms, self.peaks_mib, self.lengths = [], [], []

        def on_step_begin(self, args_, state, control, **kw):
            self._mem = _CpuPeak().__enter__()
            self._t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            self.times_ms.append((time.perf_counter() - self._t0) * 1e3)
            self._mem.__exit__(None, None, None)
            self.peaks_mib.append(self._mem.peak_bytes / 2**20)

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=length_reward,
        args=gcfg,
        train_dataset=ds,
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[timer],
    )
    trainer.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    w = args.warmup
    lengths = timer.lengths[w:]
    tokens = [round(x * B) for x in lengths]
    row = _row(
        shape,
        lora,
        "trl GRPOTrainer",
        params,
        timer.times_ms[w:],
        max(timer.peaks_mib[w:]),
        tokens,
        lengths,
    )
    del trainer
    return row


def _row(shape, lora, impl, params, times_ms, peak_mib, tokens, lengths) -> dict:
    return {
        "shape": shape,
        "mode": "lora r16 qkvo" if lora else "full",
        "impl": impl,
        "trainable_params": sum(p.numel() for p in params),
        "step_s": round(statistics.median(times_ms) / 1e3, 3),
        "first_s": round(times_ms[0] / 1e3, 3),
        "steady_s": round(statistics.median(times_ms[1:] or times_ms) / 1e3, 3),
        "p20_s": round(_percentile(times_ms, 20) / 1e3, 3),
        "p80_s": round(_percentile(times_ms, 80) / 1e3, 3),
        "mean_completion_len": round(statistics.mean(lengths), 1) if lengths else None,
        "tokens_per_s": round(sum(tokens) / (sum(times_ms) / 1e3), 1) if tokens else None,
        "peak_rss_mib": None if peak_mib is None else round(peak_mib, 1),
        "times_s": [round(x / 1e3, 3) for x in times_ms],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="ci", help="comma list of ci, qwen3-0.6b")
    p.add_argument("--modes", default="lora,full", help="comma list of lora, full (ci shape)")
    p.add_argument("--big-modes", default="lora", help="modes for qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--big-prompts", type=int, default=2, help="P for qwen3-0.6b")
    p.add_argument("--big-group-size", type=int, default=4, help="G for qwen3-0.6b")
    p.add_argument("--big-max-new-tokens", type=int, default=32, help="T_c for qwen3-0.6b")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--data",
        choices=sorted(DATA),
        default="minimath",
        help="prompt source (gsm8k: ~200-token prompts)",
    )
    p.add_argument("--warmup", type=int, default=0, help="steps run before the timed ones")
    p.add_argument("--repeats", type=int, default=6, help="timed steps (the first included)")
    p.add_argument("--big-repeats", type=int, default=6)
    p.add_argument("--name", default="step_trl_cpu", help="results file stem")
    args = p.parse_args(argv)
    args.tflops = matmul_ceiling_tflops("cpu", torch.float32)  # the floor's denominators
    args.bandwidth_gbs = memory_bandwidth_gbs()
    print(
        f"measured fp32 matmul rate: {args.tflops * 1e3:.1f} GFLOP/s, memory "
        f"{args.bandwidth_gbs:.1f} GB/s",
        flush=True,
    )
    rows, shapes_meta, agreement = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for shape in args.shapes.split(","):
            sargs = argparse.Namespace(**vars(args))
            modes = args.modes
            if shape != "ci":
                sargs.prompts, sargs.group_size = args.big_prompts, args.big_group_size
                sargs.max_new_tokens, sargs.repeats = args.big_max_new_tokens, args.big_repeats
                modes = args.big_modes
            shapes_meta[shape] = (
                f"P={sargs.prompts} G={sargs.group_size} T_c<={sargs.max_new_tokens} "
                f"repeats={sargs.repeats} warmup={sargs.warmup}"
            )
            model_dir = make_checkpoint(tmp, shape)
            agreement[shape] = check_agreement(model_dir, sargs)
            for mode in modes.split(","):
                lora = mode == "lora"
                case = [
                    ours_case(model_dir, shape, lora, sargs, tmp),
                    trl_case(model_dir, shape, lora, sargs, tmp),
                ]
                ours, trl = case
                trl["floor_s"] = ours["floor_s"]  # the same tokens must be computed
                for r in case:
                    r["trl_over_ours"] = round(trl["step_s"] / ours["step_s"], 2)
                    r["step_over_floor"] = round(r["step_s"] / r["floor_s"], 2)
                    print(json.dumps({k: v for k, v in r.items() if k != "times_s"}), flush=True)
                rows.extend(case)
    import accelerate
    import peft
    import transformers
    import trl

    cols = [
        "shape",
        "mode",
        "impl",
        "step_s",
        "first_s",
        "steady_s",
        "compile_s",
        "process_wall_s",
        "mean_completion_len",
        "tokens_per_s",
        "peak_rss_mib",
        "trl_over_ours",
        "floor_s",
        "step_over_floor",
    ]
    meta = {
        "command": "OMP_NUM_THREADS=2 /tmp/cmpenv/bin/python -m benchmarks.bench_trl "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "shapes": shapes_meta,
        "prompts": args.data,
        "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, peft {peft.__version__}",
        "setup": "fp32 CPU, beta=0.04, lr const-ish (ours cosine over 1000 steps, TRL constant), "
        "AdamW, grad clip 1.0, token-mean loss (TRL dapo), temperature 1, no top-k/p, "
        "one micro-batch of P*G rows, no gradient checkpointing, reward = len(chars)/100",
        "timing": "step_s = median over every step of the run, the first included (warm-up, "
        "compilation); first_s the first step, steady_s the median of the others. Ours = "
        "`grpo train --config <file>` in a fresh process, its own perf/step_s per step "
        "(rollout + reference + advantage + update), compile_s its perf/compile_s summed, "
        "process_wall_s the whole command (start-up, loading, the steps, the final save). "
        "TRL = GRPOTrainer.train(), on_step_begin..on_step_end by a callback",
        "peak_rss_mib": "ours: perf/peak_mem_mib (largest over steps); TRL: RSS the step adds "
        "at its peak (harness _CpuPeak)",
        "note": "both stop rows at eos with random weights: completion lengths differ, "
        "tokens_per_s counts each side's own completion tokens",
        "agreement": "max |our completion log-prob - transformers'| on the checkpoint before "
        "timing: " + ", ".join(f"{k} {v:.1e}" for k, v in agreement.items()),
        "floor": f"floor_s = step_flops (benchmarks/bench_trl.py: every prompt token once, "
        f"completion tokens in sampler, reference, policy fwd + bwd) / the measured fp32 "
        f"matmul rate {args.tflops * 1e3:.1f} GFLOP/s (2048^3 product); each decode step at "
        f"least reads all weights once: {args.bandwidth_gbs:.1f} GB/s measured (1 GiB copy)",
    }
    write_results(args.name, rows, cols, meta=meta)


if __name__ == "__main__":
    main()
