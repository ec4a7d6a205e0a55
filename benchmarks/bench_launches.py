"""Kernel launches, weight casts and host syncs per decode step, per layer and fixed, on any
machine: what a GPU decode step launches eagerly, counted on a CPU.

    python -m benchmarks.bench_launches                  # the table of docs/sampler.md

For each code path (`cpu`: this CPU's own; `cuda`: CUDA's decode paths forced on the CPU, the
fused SDPA decode and prompt KV copied per row) and configuration (float32; LoRA on q/k/v/o or
on all 7 projections; the tutorial's float32 weights under bf16 autocast with LoRA q/k/v/o),
`grpo.testing.launches.per_decode_step` counts the aten ops that launch a kernel in one
steady-state decode step of `Sampler.sample` (P=4 x G=8 rows, eager, tiny widths: the count
does not depend on them) at 2 and 4 layers; per layer = the difference / 2, fixed = the rest,
and `at_28` = fixed + 28 x per layer, the Qwen3-0.6B depth. The counts are the same on every
machine with the same torch; tests/test_launches.py holds budgets on them.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from benchmarks.harness import add_output_args, write_results

CONFIGS = ("fp32", "lora_qkvo", "lora_all", "tutorial")
COLUMNS = [
    "path",
    "config",
    "per_layer",
    "fixed",
    "at_28",
    "casts_per_layer",
    "casts_at_28",
    "syncs",
]


def step_cost(layers: int, config: str, cuda: bool) -> dict:
    from grpo.lora import apply_lora
    from grpo.models.config import ModelConfig
    from grpo.models.decoder import Decoder
    from grpo.precision import Precision
    from grpo.rollout import Sampler
    from grpo.testing.launches import cuda_decode_paths, per_decode_step

    cfg = ModelConfig(
        family="qwen3",
        qk_norm=True,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Decoder(cfg)
    model.init_weights(seed=0)
    model.eval()
    if config != "fp32":
        targets = None if config == "lora_all" else ("q_proj", "k_proj", "v_proj", "o_proj")
        apply_lora(model, 8, 16, **({"targets": targets} if targets else {}), seed=0)
    precision = Precision(torch.float32, torch.bfloat16) if config == "tutorial" else Precision()
    prompts = [[5 + i + j for j in range(7 + 3 * i)] for i in range(4)]
    with cuda_decode_paths() if cuda else contextlib.nullcontext():
        sampler = Sampler(model, precision=precision, pack=False if cuda else None)
        return per_decode_step(
            lambda n: sampler.sample(
                prompts, group_size=8, max_new_tokens=n, temperature=1.0, stop_ids=[], seed=0
            )
        )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(parser, "launches_per_decode_step")
    args = parser.parse_args(argv)
    rows = []
    for path in ("cuda", "cpu"):
        for config in CONFIGS:
            a, b = step_cost(2, config, path == "cuda"), step_cost(4, config, path == "cuda")
            per_layer = (b["launches"] - a["launches"]) / 2
            casts = (b["casts"] - a["casts"]) / 2
            fixed = a["launches"] - 2 * per_layer
            rows.append(
                {
                    "path": path,
                    "config": config,
                    "per_layer": per_layer,
                    "fixed": fixed,
                    "at_28": fixed + 28 * per_layer,
                    "casts_per_layer": casts,
                    "casts_at_28": a["casts"] - 2 * casts + 28 * casts,
                    "syncs": a["syncs"],
                }
            )
            print(rows[-1], flush=True)
    meta = {
        "command": " ".join(["python -m benchmarks.bench_launches", *argv]),
        "what": __doc__.split("\n\n")[2].replace("\n", " "),
    }
    write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
