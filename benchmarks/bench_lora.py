"""LoRA cost: forward + backward of a LoRA decoder against the frozen base and full fine-tuning.

    python -m benchmarks.bench_lora            # CPU, fp32, Qwen3-style C=1024 L=4, B x T = 4 x 256
    python -m benchmarks.bench_lora --quick    # C=256 L=2, B x T = 2 x 64, a few seconds

Modes (one step = forward of the decoder body to the final-norm hidden states (B, T, C), a scalar
loss mean(hidden^2), and backward; the lm_head is left out, so LoRA's share is not diluted):
- frozen: every weight frozen; backward computes activation gradients only (down to the
  embedding output, which is made a leaf that requires grad) and no weight gradient. This is
  the floor any adapter method pays for backpropagating through the model.
- lora: r=16, alpha=32 on all seven projections of every layer; same embedding-output leaf.
- full: every decoder-body weight trainable (embedding excluded); same leaf.

Correctness first: with B = 0 the LoRA model's hidden states and input gradients equal the
frozen model's (and full's), checked before anything is timed. The three modes are timed
round-robin (`measure_interleaved`) so that load from other processes hits them alike. Besides
wall time (the harness: median and p20/p80) the fastest wall time and the fastest process CPU
time of each mode are reported: on a shared, busy machine (see `loadavg_1m` in the stamp)
medians measure the neighbours, the fastest call is the least disturbed one, and `--threads 1`
keeps OpenMP threads from waiting on a descheduled sibling.
"""

import argparse
import sys
import time

import torch

from benchmarks.harness import add_output_args, measure_interleaved, write_results
from grpo.lora import apply_lora, lora_parameters
from grpo.models import Decoder, ModelConfig

MODES = ("frozen", "lora", "full")
COLUMNS = [
    "mode",
    "trainable_m",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "min_ms",
    "cpu_min_ms",
    "peak_mib",
    "x_frozen_time",
    "x_frozen_min",
    "x_frozen_cpu",
    "x_frozen_mem",
    "x_full_time",
    "x_full_min",
    "x_full_mem",
    "tokens_per_s",
]


def model_config(quick: bool) -> ModelConfig:
    """Qwen3-style (qk-norm, GQA 2:1, tied); the vocabulary is small: the lm_head is not timed."""
    if quick:
        return ModelConfig(
            family="qwen3",
            vocab_size=512,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            qk_norm=True,
        )
    return ModelConfig(
        family="qwen3",
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        qk_norm=True,
    )


def build(mode: str, cfg: ModelConfig, rank: int) -> Decoder:
    """A decoder in train mode with the mode's trainable set and an embedding-output leaf."""
    model = Decoder(cfg)
    model.init_weights(seed=0)
    model.train()
    if mode == "lora":
        apply_lora(model, rank=rank, alpha=2 * rank, seed=0)
    else:
        for p in model.parameters():
            p.requires_grad_(mode == "full")
    # The embedding output becomes a leaf needing grad: backward runs through every layer.
    model.embed_tokens.register_forward_hook(lambda m, i, out: out.detach().requires_grad_())
    return model


def make_step(model: Decoder, ids: torch.Tensor):
    """The timed closure: forward, loss, backward; gradients are dropped at the end."""
    leaf = {}
    hook = model.embed_tokens.register_forward_hook(lambda m, i, out: leaf.update(x=out))

    cpu_ms = []  # process CPU time of every call

    def step():
        t0 = time.process_time()
        hidden = model(ids, return_hidden=True)  # (B, T, C)
        hidden.float().square().mean().backward()
        d_x = leaf["x"].grad  # (B, T, C) gradient at the embedding output
        model.zero_grad(set_to_none=True)
        cpu_ms.append((time.process_time() - t0) * 1e3)
        return hidden.detach(), d_x

    step.hook, step.cpu_ms = hook, cpu_ms
    return step


def check(steps: dict) -> None:
    """Before timing: hidden states and input gradients agree across modes (B = 0 in LoRA)."""
    ref_h, ref_dx = steps["frozen"]()
    for mode in ("lora", "full"):
        h, d_x = steps[mode]()
        err_h = (h - ref_h).abs().max().item()
        err_dx = ((d_x - ref_dx).norm() / ref_dx.norm()).item()
        if err_h > 1e-5 or err_dx > 1e-5:
            raise SystemExit(f"{mode} disagrees with frozen: hidden {err_h:.2e}, d_x {err_dx:.2e}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, few repeats")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="timed calls per mode (default 8)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    add_output_args(p, None)  # lora_cpu or lora_cpu_quick
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (4 if args.quick else 8)
    cfg = model_config(args.quick)
    B, T = (2, 64) if args.quick else (4, 256)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    models = {mode: build(mode, cfg, args.rank) for mode in MODES}
    steps = {mode: make_step(models[mode], ids) for mode in MODES}
    check(steps)
    # Round-robin (frozen, lora, full, then rotated), warm-up calls interleaved too.
    timings = measure_interleaved(steps, warmup=1, repeats=repeats, device="cpu")
    rows = []
    for mode in MODES:
        model, t = models[mode], timings[mode]
        trainable = (
            sum(p.numel() for p in lora_parameters(model))
            if mode == "lora"
            else sum(p.numel() for p in model.parameters() if p.requires_grad)
        )
        cpu = steps[mode].cpu_ms[-repeats:]  # the timed calls (not the check, not the warm-up)
        rows.append(
            {
                "mode": mode,
                "trainable_m": trainable / 1e6,
                "median_ms": t.median_ms,
                "p20_ms": t.p20_ms,
                "p80_ms": t.p80_ms,
                "min_ms": min(t.times_ms),
                "cpu_min_ms": min(cpu),
                "peak_mib": t.peak_mem_mib,
                "tokens_per_s": B * T / (t.median_ms / 1e3),
                "times_ms": list(t.times_ms),
                "cpu_times_ms": cpu,
            }
        )
    by = {r["mode"]: r for r in rows}
    for r in rows:
        for ref in ("frozen", "full"):
            r[f"x_{ref}_time"] = r["median_ms"] / by[ref]["median_ms"]
            r[f"x_{ref}_min"] = r["min_ms"] / by[ref]["min_ms"]
            r[f"x_{ref}_cpu"] = r["cpu_min_ms"] / by[ref]["cpu_min_ms"]
            r[f"x_{ref}_mem"] = r["peak_mib"] / by[ref]["peak_mib"] if by[ref]["peak_mib"] else None
    meta = {
        "command": "python -m benchmarks.bench_lora " + " ".join(argv or sys.argv[1:]),
        "model": f"qwen3-style C={cfg.hidden_size} I={cfg.intermediate_size} "
        f"L={cfg.num_hidden_layers} H={cfg.num_attention_heads} H_kv={cfg.num_key_value_heads} "
        f"D={cfg.head_dim}, float32, decoder body only (no lm_head)",
        "batch": f"B={B} x T={T} = {B * T} tokens",
        "lora": f"r={args.rank}, alpha={2 * args.rank}, targets q,k,v,o,gate,up,down",
        "timing": f"measure_interleaved: {repeats} repeats per mode, round-robin (+1 warmup)",
        "frozen": "all weights frozen, backward to the embedding output (no weight grads)",
        "ratios": "x_*_time: of medians; x_*_min: of fastest wall times; x_*_cpu: of fastest "
        "process CPU times (all threads); x_*_mem: of peak RSS added by a step",
        "torch_threads": torch.get_num_threads(),
    }
    name = args.name or ("lora_cpu_quick" if args.quick else "lora_cpu")
    write_results(name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    main()
