"""Decoder and sampler parity with `transformers` on one device, in float32 and bfloat16.

    python -m benchmarks.gpu_parity --device cuda                  # gpu_check.sh: tiny + 0.6B
    python -m benchmarks.gpu_parity --device cpu --sizes tiny      # the dry run

For each size (`benchmarks.models.CASES`: tiny, qwen3-0.6b; random init, written once by
`bench_sampler.build_models` and loaded by both sides) and dtype:

- `logits`: log-softmax of our decoder and of `transformers` on the same left-padded batch
  (B=4, lengths T, T-7, T/2, 1; real tokens only). float32: max |ours - theirs| against a
  tolerance (1e-5 tiny, 1e-4 at the 0.6B shape: 28 layers and V=151936 on other kernels).
  bfloat16, as an error budget: both bf16 models against transformers' float32 on the device;
  ours passes when its max error is at most 2x transformers' own (`ours`, `hf` report both).
- `greedy`: `Sampler` greedy tokens vs `generate(do_sample=False)` on the same left-padded
  prompts, as the fraction of steps before each row's first differing token (1 = identical).
  float32 must be identical. bfloat16 flips near-tied argmaxes, so both bf16 models are scored
  against transformers' float32 tokens and ours passes at >= half transformers' agreement.

TF32 is off throughout (float32 means float32). Writes <name>.json / .md with the harness and
exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch

from benchmarks.bench_sampler import CASES, build_models, prefix_agreement
from benchmarks.harness import add_output_args, comma_list, write_results

COLUMNS = ["size", "dtype", "check", "ours", "hf", "budget", "ok", "ours_mean", "hf_mean", "note"]
FP32_TOL = {"tiny": 1e-5, "qwen3-0.6b": 1e-4}  # max |log-softmax diff| in float32
BF16_ERR_RATIO = 2.0  # ours' max bf16 error may be at most this times transformers' own
BF16_GREEDY_RATIO = 0.5  # ours' bf16 greedy agreement must be at least this times theirs


def padded_batch(V: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """(4, T) left-padded ids, their bool mask and the unpadded prompts (lengths T, T-7, T/2, 1)."""
    lengths = (T, max(T - 7, 1), max(T // 2, 1), 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, V, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = True
        ids[b, : T - n] = 0
    prompts = [ids[b, T - n :].tolist() for b, n in enumerate(lengths)]
    return ids.to(device), mask.to(device), prompts


@torch.no_grad()
def ours_logprobs(model, ids, mask) -> torch.Tensor:
    """(B, T, V) float32 log-softmax of our decoder (positions from the mask)."""
    return model(ids, attention_mask=mask).float().log_softmax(-1)


@torch.no_grad()
def hf_logprobs(model, ids, mask) -> torch.Tensor:
    """(B, T, V) float32 log-softmax of a transformers model, positions counted as ours are."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    return logits.float().log_softmax(-1)


def ours_greedy(model, prompts, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our sampler's greedy completions (B, tokens) plus the padded prompt ids and mask it used."""
    from grpo.rollout import Sampler

    never = model.config.vocab_size  # no stop: every row runs all steps
    r = Sampler(model).sample(
        prompts, group_size=1, max_new_tokens=tokens, temperature=0, stop_ids=[never], seed=0
    )
    return r.completion_ids, r.prompt_ids, r.attention_mask()[:, : r.prompt_width]


@torch.no_grad()
def hf_greedy(model, prompt_ids, prompt_mask, tokens: int) -> torch.Tensor:
    """`generate(do_sample=False)` on left-padded prompts -> (B, tokens) new ids."""
    never = model.config.vocab_size
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        do_sample=False,
        max_new_tokens=tokens,
        eos_token_id=never,
        pad_token_id=0,
    )
    return out[:, prompt_ids.shape[1] :]


def check_size(size: str, args) -> list[dict]:
    """Every check of one size; one row each."""
    from grpo.models import load_model

    device = torch.device(args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf32, ours32 = build_models(size, tmp, device=args.device, dtype=torch.float32)
        bf16 = "bfloat16" in args.dtypes
        ours16 = load_model(tmp, dtype=torch.bfloat16, device=args.device) if bf16 else None
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16) if bf16 else None
    V = ours32.config.vocab_size
    ids, mask, prompts = padded_batch(V, args.seq_len, device)

    def add(dtype, check, ours, budget, ok, note, **extra):
        rows.append(
            dict(
                size=size,
                dtype=dtype,
                check=check,
                ours=ours,
                budget=budget,
                ok=ok,
                note=note,
                **extra,
            )
        )
        print(
            f"  {size} {dtype} {check}: ours {ours:.3g} hf {extra.get('hf', float('nan')):.3g} "
            f"budget {budget:.3g} ok {ok}",
            flush=True,
        )

    ref = hf_logprobs(hf32, ids, mask)[mask]  # (N, V): real tokens only
    err = (ours_logprobs(ours32, ids, mask)[mask] - ref).abs()
    tol = FP32_TOL[size]
    add(
        "float32",
        "logits",
        err.max().item(),
        tol,
        err.max().item() <= tol,
        "max abs log-softmax diff vs transformers",
        ours_mean=err.mean().item(),
    )
    del err
    g_ours, prompt_ids, prompt_mask = ours_greedy(ours32, prompts, args.new_tokens)
    g_ref = hf_greedy(hf32, prompt_ids, prompt_mask, args.new_tokens)
    agree = prefix_agreement(g_ours, g_ref)
    add(
        "float32",
        "greedy",
        agree,
        1.0,
        agree == 1.0,
        f"{args.new_tokens} steps, B=4 left-padded prompts",
    )

    if bf16:
        e_ours = (ours_logprobs(ours16, ids, mask)[mask] - ref).abs()
        e_hf = (hf_logprobs(hf16, ids, mask)[mask] - ref).abs()
        budget = BF16_ERR_RATIO * e_hf.max().item()
        add(
            "bfloat16",
            "logits",
            e_ours.max().item(),
            budget,
            e_ours.max().item() <= budget,
            f"both vs transformers float32; budget {BF16_ERR_RATIO}x hf's",
            hf=e_hf.max().item(),
            ours_mean=e_ours.mean().item(),
            hf_mean=e_hf.mean().item(),
        )
        del e_ours, e_hf
        a_ours = prefix_agreement(ours_greedy(ours16, prompts, args.new_tokens)[0], g_ref)
        a_hf = prefix_agreement(hf_greedy(hf16, prompt_ids, prompt_mask, args.new_tokens), g_ref)
        budget = BF16_GREEDY_RATIO * a_hf
        add(
            "bfloat16",
            "greedy",
            a_ours,
            budget,
            a_ours >= budget,
            f"both vs transformers float32 greedy; budget {BF16_GREEDY_RATIO}x hf's",
            hf=a_hf,
        )
    del hf32, ours32, hf16, ours16
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="tiny,qwen3-0.6b", help=f"comma list of {list(CASES)}")
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32 always; bfloat16 too?")
    p.add_argument("--seq-len", type=int, default=128, help="T of the logits batch")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy steps")
    add_output_args(p, "gpu_parity")
    args = p.parse_args(argv)
    sizes = comma_list(p, "--sizes", args.sizes, CASES)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(args.dtypes) <= {"float32", "bfloat16"}:
        p.error(f"--dtypes: expected float32 and/or bfloat16, got {args.dtypes}")
    if args.seq_len < 8 or args.new_tokens < 1:
        p.error("--seq-len must be >= 8 and --new-tokens >= 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False here")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means float32 matmuls
    torch.backends.cudnn.allow_tf32 = False

    import transformers

    transformers.logging.set_verbosity_error()
    meta = {
        "command": " ".join(["python -m benchmarks.gpu_parity", *argv]),
        "setup": f"{args.device}; logits on B=4 left-padded rows of T={args.seq_len}; greedy "
        f"{args.new_tokens} steps; random init (initializer_range 0.02), tied embeddings",
        "logits": "ours/hf: max abs log-softmax diff vs transformers float32, real tokens "
        f"(float32 budget {FP32_TOL}; bf16 budget {BF16_ERR_RATIO}x transformers' own bf16)",
        "greedy": "ours/hf: mean fraction of steps before the first token that differs from "
        f"transformers float32 greedy (float32: must be 1; bf16: >= {BF16_GREEDY_RATIO}x hf)",
    }
    rows: list[dict] = []
    for size in sizes:
        rows.extend(check_size(size, args))
        write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)
    failed = [f"{r['size']} {r['dtype']} {r['check']}" for r in rows if not r["ok"]]
    if failed:
        print(f"gpu_parity: FAILED {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"gpu_parity: all {len(rows)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
