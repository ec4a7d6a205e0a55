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
frozen model's (and full's), checked before anything is timed. The three modes are timed in
interleaved rounds so that load from other processes hits them alike.
"""

import argparse
import statistics

import torch

from benchmarks.harness import measure, write_results
from grpo.lora import apply_lora, lora_parameters
from grpo.models import Decoder, ModelConfig

MODES = ("frozen", "lora", "full")
COLUMNS = [
    "mode", "trainable_m", "median_ms", "p20_ms", "p80_ms", "peak_mib", "x_frozen_time",
    "x_frozen_mem", "x_full_time", "x_full_mem", "tokens_per_s",
]  # fmt: skip


def model_config(quick: bool) -> ModelConfig:
    """Qwen3-style (qk-norm, GQA 2:1, tied); the vocabulary is small: the lm_head is not timed."""
    if quick:
        return ModelConfig(family="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, qk_norm=True)  # fmt: skip
    return ModelConfig(family="qwen3", vocab_size=4096, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=64, qk_norm=True)  # fmt: skip


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

    def step():
        hidden = model(ids, return_hidden=True)  # (B, T, C)
        hidden.float().square().mean().backward()
        d_x = leaf["x"].grad  # (B, T, C) gradient at the embedding output
        model.zero_grad(set_to_none=True)
        return hidden.detach(), d_x

    step.hook = hook
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
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 6)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per mode per round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--name", default=None, help="results file stem (default lora_cpu)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 6)
    cfg = model_config(args.quick)
    B, T = (2, 64) if args.quick else (4, 256)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    models = {mode: build(mode, cfg, args.rank) for mode in MODES}
    steps = {mode: make_step(models[mode], ids) for mode in MODES}
    check(steps)
    times = {mode: [] for mode in MODES}
    peaks = {mode: 0.0 for mode in MODES}
    for _ in range(rounds):  # interleaved: frozen, lora, full, frozen, ...
        for mode in MODES:
            t = measure(steps[mode], warmup=1, repeats=args.repeats, device="cpu")
            times[mode] += t.times_ms
            peaks[mode] = max(peaks[mode], t.peak_mem_mib)
    rows = []
    for mode in MODES:
        model = models[mode]
        trainable = (
            sum(p.numel() for p in lora_parameters(model))
            if mode == "lora"
            else sum(p.numel() for p in model.parameters() if p.requires_grad)
        )
        q = statistics.quantiles(times[mode], n=5, method="inclusive")  # 20/40/60/80 cut points
        median = statistics.median(times[mode])
        rows.append({"mode": mode, "trainable_m": trainable / 1e6, "median_ms": median,
                     "p20_ms": q[0], "p80_ms": q[3], "peak_mib": peaks[mode],
                     "tokens_per_s": B * T / (median / 1e3), "times_ms": times[mode]})  # fmt: skip
    by = {r["mode"]: r for r in rows}
    for r in rows:
        for ref in ("frozen", "full"):
            r[f"x_{ref}_time"] = r["median_ms"] / by[ref]["median_ms"]
            r[f"x_{ref}_mem"] = r["peak_mib"] / by[ref]["peak_mib"] if by[ref]["peak_mib"] else None
    meta = {
        "command": "python -m benchmarks.bench_lora" + (" --quick" if args.quick else ""),
        "model": f"qwen3-style C={cfg.hidden_size} I={cfg.intermediate_size} "
        f"L={cfg.num_hidden_layers} H={cfg.num_attention_heads} H_kv={cfg.num_key_value_heads} "
        f"D={cfg.head_dim}, float32, decoder body only (no lm_head)",
        "batch": f"B={B} x T={T} = {B * T} tokens",
        "lora": f"r={args.rank}, alpha={2 * args.rank}, targets q,k,v,o,gate,up,down",
        "timing": f"{rounds} interleaved rounds x {args.repeats} repeats per mode (+1 warmup)",
        "frozen": "all weights frozen, backward to the embedding output (no weight grads)",
    }
    name = args.name or ("lora_cpu_quick" if args.quick else "lora_cpu")
    write_results(name, rows, COLUMNS, meta=meta)


if __name__ == "__main__":
    main()
