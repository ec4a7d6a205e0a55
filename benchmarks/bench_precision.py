"""Log-prob budgets of the precision policy (grpo/precision.py), side by side in one run:

- sampler vs trainer under bf16 autocast (the tutorial configs: float32 weights + autocast),
  for LoRA on/off x compiled decode on/off x shared prefix on/off: what `rollout/logprob_diff_*`
  shows every step and what `loss.old_logprobs: sampler` feeds into the ratio;
- the same with the sampler's head in bf16 (how it ran before the policy: `model.lm_head` under
  autocast, while the trainer's fused head ran in float32);
- the trainer's bf16 log-probs vs float32 ones (what autocast costs in accuracy);
- float32 throughout (the reference: equal to 1e-5);
- each lm_head precision of `--heads` (`model.head_precision`: bf16 operands, TF32 on CUDA),
  under float32 compute and under bf16 autocast: sampler vs trainer with the same head, and the
  trainer's log-probs vs the same run's with a float32 head (what the head precision costs).

    python -m benchmarks.bench_precision                                  # tiny Qwen3, CPU
    python -m benchmarks.bench_precision --size qwen3-0.6b --device cuda  # gpu_check.sh

Compiled rows use the aot_eager backend on the CPU (the same capture and static cache as
inductor, no C++ build) and inductor with CUDA graphs on CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import add_output_args, comma_list, write_results
from benchmarks.models import make_checkpoint
from grpo.algo.logprobs import CompletionLogprobs
from grpo.data import minimath
from grpo.lora import apply_lora
from grpo.models import load_model
from grpo.precision import HEAD_PRECISIONS, Precision
from grpo.rollout import Sampler
from grpo.tokenizer import load_tokenizer

BF16 = Precision(torch.float32, torch.bfloat16)
FP32 = Precision()


class Bf16HeadSampler(Sampler):
    """The sampler as it was: its head under the forward's autocast (bf16 logits)."""

    def logits(self, hidden):
        with self.precision.autocast(hidden.device):
            return self.model.lm_head(hidden).float()


def diffs(a, b, mask) -> tuple[float, float]:
    d = (a - b)[mask].abs().double()
    return float(d.max()), float(d.mean())


def label(sampler_cls, prec: Precision) -> str:
    if sampler_cls is Bf16HeadSampler:
        return "bf16 head (before)"
    if prec.head != "float32":
        return f"{prec.head} head, {'bf16 autocast' if prec.autocast_enabled else 'float32'}"
    return "policy (float32 head)" if prec.autocast_enabled else "float32 throughout"


def case(
    model, prompts, args, lora: bool, compiled: bool, sampler_cls=Sampler, prec=BF16
) -> list[dict]:
    options = {} if args.device == "cuda" else {"backend": "aot_eager"}
    fp32_head = dataclasses.replace(prec, head="float32")
    sampler = sampler_cls(model, precision=prec, compile=compiled, compile_options=options)
    r = sampler.sample(
        prompts,
        group_size=args.group_size,
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        stop_ids=[],
        seed=0,
        pad_id=0,
    )
    rows = []
    with torch.no_grad():
        for shared in (False, True):
            G = args.group_size if shared else None
            lp = {
                name: CompletionLogprobs(model, p)(
                    r.ids, r.attention_mask(), r.prompt_width, r.completion_mask, 1.0, group_size=G
                )
                for name, p in (
                    ("bf16", BF16),
                    ("fp32", FP32),
                    ("run", prec),
                    ("fp32_head", fp32_head),
                )
            }
            s_max, s_mean = diffs(lp["run"], r.logprobs, r.completion_mask)
            t_max, t_mean = diffs(lp["bf16"], lp["fp32"], r.completion_mask)
            h_max, h_mean = diffs(lp["run"], lp["fp32_head"], r.completion_mask)
            rows.append(
                {
                    "sampler": label(sampler_cls, prec),
                    "head": prec.head,
                    "lora": lora,
                    "compiled": compiled,
                    "shared_prefix": shared,
                    "tokens": int(r.completion_mask.sum()),
                    "sampler_vs_trainer_max": s_max,
                    "sampler_vs_trainer_mean": s_mean,
                    "bf16_vs_fp32_trainer_max": t_max,
                    "bf16_vs_fp32_trainer_mean": t_mean,
                    "head_vs_fp32_head_max": h_max,
                    "head_vs_fp32_head_mean": h_mean,
                }
            )
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="ci", choices=("ci", "qwen3-0.6b"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    p.add_argument(
        "--heads",
        default=None,
        help="comma list of lm_head precisions to compare besides float32 "
        f"({', '.join(HEAD_PRECISIONS)}; default bf16 on a CPU, where tf32 is "
        "float32, and tf32,bf16 on CUDA)",
    )
    add_output_args(p, None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    default_heads = "tf32,bf16" if dev.type == "cuda" else "bf16"
    heads = [
        h
        for h in comma_list(p, "--heads", args.heads or default_heads, HEAD_PRECISIONS)
        if h != "float32"
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), args.size)
        tok = load_tokenizer(path)
        prompts = [
            tok(r["question"], add_special_tokens=False)["input_ids"]
            for r in minimath(args.prompts, seed=1)
        ]
        for lora in (False, True):
            model = load_model(path, device=dev)
            if lora:  # LoRA r16 on q/k/v/o as the tutorial, B non-zero so the adapter acts
                apply_lora(
                    model,
                    rank=16,
                    alpha=32,
                    targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                    seed=0,
                )
                gen = torch.Generator(device="cpu").manual_seed(0)
                with torch.no_grad():
                    for n, t in model.named_parameters():
                        if "lora_b" in n:
                            t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
            BF16.prepare(model)
            for compiled in (False,) if args.no_compile else (False, True):
                rows += case(model, prompts, args, lora, compiled)
            rows += case(model, prompts, args, lora, False, Bf16HeadSampler)
            rows += case(model, prompts, args, lora, False, prec=FP32)
            for head in heads:  # the same head in the sampler and the trainer
                for compute in (FP32, BF16):
                    prec = dataclasses.replace(compute, head=head)
                    compiled = (False,) if args.no_compile or compute is FP32 else (False, True)
                    for c in compiled:
                        rows += case(model, prompts, args, lora, c, prec=prec)
            del model
    cols = [
        "sampler",
        "head",
        "lora",
        "compiled",
        "shared_prefix",
        "tokens",
        "sampler_vs_trainer_max",
        "sampler_vs_trainer_mean",
        "bf16_vs_fp32_trainer_max",
        "bf16_vs_fp32_trainer_mean",
        "head_vs_fp32_head_max",
        "head_vs_fp32_head_mean",
    ]
    meta = {
        "command": "python -m benchmarks.bench_precision " + " ".join(sys.argv[1:]),
        "shape": f"{args.size}, P={args.prompts} x G={args.group_size}, "
        f"{args.new_tokens} new tokens (no stop), temperature 1",
        "diffs": "|log p| differences per completion token: max and mean",
    }
    write_results(
        args.name or f"precision_{args.device}_{args.size}",
        rows,
        cols,
        out_dir=args.out_dir,
        meta=meta,
    )


if __name__ == "__main__":
    main()
