"""Log-prob paths side by side: naive, chunked, torch.compile(naive), Liger, ours (Triton).

    python -m benchmarks.bench_logprobs                  # CPU: fp32, N=4096, C=1024, V=151936
    python -m benchmarks.bench_logprobs --device cuda    # GPU: bf16, N in {4096, 16384} x 2 heads
    python -m benchmarks.bench_logprobs --quick          # small shape, a few seconds

Modes: fwd (no grad), fwd_bwd (d_hidden and d_weight), fwd_bwd_frozen (d_hidden only: frozen
lm_head, the LoRA case). Flops counted as 2NCV (fwd), 6NCV (fwd_bwd), 4NCV (fwd_bwd_frozen),
whatever an implementation really does (ours recomputes logits in backward). Every
implementation's first call is checked against the reference (the first impl listed, naive by
default) before it is timed; a mismatch is reported and not timed. The checked implementations of
one shape and mode are then timed together, round-robin (`measure_interleaved`), so that load
drift on a shared machine hits them alike.
"""

import argparse
import gc
import importlib.util
import sys

import torch

from benchmarks.harness import (
    add_output_args,
    comma_list,
    matmul_ceiling_tflops,
    measure_interleaved,
    write_results,
)
from kernels.reference import chunked_logprobs, naive_logprobs

MODES = {"fwd": 2, "fwd_bwd": 6, "fwd_bwd_frozen": 4}  # counted flops per N*C*V
IMPLS = ("naive", "chunked", "compile", "liger", "triton")
GPU_SHAPES = (
    (4096, 1024, 151936),
    (16384, 1024, 151936),
    (4096, 4096, 128256),
    (16384, 4096, 128256),
)
CPU_SHAPES = ((4096, 1024, 151936),)
QUICK_SHAPES = ((512, 256, 8192),)
# sanity bounds against the reference: max |logprob diff|, max relative L2 error of a gradient
TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (5e-2, 2e-2), torch.float16: (2e-2, 1e-2)}
COLUMNS = [
    "shape", "mode", "impl", "median_ms", "p20_ms", "p80_ms", "peak_mib", "tflops", "pct_ceil",
    "x_floor", "x_naive_time", "x_naive_mem", "lp_err", "grad_err", "note",
]  # fmt: skip


class Skip(Exception):
    """An implementation that cannot run here; the message goes into the table's note."""


def build_impl(name: str, device: torch.device, temperature: float):
    """Return fn(hidden, weight, ids) -> logprobs (N,) for one implementation, or raise Skip."""
    if name == "naive":
        return lambda h, w, ids: naive_logprobs(h, w, ids, temperature)
    if name == "chunked":
        return lambda h, w, ids: chunked_logprobs(h, w, ids, temperature)
    if name == "compile":
        torch._dynamo.reset()  # fresh caches: one graph per shape and mode, no eager fallback
        compiled = torch.compile(naive_logprobs, dynamic=False)
        return lambda h, w, ids: compiled(h, w, ids, temperature)
    if name == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            raise Skip("liger_kernel not installed")
        if device.type != "cuda":
            raise Skip("Liger needs CUDA")
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="none")
        # per-token CE = -logprob; temperature folded into hidden: (h / T) @ W^T = z / T
        return lambda h, w, ids: -loss_fn(w, h / temperature if temperature != 1 else h, ids)
    if name == "triton":
        if device.type != "cuda":
            raise Skip("Triton kernels are timed on CUDA only")
        from kernels.logprobs import triton_logprobs

        return lambda h, w, ids: triton_logprobs(h, w, ids, temperature)
    raise ValueError(f"unknown impl {name!r}; choose from {IMPLS}")


def make_call(fn, hidden, weight, ids, grad, mode: str):
    """The timed closure: returns (logprobs, *grads) so the first call doubles as the check."""
    if mode == "fwd":

        def call():
            with torch.no_grad():
                return (fn(hidden, weight, ids),)

        return call
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(mode == "fwd_bwd")
    inputs = (h, w) if mode == "fwd_bwd" else (h,)

    def call():
        logprobs = fn(h, w, ids)
        return (logprobs.detach(), *torch.autograd.grad(logprobs, inputs, grad))

    return call


def compare(out, ref) -> tuple[float, float]:
    """(max |logprob diff|, max over gradients of ||a - b|| / ||b||)."""
    lp_err = (out[0].float() - ref[0].float()).abs().max().item()
    grad_err = 0.0
    for a, b in zip(out[1:], ref[1:]):
        grad_err = max(grad_err, ((a.float() - b.float()).norm() / b.float().norm()).item())
    return lp_err, grad_err


def bench_shape(shape, args, device, dtype, ceiling_tflops) -> list[dict]:
    n_tok, c, v = shape
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n_tok, c, device=device, dtype=dtype, generator=gen)
    weight = (torch.randn(v, c, device=device, generator=gen) * 2 / c**0.5).to(dtype)  # z ~ 2
    ids = torch.randint(0, v, (n_tok,), device=device, generator=gen)
    grad = torch.randn(n_tok, device=device, generator=gen)
    lp_tol, grad_tol = TOLERANCE[dtype]
    rows = []
    for mode in args.modes:
        flops = MODES[mode] * n_tok * c * v
        floor_ms = flops / (ceiling_tflops * 1e12) * 1e3
        ref, ref_impl, calls, mode_rows = None, None, {}, {}
        for impl in args.impls:
            row = {"shape": f"{n_tok}x{c}x{v}", "dtype": str(dtype).split(".")[-1], "mode": mode}
            row["impl"] = impl
            rows.append(row)
            mode_rows[impl] = row
            try:
                fn = build_impl(impl, device, args.temperature)
                call = make_call(fn, hidden, weight, ids, grad, mode)
                out = call()  # compiles / warms up, and is checked before any timing
            except Skip as e:
                row["note"] = f"skipped: {e}"
                continue
            except Exception as e:  # noqa: BLE001 - one failing impl must not end the run
                row["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                continue
            if ref is None:
                ref, ref_impl, row["note"] = out, impl, "reference"
            else:
                row["lp_err"], row["grad_err"] = compare(out, ref)
                if row["lp_err"] > lp_tol or row["grad_err"] > grad_tol:
                    row["note"] = f"MISMATCH vs {ref_impl}, not timed"
                    continue
            calls[impl] = call
            del out
        del ref
        # all checked impls timed together, round-robin, so load drift hits them alike
        timings = measure_interleaved(
            calls, warmup=args.warmup, repeats=args.repeats, device=device
        ) if calls else {}  # fmt: skip
        naive = timings.get("naive")
        for impl, t in timings.items():
            row = mode_rows[impl]
            tflops = flops / (t.median_ms * 1e-3) / 1e12
            row.update(median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms)
            row.update(peak_mib=t.peak_mem_mib, tflops=tflops, x_floor=t.median_ms / floor_ms)
            row["pct_ceil"] = 100 * tflops / ceiling_tflops
            if naive is not None:
                row["x_naive_time"] = t.median_ms / naive.median_ms
                row["x_naive_mem"] = t.peak_mem_mib / naive.peak_mem_mib
            print(f"  {row['shape']} {mode:15s} {impl:8s} {t.median_ms:10.2f} ms "
                  f"{t.peak_mem_mib:9.1f} MiB", flush=True)  # fmt: skip
        del calls
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bf16 GPU, fp32 CPU)")
    p.add_argument("--shapes", default=None, help="comma list of NxCxV, e.g. 4096x1024x151936")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list from {IMPLS}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list from {tuple(MODES)}")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=None, help="extra untimed calls after the check")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 10 GPU, 3 CPU)")
    p.add_argument("--quick", action="store_true", help="small shape and few repeats")
    add_output_args(p, None)
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.shapes:
        args.shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        args.shapes = QUICK_SHAPES if args.quick else (GPU_SHAPES if cuda else CPU_SHAPES)
    args.impls = comma_list(p, "--impls", args.impls, IMPLS)
    args.modes = comma_list(p, "--modes", args.modes, MODES)
    if args.warmup is None:
        args.warmup = 2 if cuda else 0
    if args.repeats is None:
        args.repeats = 3 if (args.quick or not cuda) else 10
    args.name = args.name or f"logprobs_{'cuda' if cuda else 'cpu'}_{args.dtype}"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    ceiling = matmul_ceiling_tflops(device, dtype, size=512 if args.quick else None)
    print(f"measured {args.dtype} matmul ceiling: {ceiling:.2f} TFLOP/s", flush=True)
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args, device, dtype, ceiling)
    meta = {
        "command": "python -m benchmarks.bench_logprobs " + " ".join(sys.argv[1:]),
        "dtype": args.dtype,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "matmul_ceiling_tflops": round(ceiling, 3),
        "flops": "fwd 2NCV, fwd_bwd 6NCV, fwd_bwd_frozen 4NCV; x_floor = time / (flops / ceiling)",
    }
    write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    main()
