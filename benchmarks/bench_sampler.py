"""Our rollout sampler vs `transformers` `generate`, same checkpoint and settings, side by side.

    python -m benchmarks.bench_sampler --compile tiny        # the recorded run (docs/sampler.md)
    python -m benchmarks.bench_sampler --cases tiny --rounds 3 --out-dir /tmp/bench   # quick
    python -m benchmarks.bench_sampler --cases qwen3-0.6b --device cuda --batches 4x8,16x8 \
        --hf-caches dynamic --warmup 1 --rounds 5 --name sampler_gpu_eager   # gpu_check.sh

Both sides sample P=4 prompts x G=8 completions of a 128-token prompt, 64 new tokens each,
temperature 1 with no top-k / top-p, float32 on the CPU (`--device`, `--dtype`, and `--batches
PxG,...` for several batch sizes in one run), from the same random-weight checkpoint (built with
`transformers` into a temp dir; ours loads it through `grpo.models.load_model`). The stop id is
the vocab size, which no row can sample, so every row produces exactly 64 tokens on both sides.
`generate` runs with do_sample=True, num_return_sequences=G (it expands the prompts before its
prefill; we prefill each prompt once and copy its KV rows G times), with a dynamic and/or a
static cache (`impl` says which).

Before timing, greedy decoding of each of our samplers and of `generate` (dynamic cache) is
checked to give the same tokens on the timed batch's B rows (`greedy_match`: the mean over rows
of the fraction of `--check-tokens` steps before the first differing token; `greedy_ok`: all
equal). On CUDA, `generate` with a static cache compiles its forward itself (transformers'
auto-compile), so there `hf generate (static cache)` is transformers' compiled path.
Each call is timed on its own with `benchmarks.harness.measure`, the implementations
interleaved round by round so that a busy machine slows them alike. Columns:

- `tok_per_s`: B * 64 / t(64 tokens), prefill included; `total_ms` = t(64 tokens) (median,
  spread p20-p80 over the rounds).
- `ms_per_step`: (t(64 tokens) - t(1 token)) / 63, the same subtraction for both sides, so
  prefill is excluded; `prefill_ms` = t(1 token).
- `peak_mib`: resident memory added at the peak of the 64-token call (harness).
- `cpu_ms`: process CPU time of the 64-token call (all threads).
- `x_hf_dyn`, `x_hf_static`: our tok_per_s over generate's with that cache; `x_cpu` the
  CPU-time ratio against the dynamic cache (stable when other jobs share the cores).

Results are written after each batch size, so a run stopped by a timeout keeps the batches
that finished.

Threads: the tiny case runs on one thread (at its shapes an op takes microseconds and OpenMP
fork/join on more threads costs more than it saves), the 0.6B shape on all of torch's threads.
"""

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.harness import (
    add_output_args,
    comma_list,
    copy_bandwidth_gbps,
    matmul_ceiling_tflops,
    measure,
    write_results,
)
from benchmarks.models import CASES

# threads 0 = torch's default; target = required tok/s ratio ours / generate (dynamic cache);
# rounds / warmup: timed / untimed calls per implementation (flags override them)
COLUMNS = [
    "case",
    "batch",
    "impl",
    "threads",
    "tok_per_s",
    "ms_per_step",
    "prefill_ms",
    "total_ms",
    "p20_ms",
    "p80_ms",
    "peak_mib",
    "cpu_ms",
    "x_hf_dyn",
    "x_hf_static",
    "x_cpu",
    "target",
    "greedy_match",
    "greedy_ok",
    "floor_ms",
    "of_floor",
    "launches",
    "syncs",
]
HF_DYNAMIC, HF_STATIC = "hf generate (dynamic cache)", "hf generate (static cache)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_models(
    case: str, out_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32, **config
):
    """A random-init Qwen3 checkpoint of `case` saved to `out_dir` (float32, then cast);
    (hf_model, our_model) on `device` in `dtype`.

    Args:
        case: a key of CASES (the architecture).
        out_dir: where the checkpoint is written (ours loads it from there).
        device, dtype: where and in what both models run.
        **config: Qwen3Config overrides (e.g. initializer_range).
    """
    from transformers import AutoModelForCausalLM, Qwen3Config

    from grpo.models import load_model

    cfg = Qwen3Config(
        **{
            **CASES[case]["config"],
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "eos_token_id": 1,
            "pad_token_id": 0,
            **config,
        }
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(out_dir)
    hf = hf.to(device=device, dtype=dtype)
    return hf, load_model(out_dir, dtype=dtype, device=device)


def hf_generate(hf, input_ids, *, group_size, max_new_tokens, cache, eos, do_sample=True):
    """`generate` on (P, T_p) unpadded prompts -> (P*G, T_p + max_new_tokens) ids."""
    kwargs = dict(cache_implementation="static") if cache == "static" else {}
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0) if do_sample else {}
    if not do_sample and group_size > 1:  # greedy generate takes one sequence per input row
        input_ids, group_size = input_ids.repeat_interleave(group_size, dim=0), 1
    return hf.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=do_sample,
        num_return_sequences=group_size,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        **sampling,
        **kwargs,
    )


def prefix_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the fraction of steps before the first differing token: 1.0 when the
    (B, N) token arrays are equal, lower the earlier rows diverge."""
    same = (a == b).int().cumprod(dim=1)  # (B, N): 1 until the first difference
    return float(same.sum()) / same.numel()


def greedy_agreement(hf, sampler, input_ids, group_size: int, tokens: int) -> float:
    """`prefix_agreement` of our greedy tokens and `generate`'s (dynamic cache) on the same
    B = P*G rows as the timed calls (so a compiled sampler checks the graph it is timed with)."""
    never = hf.config.vocab_size
    ours = sampler.sample(
        input_ids.tolist(),
        group_size=group_size,
        max_new_tokens=tokens,
        temperature=0,
        stop_ids=[never],
        seed=0,
    )
    theirs = hf_generate(
        hf,
        input_ids,
        group_size=group_size,
        max_new_tokens=tokens,
        cache="dynamic",
        eos=never,
        do_sample=False,
    )
    return prefix_agreement(ours.completion_ids, theirs[:, input_ids.shape[1] :])


def with_cpu_time(fn, out: list):
    """`fn` that also appends its process CPU time (ms, all threads) to `out`."""

    def timed():
        t0 = time.process_time()
        result = fn()
        out.append((time.process_time() - t0) * 1e3)
        return result

    return timed


def run_case(case: str, args, default_threads: int):
    """Build the checkpoint once; for each batch size check greedy parity and time every
    implementation. Yields each batch's rows (one per implementation) as soon as it is done."""
    from grpo.rollout import Sampler

    spec = CASES[case]
    threads = args.threads or spec["threads"] or default_threads
    torch.set_num_threads(threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    T_p, N = args.prompt_len, args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = build_models(case, tmp, device=args.device, dtype=dtype)
    never = ours.config.vocab_size  # an id no row can sample: both sides run all N steps
    rate, bw = args.floor_rates if case in args.floor else (None, None)
    samplers = {} if args.no_eager else {"ours": Sampler(ours)}
    if case in args.compile:
        samplers["ours+compile"] = Sampler(ours, compile=True)
    warmup = spec["warmup"] if args.warmup is None else args.warmup
    rounds = args.rounds or spec["rounds"]
    for P, G in args.batches:
        B = P * G
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(2, never, (P, T_p), generator=gen).to(device)  # (P, T_p)
        prompts = input_ids.tolist()
        checks = {
            name: greedy_agreement(hf, s, input_ids, G, args.check_tokens)
            for name, s in samplers.items()
        }

        def ours_fn(sampler, n, G=G, B=B, prompts=prompts):
            def fn():
                r = sampler.sample(
                    prompts,
                    group_size=G,
                    max_new_tokens=n,
                    temperature=1.0,
                    stop_ids=[never],
                    seed=0,
                )
                assert r.completion_ids.shape == (B, n)
                return r

            return fn

        def hf_fn(cache, n, G=G, B=B, input_ids=input_ids):
            def fn():
                out = hf_generate(
                    hf, input_ids, group_size=G, max_new_tokens=n, cache=cache, eos=never
                )
                assert out.shape == (B, T_p + n)
                return out

            return fn

        fns = {name: (ours_fn(s, N), ours_fn(s, 1)) for name, s in samplers.items()}
        # on CUDA generate's static cache is its torch.compile path (transformers compiles
        # the forward itself): timed beside ours by default there
        default = "dynamic,static" if device.type == "cuda" else spec["hf_caches"]
        for cache in (args.hf_caches or default).split(","):
            if cache:
                fns[f"hf generate ({cache} cache)"] = (hf_fn(cache, N), hf_fn(cache, 1))
        for full, first in fns.values():  # warm-up (and compile) outside the timed rounds
            for _ in range(warmup):
                full(), first()
        runs = {name: {"full": [], "first": [], "peak": [], "cpu": []} for name in fns}
        for _ in range(rounds):
            for name, (full, first) in fns.items():
                t_full = measure(
                    with_cpu_time(full, runs[name]["cpu"]), warmup=0, repeats=1, device=device
                )
                runs[name]["full"].append(t_full.median_ms)
                runs[name]["peak"].append(t_full.peak_mem_mib)
                t_first = measure(first, warmup=0, repeats=1, device=device)
                runs[name]["first"].append(t_first.median_ms)
        rows = batch_rows(case, f"{P}x{G}", B, N, threads, spec, runs, checks, rounds, warmup)
        for r in rows:  # what one eager decode step launches and syncs (compiled: a replay)
            if r["impl"] == "ours":
                r.update(step_cost(samplers["ours"], prompts, G, never))
        if rate is not None:
            floor = decode_floor_ms(ours, B, T_p + N / 2, rate, bw)
            for r in rows:
                r["floor_ms"] = floor
                r["of_floor"] = floor / r["ms_per_step"]
        yield rows


def step_cost(sampler, prompts, G: int, never: int) -> dict:
    """Kernel launches, weight casts and host syncs of one steady-state decode step of
    `sampler` (`grpo.testing.launches.per_decode_step`: aten ops counted on this device)."""
    from grpo.testing.launches import per_decode_step

    cost = per_decode_step(
        lambda n: sampler.sample(
            prompts, group_size=G, max_new_tokens=n, temperature=1.0, stop_ids=[never], seed=0
        ),
        n1=4,
        n2=8,
    )
    return {"launches": cost["launches"], "syncs": cost["syncs"], "casts": cost["casts"]}


def decode_floor_ms(model, B: int, context: float, tflops: float, gbs: float) -> float:
    """This machine's floor for one decode step of B rows: the larger of reading every weight
    and the KV cache (B rows x `context` positions, in the weights' dtype) once at the
    measured bandwidth of this device, and the step's FLOPs (2 per weight per row, the head
    included, plus attention's score and value products over `context` keys) at the measured
    matmul rate."""
    seen, weight_bytes, matmul_params = set(), 0, 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        weight_bytes += p.numel() * p.element_size()
        if p.dim() == 2 and "embed_tokens" not in name:
            matmul_params += p.numel()
    if model.config.tie_word_embeddings:
        matmul_params += model.lm_head.weight.numel()  # the tied head multiplies too
    c = model.config
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context
    flops = B * (2 * matmul_params + attn)
    elem = next(model.parameters()).element_size()
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * B * elem
    return max((weight_bytes + kv_bytes) / (gbs * 1e9), flops / (tflops * 1e12)) * 1e3


def batch_rows(case, batch, B, N, threads, spec, runs, checks, rounds, warmup) -> list[dict]:
    """One row per implementation of one batch size, with the ratios against `generate`."""
    rows = []
    for name, run in runs.items():
        total, prefill = statistics.median(run["full"]), statistics.median(run["first"])
        q = statistics.quantiles(run["full"], n=5, method="inclusive") if rounds > 1 else None
        rows.append(
            {
                "case": case,
                "batch": batch,
                "impl": name,
                "threads": threads,
                "tok_per_s": B * N / (total / 1e3),
                "ms_per_step": (total - prefill) / (N - 1),
                "prefill_ms": prefill,
                "total_ms": total,
                "p20_ms": q[0] if q else total,
                "p80_ms": q[3] if q else total,
                "peak_mib": max(run["peak"]),
                "cpu_ms": statistics.median(run["cpu"]),
                "greedy_match": checks.get(name),
                "greedy_ok": checks[name] == 1.0 if name in checks else None,
                "rounds": rounds,
                "warmup": warmup,
                "runs_ms": run,
            }
        )
    by_impl = {r["impl"]: r for r in rows}
    for r in rows:
        if not r["impl"].startswith("ours"):
            continue
        r["target"] = spec["target"]
        if HF_DYNAMIC in by_impl:
            r["x_hf_dyn"] = r["tok_per_s"] / by_impl[HF_DYNAMIC]["tok_per_s"]
            r["x_cpu"] = by_impl[HF_DYNAMIC]["cpu_ms"] / r["cpu_ms"]
        if HF_STATIC in by_impl:
            r["x_hf_static"] = r["tok_per_s"] / by_impl[HF_STATIC]["tok_per_s"]
    return rows


def parse_batches(text: str) -> list[tuple[int, int]]:
    """Parse `--batches`: "4x8,16x8" -> [(4, 8), (16, 8)] (P x G); raises ValueError."""
    out = []
    for item in text.split(","):
        p, _, g = item.partition("x")
        P, G = int(p), int(g)
        if P < 1 or G < 1:
            raise ValueError(item)
        out.append((P, G))
    return out


# The decode step's attention at the Qwen3-0.6B heads (H, H_kv, D) and depth, per layer.
QWEN3_HEADS, QWEN3_LAYERS = (16, 8, 128), 28


def decode_attention_ab(args) -> list[dict]:
    """The decode step's attention in each arrangement `grpo.models.sdpa_choice` can pick, at
    the Qwen3-0.6B heads: SDPA with the mask and `enable_gqa` ("grouped"), the query heads of a
    kv head as its queries (`decode_sdpa`, "fold"), two matmuls (`decode_attention`, "matmul");
    ms per layer and per decode step (x 28 layers), interleaved, with the kernel SDPA's
    selector gives each call and which arrangement the decoder picks here. Each is checked
    against float64 math on the first 4 rows before timing."""
    import torch.nn.functional as F

    from benchmarks.harness import measure_interleaved
    from grpo.models import sdpa_choice
    from grpo.models.decoder import decode_attention, decode_sdpa

    B, S = (int(x) for x in args.decode_attention.split("x"))
    H, H_kv, D = QWEN3_HEADS
    dtype, dev = DTYPES[args.dtype], torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g).to(dev, dtype)
    k, v = (torch.randn(B, H_kv, S, D, generator=g).to(dev, dtype) for _ in range(2))
    keep = torch.rand(B, S, generator=g) > 0.1
    keep[:, -1] = True
    mask = torch.zeros(B, 1, 1, -(-S // 8) * 8, dtype=dtype, device=dev)[..., :S]
    mask.masked_fill_(~keep.to(dev)[:, None, None], float("-inf"))

    def grouped(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    impls = {
        sdpa_choice.GROUPED: grouped,
        sdpa_choice.FOLD: decode_sdpa,
        sdpa_choice.MATMUL: decode_attention,
    }
    kernel = {
        sdpa_choice.GROUPED: sdpa_choice.sdpa_backend(q, k, v, mask, enable_gqa=True).name,
        sdpa_choice.FOLD: sdpa_choice.sdpa_backend(
            q.reshape(B, H_kv, H // H_kv, D), k, v, mask
        ).name,
        sdpa_choice.MATMUL: "two matmuls",
    }
    picked = sdpa_choice.choose("decode", dev, dtype, QWEN3_HEADS)
    sub = [t[:4] for t in (q, k, v, mask)]
    want = decode_attention(*(t.double() for t in sub))
    err = {n: (f(*sub).double() - want).abs().max().item() for n, f in impls.items()}
    timings = measure_interleaved(
        {n: (lambda f=f: f(q, k, v, mask)) for n, f in impls.items()},
        warmup=2,
        repeats=10,
        device=dev,
    )
    base = timings[sdpa_choice.GROUPED].median_ms
    return [
        {
            "impl": n,
            "kernel": kernel[n],
            "picked": n == picked,
            "shape": f"B={B} S={S} H={H} H_kv={H_kv} D={D}",
            "dtype": args.dtype,
            "device": args.device,
            "ms_per_layer": t.median_ms,
            "ms_per_step": t.median_ms * QWEN3_LAYERS,
            "x_grouped": t.median_ms / base,
            "max_err_vs_f64": err[n],
        }
        for n, t in timings.items()
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cases",
        default="tiny,qwen3-0.6b",
        help=f"of {list(CASES)}, or none (--decode-attention alone)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="P")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument(
        "--batches",
        default="",
        help="PxG,PxG,... batch sizes in one run (default: --prompts x --group-size)",
    )
    parser.add_argument("--prompt-len", type=int, default=128, help="T_p")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument(
        "--hf-caches",
        default="",
        help="dynamic,static (default: per case on a CPU, both on CUDA; 'none' for no generate)",
    )
    parser.add_argument("--compile", default="", help="cases that also time compile=True")
    parser.add_argument(
        "--no-eager",
        action="store_true",
        help="leave out our eager sampler (time only --compile's)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: per case)")
    parser.add_argument("--warmup", type=int, default=None, help="default: per case")
    parser.add_argument("--rounds", type=int, default=None, help="default: per case")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy parity steps")
    parser.add_argument(
        "--floor", default="qwen3-0.6b", help="cases whose rows get the machine's decode floor"
    )
    parser.add_argument(
        "--decode-attention",
        default="",
        metavar="BxS",
        help="also time the decode step's attention at the Qwen3-0.6B heads, "
        "B rows x S slots (e.g. 128x1280): <name>_attention",
    )
    add_output_args(parser, "sampler_cpu_float32")
    args = parser.parse_args(argv)
    cases = [] if args.cases == "none" else comma_list(parser, "--cases", args.cases, CASES)
    args.compile = [c for c in args.compile.split(",") if c]
    try:
        args.batches = (
            parse_batches(args.batches) if args.batches else [(args.prompts, args.group_size)]
        )
    except ValueError as e:
        parser.error(f"--batches: expected PxG,... with positive integers, got {e}")
    if args.hf_caches == "none":
        args.hf_caches = ","
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (ms_per_step subtracts the 1-token call)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here")

    args.floor = [c for c in args.floor.split(",") if c in cases]
    args.floor_rates = (None, None)
    if args.floor:  # measured before any model is built: the device's matmul rate, bandwidth
        args.floor_rates = (
            matmul_ceiling_tflops(args.device, DTYPES[args.dtype]),
            copy_bandwidth_gbps(args.device, mib=1024),
        )
        gflops, gbs = args.floor_rates[0] * 1e3, args.floor_rates[1]
        print(
            f"floor: {gflops:.0f} GFLOP/s ({args.dtype} 2048^3 matmul), {gbs:.1f} GB/s "
            f"(1 GiB copy on {args.device})",
            flush=True,
        )

    import transformers

    transformers.logging.set_verbosity_error()
    default_threads = torch.get_num_threads()
    batches = ",".join(f"{p}x{g}" for p, g in args.batches)
    meta = {
        "command": " ".join(["python -m benchmarks.bench_sampler", *argv]),
        "setup": f"P x G = {batches}, prompt {args.prompt_len} tokens, {args.new_tokens} new "
        f"tokens, {args.dtype} on {args.device}, temperature 1, no top-k/top-p; "
        "implementations interleaved round by round (rounds/warmup per row in the JSON)",
        "ms_per_step": "(t(N tokens) - t(1 token)) / (N - 1): prefill excluded",
        "x_hf_dyn / x_hf_static": "our tok_per_s over generate's with a dynamic / static cache",
        "x_cpu": "hf generate (dynamic cache) cpu_ms / our cpu_ms",
        "floor_ms / of_floor": "this device's decode-step floor (max of every weight and the KV "
        "cache read once at the device's measured copy bandwidth, the step's FLOPs at the "
        "measured matmul rate; `decode_floor_ms`) and floor_ms / ms_per_step",
        "launches / syncs": "aten ops that launch a kernel, and host syncs, per eager decode "
        "step of ours (`grpo.testing.launches.per_decode_step`; a compiled step replays a graph)",
        "greedy_match": f"greedy tokens vs generate over {args.check_tokens} steps on the "
        "timed B rows: mean fraction of steps before the first difference (1 = identical)",
    }
    if args.decode_attention:
        attn = decode_attention_ab(args)
        write_results(
            f"{args.name}_attention",
            attn,
            list(attn[0]),
            out_dir=args.out_dir,
            meta={"command": meta["command"], "what": decode_attention_ab.__doc__.split("\n\n")[0]},
        )
    rows: list[dict] = []
    for case in cases:
        for batch in run_case(case, args, default_threads):
            rows.extend(batch)  # written after every batch: a timeout keeps what finished
            write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
