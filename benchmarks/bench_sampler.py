"""Our rollout sampler vs `transformers` `generate`, same checkpoint and settings, side by side.

    python -m benchmarks.bench_sampler                       # tiny + Qwen3-0.6B shape, fp32 CPU
    python -m benchmarks.bench_sampler --cases tiny --rounds 2 --name sampler_quick
    python -m benchmarks.bench_sampler --cases tiny --compile --name sampler_cpu_compile

Both sides sample P=4 prompts x G=8 completions of a 128-token prompt, 64 new tokens each,
temperature 1 with no top-k / top-p, from the same random-weight checkpoint (built with
`transformers` into a temp dir; ours loads it through `grpo.models.load_model`). The stop id is
the vocab size, which no row can sample, so every row produces exactly 64 tokens on both sides.
`generate` runs with do_sample=True, num_return_sequences=G (it expands the prompts before its
prefill; we prefill each prompt once and copy its KV rows G times) and a dynamic or static cache.

Before timing, greedy decoding of both is checked to give the same tokens (column `greedy_ok`).
Timing: each call is timed on its own with `benchmarks.harness.measure`, the implementations
interleaved round by round so that a busy machine slows them alike. `ms_per_step` is
(t(64 tokens) - t(1 token)) / 63, the same subtraction for both sides, so prefill is excluded;
`tok_per_s` is B * 64 / t(64 tokens), prefill included; `x_hf` is tok_per_s over generate's
with a dynamic cache.
"""

import argparse
import statistics
import tempfile

import torch

from benchmarks.harness import measure, write_results

CASES = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
TARGETS = {"tiny": 2.0, "qwen3-0.6b": 1.2}  # required tok/s ratio ours / generate (dynamic)
COLUMNS = [
    "case", "impl", "tok_per_s", "ms_per_step", "prefill_ms", "total_ms", "p20_ms", "p80_ms",
    "peak_mib", "x_hf", "target", "greedy_ok",
]  # fmt: skip


def build_models(case: str, out_dir: str):
    """A random-init Qwen3 checkpoint of `case` saved to `out_dir`; (hf_model, our_model)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from grpo.models import load_model

    cfg = Qwen3Config(
        **CASES[case],
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(out_dir)
    return hf, load_model(out_dir)


def hf_generate(hf, input_ids, *, group_size, max_new_tokens, cache, do_sample=True, eos):
    """`generate` on (P, T_p) unpadded prompts -> (P*G, T_p + max_new_tokens) ids."""
    kwargs = dict(cache_implementation="static") if cache == "static" else {}
    return hf.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=do_sample,
        num_return_sequences=group_size if do_sample else 1,
        max_new_tokens=max_new_tokens,
        temperature=1.0 if do_sample else None,
        top_k=0 if do_sample else None,
        top_p=1.0 if do_sample else None,
        eos_token_id=eos,
        pad_token_id=0,
        **kwargs,
    )


def greedy_ok(hf, sampler, prompts, input_ids, tokens: int) -> bool:
    """Same greedy tokens from both for `tokens` steps (the correctness check before timing)."""
    never = hf.config.vocab_size
    ours = sampler.sample(
        prompts, group_size=1, max_new_tokens=tokens, temperature=0, stop_ids=[never], seed=0
    )
    theirs = hf_generate(
        hf, input_ids, group_size=1, max_new_tokens=tokens, cache="dynamic", do_sample=False,
        eos=never,
    )  # fmt: skip
    return torch.equal(ours.completion_ids, theirs[:, input_ids.shape[1] :])


def run_case(case, args) -> list[dict]:
    from grpo.rollout import Sampler

    P, G, T_p, N = args.prompts, args.group_size, args.prompt_len, args.new_tokens
    B = P * G
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = build_models(case, tmp)
    V = ours.config.vocab_size
    never = V  # an id no row can sample: both sides run all N steps
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, V, (P, T_p), generator=gen)  # (P, T_p)
    prompts = input_ids.tolist()

    impls = {"ours": Sampler(ours)}
    if args.compile:
        impls["ours+compile"] = Sampler(ours, compile=True)
    check = greedy_ok(hf, impls["ours"], prompts, input_ids, args.check_tokens)

    def ours_fn(sampler, n):
        def fn():
            r = sampler.sample(
                prompts, group_size=G, max_new_tokens=n, temperature=1.0, stop_ids=[never], seed=0
            )
            assert r.completion_ids.shape == (B, n)
            return r

        return fn

    def hf_fn(cache, n):
        def fn():
            out = hf_generate(hf, input_ids, group_size=G, max_new_tokens=n, cache=cache, eos=never)
            assert out.shape == (B, T_p + n)
            return out

        return fn

    fns = {name: (ours_fn(s, N), ours_fn(s, 1)) for name, s in impls.items()}
    for cache in args.hf_caches:
        fns[f"hf generate ({cache} cache)"] = (hf_fn(cache, N), hf_fn(cache, 1))
    for full, first in fns.values():  # warm-up (and compile) outside the timed rounds
        for _ in range(args.warmup):
            full(), first()
    times = {name: ([], [], []) for name in fns}  # full ms, 1-token ms, peak MiB
    for _ in range(args.rounds):
        for name, (full, first) in fns.items():
            t_full = measure(full, warmup=0, repeats=1)
            t_first = measure(first, warmup=0, repeats=1)
            times[name][0].append(t_full.median_ms)
            times[name][1].append(t_first.median_ms)
            times[name][2].append(t_full.peak_mem_mib)

    rows = []
    for name, (full_ms, first_ms, peaks) in times.items():
        total, prefill = statistics.median(full_ms), statistics.median(first_ms)
        q = statistics.quantiles(full_ms, n=5, method="inclusive") if len(full_ms) > 1 else None
        rows.append(
            {
                "case": case,
                "impl": name,
                "tok_per_s": B * N / (total / 1e3),
                "ms_per_step": (total - prefill) / (N - 1),
                "prefill_ms": prefill,
                "total_ms": total,
                "p20_ms": q[0] if q else total,
                "p80_ms": q[3] if q else total,
                "peak_mib": max(peaks),
                "greedy_ok": check if name.startswith("ours") else None,
                "times_ms": full_ms,
                "first_token_ms": first_ms,
            }
        )
    base = next((r for r in rows if r["impl"] == "hf generate (dynamic cache)"), None)
    for r in rows:
        if base is not None and r["impl"].startswith("ours"):
            r["x_hf"] = r["tok_per_s"] / base["tok_per_s"]
            r["target"] = TARGETS[case]
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="tiny,qwen3-0.6b", help=f"of {list(CASES)}")
    parser.add_argument("--prompts", type=int, default=4, help="P")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--prompt-len", type=int, default=128, help="T_p")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-caches", default="dynamic,static")
    parser.add_argument("--compile", action="store_true", help="also time Sampler(compile=True)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per implementation")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy parity steps")
    parser.add_argument("--name", default="sampler_cpu_float32")
    args = parser.parse_args(argv)
    args.hf_caches = [c for c in args.hf_caches.split(",") if c]

    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            parser.error(f"unknown case {case!r}; valid: {list(CASES)}")
        rows += run_case(case, args)
    meta = {
        "command": "python -m benchmarks.bench_sampler " + " ".join(argv or []),
        "setup": f"P={args.prompts} x G={args.group_size}, prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, float32, temperature 1, no top-k/top-p, "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up",
        "ms_per_step": "(t(N tokens) - t(1 token)) / (N - 1), prefill excluded",
        "x_hf": "tok_per_s / hf generate (dynamic cache) tok_per_s",
    }
    write_results(args.name, rows, COLUMNS, meta=meta)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
