"""GRPO step-time split (rollout / reference log-probs / update) and peak memory.

    python -m benchmarks.bench_step                 # tiny models on CPU
    python -m benchmarks.bench_step --sizes demo --repeats 5
    python -m benchmarks.bench_step --sizes qwen3-0.6b --device cuda --out-dir DIR  # gpu_check.sh

Each phase of `grpo.train.grpo` is timed on its own with the shared harness, for LoRA and
full fine-tuning, on tiny random-init Qwen3 models written by `grpo.tiny.make_tiny_model`, or
(`qwen3-0.6b`) a random-init model of Qwen3-0.6B's shape with the same tokenizer
(`benchmarks.bench_trl.make_checkpoint`). Results are written after each case, so a run stopped
by a timeout keeps the cases that finished.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_trl import DATA, make_checkpoint
from benchmarks.harness import add_output_args, comma_list, measure, write_results
from grpo.config import load_config
from grpo.loading import load_rows
from grpo.policy import build_policy
from grpo.rewards import build_rewards
from grpo.rollout import Sampler
from grpo.rollout.sampler import resolve_compile
from grpo.run.optim import build_optimizer, build_scheduler
from grpo.run.state import TrainState
from grpo.tiny import SIZES, make_tiny_model
from grpo.train.grpo import reference_phase, step_batch, update_phase
from grpo.train.rollouts import rollout_phase


def build_case(model_dir: Path, lora: bool, args, shared: str = "off") -> dict:
    """Policy, optimizer, sampler and one rolled-out batch (with reference log-probs and
    advantages) for the bench's settings; `rollout` samples a fresh batch."""
    cfg = load_config(
        base={"model": {"path": str(model_dir), "device": args.device}},
        overrides=[
            f"lora.enabled={str(lora).lower()}",
            "lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"train.batch_size={args.prompts * args.group_size}",
            f"train.micro_batch_size={args.micro_batch_size}",
            "loss.beta=0.04",
            "data.max_samples=256",
            f"train.shared_prefix={shared}",
            *DATA[args.data],
            f"rollout.compile={getattr(args, 'rollout_compile', 'auto')}",
        ],
    )
    device = torch.device(args.device)
    policy = build_policy(cfg, device, need_ref=True)
    rows = load_rows(cfg.data, "train", 256, "rl", policy.tokenizer)
    rewards = build_rewards([{"name": "accuracy"}])
    params = policy.trainable_parameters()
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, 1000, cfg.optim)
    sampler = Sampler(
        policy.model, compile=resolve_compile(cfg.rollout.compile, device), fallback=True
    )  # what `grpo train` builds (rollout.compile: auto)
    state = TrainState()
    step = [0]

    def rollout():
        step[0] += 1
        return rollout_phase(cfg, policy, sampler, rows, state, rewards, step[0])

    batch = step_batch(cfg, policy, rollout())  # reference log-probs, advantages
    return dict(cfg=cfg, policy=policy, rows=rows, params=params, opt=opt, sched=sched,
                sampler=sampler, rollout=rollout, batch=batch)  # fmt: skip


def bench_case(model_dir: Path, size: str, lora: bool, args, shared: str = "off") -> dict:
    case = build_case(model_dir, lora, args, shared)
    cfg, policy, batch, rollout = case["cfg"], case["policy"], case["batch"], case["rollout"]
    opt, sched, params = case["opt"], case["sched"], case["params"]
    device = torch.device(args.device)
    t_roll = measure(rollout, warmup=1, repeats=args.repeats, device=device)
    ref = lambda: reference_phase(cfg, policy, batch.rollout, batch.counted_mask, batch.plan)  # noqa: E731
    t_ref = measure(ref, repeats=args.repeats, device=device)
    t_upd = measure(
        lambda: update_phase(cfg, policy, batch, opt, sched, params),
        warmup=1,
        repeats=args.repeats,
        device=device,
    )
    tokens = int(batch.rollout.completion_mask.sum())
    total = t_roll.median_ms + t_ref.median_ms + t_upd.median_ms
    return {
        "size": size,
        "mode": "lora r16" if lora else "full",
        "shared_prefix": shared,
        "prompt_len": round(float(batch.rollout.prompt_lens.float().mean()), 1),
        "trainable_params": sum(p.numel() for p in params),
        "rollout_ms": round(t_roll.median_ms, 1),
        "ref_logprob_ms": round(t_ref.median_ms, 1),
        "update_ms": round(t_upd.median_ms, 1),
        "step_ms": round(total, 1),
        "rollout_frac": round(t_roll.median_ms / total, 3),
        "tokens_per_s": round(tokens / (total / 1e3), 1),
        "peak_mem_mib": round(max(t_roll.peak_mem_mib, t_ref.peak_mem_mib, t_upd.peak_mem_mib), 1),
        "spread_ms": f"{t_upd.p20_ms:.0f}-{t_upd.p80_ms:.0f}",
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="ci,demo",
                   help="comma list of grpo.tiny.SIZES keys or qwen3-0.6b")  # fmt: skip
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--data", choices=sorted(DATA), default="minimath",
                   help="prompt source (gsm8k: ~200-token prompts)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_output_args(p, None)
    p.add_argument(
        "--rollout-compile",
        default="auto",
        choices=("auto", "on", "off"),
        help="rollout.compile (auto: compiled decode step where inductor works)",
    )
    p.add_argument("--shared-prefix", default="off",
                   help="train.shared_prefix settings side by side (e.g. off,on); "
                        "ref_update_speedup = off's (ref + update) / this one's")  # fmt: skip
    args = p.parse_args(argv)
    sizes = comma_list(p, "--sizes", args.sizes, [*SIZES, "qwen3-0.6b"])
    cols = ["size", "mode", "shared_prefix", "prompt_len", "trainable_params", "rollout_ms",
            "ref_logprob_ms", "update_ms", "step_ms", "ref_update_speedup", "rollout_frac",
            "tokens_per_s", "peak_mem_mib", "spread_ms"]  # fmt: skip
    meta = {
        "command": "python -m benchmarks.bench_step "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": f"P={args.prompts} G={args.group_size} T_c<={args.max_new_tokens} "
        f"micro={args.micro_batch_size}, beta=0.04 (reference forward included), "
        f"prompts: {args.data}",
        "note": "rollouts stop at eos, so completion lengths vary with the random weights",
        "rollout.compile": args.rollout_compile,
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            if size == "qwen3-0.6b":
                model_dir = make_checkpoint(Path(tmp), size)
            else:
                model_dir = make_tiny_model(Path(tmp) / size, size=size)
            for lora in (True, False):
                for shared in args.shared_prefix.split(","):
                    rows.append(bench_case(model_dir, size, lora, args, shared))
                    add_speedups(rows)  # written after every case: a timeout keeps the rest
                    write_results(args.name or f"step_{args.device}", rows, cols,
                                  out_dir=args.out_dir, meta=meta)  # fmt: skip


def add_speedups(rows: list[dict]) -> None:
    """ref_update_speedup: the shared prefix's saving on the training-side passes, against the
    same size and mode with shared_prefix off (None until that row exists)."""
    for row in rows:
        off = [r for r in rows if (r["size"], r["mode"], r["shared_prefix"]) ==
               (row["size"], row["mode"], "off")]  # fmt: skip
        ref_upd = row["ref_logprob_ms"] + row["update_ms"]
        row["ref_update_speedup"] = (
            round((off[0]["ref_logprob_ms"] + off[0]["update_ms"]) / ref_upd, 2) if off else None
        )


if __name__ == "__main__":
    main()
