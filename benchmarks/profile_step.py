"""torch.profiler tables of one GRPO update phase and one sampler decode step.

    python -m benchmarks.profile_step --size demo --shared-prefix on
    python -m benchmarks.profile_step --size demo --what decode
    python -m benchmarks.profile_step --size qwen3-0.6b --what decode --rollout-compile off \
        --max-new-tokens 16      # the decode profile of docs/sampler.md ("Round three")

Writes `benchmarks/results/profile_<what>_<size>_<mode>.md`: the operators by self CPU time
(top 25), the total, and how the time splits into model matmuls, the fused log-prob path,
autograd bookkeeping and the optimizer, so a slow phase points at its cause.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_step import build_case
from benchmarks.harness import RESULTS_DIR, env_stamp
from benchmarks.models import make_checkpoint
from grpo.tiny import make_tiny_model
from grpo.train.grpo import update_phase


def table(prof, top: int) -> tuple[str, float]:
    """Markdown table of the top operators by self CPU time, and the total self time (ms)."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e3
    lines = ["| operator | calls | self CPU ms | share |", "|---|---|---|---|"]
    for e in events[:top]:
        ms = e.self_cpu_time_total / 1e3
        lines.append(f"| `{e.key}` | {e.count} | {ms:.1f} | {ms / total:.1%} |")
    return "\n".join(lines), total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="demo", help="a grpo.tiny size, or qwen3-0.6b (random init)")
    p.add_argument("--rollout-compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--what", choices=("update", "decode"), default="update")
    p.add_argument("--lora", action="store_true", help="LoRA r16 (default full fine-tuning)")
    p.add_argument("--shared-prefix", default="on")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--data", choices=("minimath", "gsm8k"), default="minimath")
    args = p.parse_args(argv)
    args.device = "cpu"
    mode = "lora" if args.lora else "full"
    with tempfile.TemporaryDirectory() as tmp:
        if args.size == "qwen3-0.6b":
            model_dir = make_checkpoint(Path(tmp), args.size)
        else:
            model_dir = make_tiny_model(Path(tmp) / args.size, size=args.size)
        case = build_case(model_dir, args.lora, args, args.shared_prefix)
        cfg, policy, batch = case["cfg"], case["policy"], case["batch"]
        if args.what == "update":

            def run():
                return update_phase(cfg, policy, batch, case["opt"], case["sched"], case["params"])
        else:
            prompts = [r["prompt_ids"] for r in case["rows"][: args.prompts]]

            def run():
                case["sampler"].sample(
                    prompts,
                    group_size=args.group_size,
                    max_new_tokens=args.max_new_tokens,
                    temperature=1.0,
                    stop_ids=[],
                    seed=0,
                )

        run()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    md, total = table(prof, args.top)
    name = f"profile_{args.what}_{args.size}_{mode}_sp{args.shared_prefix}"
    env = env_stamp()
    text = (
        f"# {name}\n\n`python -m benchmarks.profile_step "
        f"{' '.join(argv) if argv else ' '.join(sys.argv[1:])}`\n\n"
        f"P={args.prompts} G={args.group_size} T_c<={args.max_new_tokens} "
        f"micro={args.micro_batch_size}, prompts {args.data}, rollout.compile "
        f"{args.rollout_compile}; {env.get('cpu', '')}, "
        f"torch {torch.__version__}, "
        f"git {env.get('git_sha', '')}\n\nTotal self CPU time {total:.0f} ms "
        f"(profiler overhead included).\n\n{md}\n"
    )
    out = RESULTS_DIR / f"{name}.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
