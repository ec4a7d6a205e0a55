"""Log-prob paths side by side: naive, chunked, torch.compile(naive), Liger, ours (Triton), and
any kernel of yours (`--impl package.module:function`, repeatable). It runs from the installed
package (`grpo bench logprobs`; in the repository also `python -m benchmarks.bench_logprobs`):

    grpo bench logprobs                  # CPU: fp32, N=4096, C=1024, V=151936
    grpo bench logprobs --device cuda    # GPU: bf16, N in {4096, 16384} x 2 heads
    grpo bench logprobs --quick          # small shape, a few seconds
    grpo bench logprobs --quick --impl my_pkg.kernel:logprobs   # yours too

Modes: fwd (no grad), fwd_bwd (d_hidden and d_weight), fwd_bwd_entropy (the trainer's update
call: log-probs and the entropy beside them, d_hidden and d_weight of the log-probs),
fwd_bwd_frozen (d_hidden only: frozen lm_head, the LoRA case), and bwd, derived: fwd_bwd's time
minus fwd's (the same calls, measured in one run; a negative difference, timing noise where the
backward is cheap next to the forward, is kept and noted, with no throughput). Counted work per
mode, whatever an implementation really does (ours recomputes logits in backward): flops 2NCV
(fwd), 6NCV (fwd_bwd, fwd_bwd_entropy), 4NCV (fwd_bwd_frozen, bwd); bytes the least any
implementation must move, s the operand size: fwd (NC + VC) s + 12N (hidden, weight, ids in;
log-probs out), fwd_bwd 2 (NC + VC) s + 16N (and d_hidden, d_weight out, the upstream gradient
in), fwd_bwd_entropy that + 4N (the entropy out), fwd_bwd_frozen (2NC + VC) s + 16N, bwd
fwd_bwd's minus fwd's. Columns: `tok_per_s` (N / time), `tflops`, `gb_per_s` (counted bytes /
time), `pct_roofline`: the roofline time (the larger of flops / the matmul ceiling and bytes /
the copy bandwidth, both measured here) over the measured time; a ceiling that an
implementation beats is raised to what it achieved (said in the run's metadata), so the column
never reads above 100.

Correctness gate, before any timing: each implementation against float64 torch (the chunked
path on float64 operands); its error must be no worse than the same-dtype torch reference's
(chunked, in the run's dtype) plus `grpo.testing.kernels.SLACK` (1e-5 float32, 2e-2 bfloat16;
gradients relative to their largest entry), the rule of `grpo.testing.check_logprob_impl`.
In fwd_bwd_entropy the entropy is gated the same way (`ent_err`); Liger returns none and is
skipped there. A mismatch is reported and not timed. The checked implementations of one
shape and mode are then timed together, round-robin (`measure_interleaved`), so that load
drift on a shared machine hits them alike.

The results file's metadata holds the command that reproduces the run, prefixed with
``TRITON_INTERPRET=1`` when it was set (Triton kernels interpreted on the CPU: correct, not
fast), ``triton_interpret`` (its value), and ``outside_kernels``: for each `--impl`, its
function (``module:qualname``), source file and that file's sha256 (16 hex digits), so a
stored timing names the kernel's code it measured.
"""

import argparse
import gc
import hashlib
import importlib.util
import inspect
import os
import shlex
import sys

import torch

import grpo_kernels
from grpo.apps.bench.harness import (
    add_output_args,
    comma_list,
    copy_bandwidth_gbps,
    matmul_ceiling_tflops,
    measure_interleaved,
    write_results,
)
from grpo_kernels.reference import chunked_logprobs, naive_logprobs

# counted flops per N*C*V
MODES = {"fwd": 2, "fwd_bwd": 6, "fwd_bwd_entropy": 6, "fwd_bwd_frozen": 4}
DERIVED = {"bwd": ("fwd_bwd", "fwd")}  # mode: (its time = a's minus b's), when both ran
IMPLS = ("naive", "chunked", "compile", "liger", "triton")
GPU_SHAPES = (
    (4096, 1024, 151936),
    (16384, 1024, 151936),
    (4096, 4096, 128256),
    (16384, 4096, 128256),
)
CPU_SHAPES = ((4096, 1024, 151936),)
QUICK_SHAPES = ((512, 256, 8192),)
COLUMNS = [
    "shape",
    "dtype",
    "mode",
    "impl",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "tok_per_s",
    "tflops",
    "gb_per_s",
    "pct_roofline",
    "peak_mib",
    "x_naive_time",
    "x_naive_mem",
    "lp_err",
    "ent_err",
    "grad_err",
    "note",
]


def counted_bytes(mode: str, n: int, c: int, v: int, size: int) -> int:
    """The least bytes any implementation of `mode` must move (module docstring)."""
    if mode == "fwd":
        return (n * c + v * c) * size + 12 * n
    if mode == "fwd_bwd":
        return 2 * (n * c + v * c) * size + 16 * n
    if mode == "fwd_bwd_entropy":
        return 2 * (n * c + v * c) * size + 20 * n
    if mode == "fwd_bwd_frozen":
        return (2 * n * c + v * c) * size + 16 * n
    return counted_bytes("fwd_bwd", n, c, v, size) - counted_bytes("fwd", n, c, v, size)


def counted_flops(mode: str, n: int, c: int, v: int) -> int:
    return (MODES.get(mode) or 4) * n * c * v


class Skip(Exception):
    """An implementation that cannot run here; the message goes into the table's note."""


def build_impl(name: str, device: torch.device, temperature: float, entropy: bool = False):
    """fn(hidden, weight, ids) -> logprobs (N,) of one implementation, with `entropy`
    (logprobs, entropy) (N,) each as the trainer asks for them; or raise Skip."""
    if name == "naive":
        return lambda h, w, ids: naive_logprobs(h, w, ids, temperature, entropy)
    if name == "chunked":
        return lambda h, w, ids: chunked_logprobs(h, w, ids, temperature, entropy)
    if name == "compile":
        torch._dynamo.reset()  # fresh caches: one graph per shape and mode, no eager fallback
        compiled = torch.compile(naive_logprobs, dynamic=False)
        return lambda h, w, ids: compiled(h, w, ids, temperature, entropy)
    if name == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            raise Skip("liger_kernel not installed")
        if device.type != "cuda":
            raise Skip("Liger needs CUDA")
        if entropy:
            raise Skip("Liger's fused linear cross entropy returns no entropy")
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="none")
        # per-token CE = -logprob; temperature folded into hidden: (h / T) @ W^T = z / T
        return lambda h, w, ids: -loss_fn(w, h / temperature if temperature != 1 else h, ids)
    if name == "triton":
        if device.type != "cuda":
            raise Skip("Triton kernels are timed on CUDA only")
        from grpo_kernels.logprobs import triton_logprobs

        return lambda h, w, ids: triton_logprobs(h, w, ids, temperature, entropy)
    fn = grpo_kernels.get_logprob_impl(name)  # a registered name or package.module:function
    if fn is None:
        raise ValueError(f"unknown impl {name!r}; choose from {IMPLS} or give a path")
    if entropy:
        return lambda h, w, ids: fn(h, w, ids, temperature, True)
    return lambda h, w, ids: fn(h, w, ids, temperature)


def make_call(fn, hidden, weight, ids, grad, mode: str):
    """The timed closure: returns (logprobs, *grads[, entropy]) so the first call doubles as
    the check (the entropy last, in fwd_bwd_entropy)."""
    if mode == "fwd":

        def call():
            with torch.no_grad():
                return (fn(hidden, weight, ids),)

        return call
    trained = mode in ("fwd_bwd", "fwd_bwd_entropy")
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(trained)
    inputs = (h, w) if trained else (h,)

    def call():
        out = fn(h, w, ids)
        if mode == "fwd_bwd_entropy" and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("asked for the entropy (return_entropy=True), it returned none")
        logprobs, entropy = out if mode == "fwd_bwd_entropy" else (out, None)
        grads = torch.autograd.grad(logprobs, inputs, grad)
        tail = () if entropy is None else (entropy.detach(),)
        return (logprobs.detach(), *grads, *tail)

    return call


def errors(out, gold, mode: str = "fwd") -> tuple[float, float, float | None]:
    """(max |log-prob - float64's|, max over gradients of max |a - b| / max |b|, max
    |entropy - float64's| in fwd_bwd_entropy, else None)."""
    ent_err = None
    if mode == "fwd_bwd_entropy":
        ent_err = (out[-1].double() - gold[-1]).abs().max().item() if out[-1].numel() else 0.0
        out, gold = out[:-1], gold[:-1]
    lp_err = (out[0].double() - gold[0]).abs().max().item() if out[0].numel() else 0.0
    grad_err = 0.0
    for a, b in zip(out[1:], gold[1:]):
        scale = max(b.abs().max().item(), 1e-30)
        grad_err = max(grad_err, (a.double() - b).abs().max().item() / scale)
    return lp_err, grad_err, ent_err


def bench_shape(shape, args, device, dtype, ceilings) -> list[dict]:
    from grpo.testing.kernels import SLACK

    n_tok, c, v = shape
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n_tok, c, device=device, dtype=dtype, generator=gen)
    weight = (torch.randn(v, c, device=device, generator=gen) * 2 / c**0.5).to(dtype)  # z ~ 2
    ids = torch.randint(0, v, (n_tok,), device=device, generator=gen)
    grad = torch.randn(n_tok, device=device, generator=gen)
    slack = SLACK.get(dtype, 1e-5)
    size = torch.finfo(dtype).bits // 8
    label = f"{n_tok}x{c}x{v}"
    rows, timed = [], {}  # timed: (mode, impl) -> Timing
    for mode in args.modes:
        # the gate: float64 torch, and the same-dtype torch reference's error against it
        entropy = mode == "fwd_bwd_entropy"
        gold = make_call(
            build_impl("chunked", device, args.temperature, entropy),
            hidden.double(),
            weight.double(),
            ids,
            grad.double(),
            mode,
        )()
        same = make_call(
            build_impl("chunked", device, args.temperature, entropy),
            hidden,
            weight,
            ids,
            grad,
            mode,
        )()
        ref_lp, ref_grad, ref_ent = errors(same, gold, mode)
        del same
        calls, mode_rows = {}, {}
        for impl in args.impls:
            row = {"shape": label, "dtype": str(dtype).split(".")[-1], "mode": mode, "impl": impl}
            rows.append(row)
            mode_rows[impl] = row
            try:
                fn = build_impl(impl, device, args.temperature, entropy)
                call = make_call(fn, hidden, weight, ids, grad, mode)
                out = call()  # compiles / warms up, and is checked before any timing
            except Skip as e:
                row["note"] = f"skipped: {e}"
                continue
            except Exception as e:  # noqa: BLE001 - one failing impl must not end the run
                row["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                continue
            row["lp_err"], row["grad_err"], ent_err = errors(out, gold, mode)
            if ent_err is not None:
                row["ent_err"] = ent_err
            del out
            bad_ent = ent_err is not None and ent_err > ref_ent + slack
            if row["lp_err"] > ref_lp + slack or row["grad_err"] > ref_grad + slack or bad_ent:
                allowed = f"{ref_lp:.2g} / {ref_grad:.2g} + {slack:g}"
                if ent_err is not None:
                    allowed += f", entropy {ref_ent:.2g} + {slack:g}"
                row["note"] = f"MISMATCH vs float64 (allowed: {allowed}), not timed"
                continue
            calls[impl] = call
        del gold
        # all checked impls timed together, round-robin, so load drift hits them alike
        timings = (
            measure_interleaved(calls, warmup=args.warmup, repeats=args.repeats, device=device)
            if calls
            else {}
        )
        for impl, t in timings.items():
            timed[(mode, impl)] = t
            mode_rows[impl].update(
                median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, peak_mib=t.peak_mem_mib
            )
            print(
                f"  {label} {mode:15s} {impl:8s} {t.median_ms:10.2f} ms {t.peak_mem_mib:9.1f} MiB",
                flush=True,
            )
        del calls
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    medians = {key: t.median_ms for key, t in timed.items()}
    rows += derived_rows(medians, args.impls, label, str(dtype).split(".")[-1])
    naive = {r["mode"]: r for r in rows if r["impl"] == "naive" and r.get("median_ms")}
    for row in rows:
        ms = row.get("median_ms")
        if not ms or ms <= 0:
            continue
        flops = counted_flops(row["mode"], n_tok, c, v)
        moved = counted_bytes(row["mode"], n_tok, c, v, size)
        row["tok_per_s"] = n_tok / (ms * 1e-3)
        row["tflops"] = flops / (ms * 1e-3) / 1e12
        row["gb_per_s"] = moved / (ms * 1e-3) / 1e9
        # a ceiling beaten here is raised to what was achieved: the column stays <= 100
        ceilings["tflops"] = max(ceilings["tflops"], row["tflops"])
        ceilings["gb_per_s"] = max(ceilings["gb_per_s"], row["gb_per_s"])
        base = naive.get(row["mode"])
        if base is not None and row.get("peak_mib") is not None:
            row["x_naive_time"] = ms / base["median_ms"]
            row["x_naive_mem"] = row["peak_mib"] / base["peak_mib"]
    return rows


def derived_rows(medians: dict, impls, label: str, dtype: str) -> list[dict]:
    """The derived modes' rows (`DERIVED`: bwd = fwd_bwd - fwd) of each impl timed in both,
    from `medians` {(mode, impl): median ms}; a difference <= 0 (noise larger than the
    backward) is kept with a note saying so, and gets no throughput."""
    rows = []
    for mode, (a, b) in DERIVED.items():
        for impl in impls:
            if (a, impl) not in medians or (b, impl) not in medians:
                continue
            ms = medians[(a, impl)] - medians[(b, impl)]
            note = f"derived: {a} - {b}"
            if ms <= 0:
                note += (
                    f" is negative ({a} timed faster than {b}): noise larger than the "
                    "backward's cost; rerun with more --repeats"
                )
            rows.append(
                {
                    "shape": label,
                    "dtype": dtype,
                    "mode": mode,
                    "impl": impl,
                    "median_ms": ms,
                    "note": note,
                }
            )
    return rows


def roofline(rows, ceilings) -> None:
    """pct_roofline of every timed row, against the (final) ceilings."""
    for row in rows:
        ms = row.get("median_ms")
        if ms and ms > 0 and "tflops" in row:
            floor_ms = max(
                row["tflops"] / ceilings["tflops"], row["gb_per_s"] / ceilings["gb_per_s"]
            )
            row["pct_roofline"] = 100 * floor_ms


def parse_args(argv=None, prog: str = "grpo bench logprobs") -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bf16 GPU, fp32 CPU)")
    p.add_argument("--shapes", default=None, help="comma list of NxCxV, e.g. 4096x1024x151936")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list from {IMPLS}")
    p.add_argument(
        "--impl",
        action="append",
        default=[],
        metavar="IMPL",
        help="also time this kernel: package.module:function (or a name given to "
        "grpo_kernels.register_logprob_impl); repeatable",
    )
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
    for extra in args.impl:  # checked now: a path that does not import is one line, exit 2
        try:
            grpo_kernels.get_logprob_impl(extra)
        except ValueError as e:
            p.error(f"--impl: {e}")
        if extra not in args.impls:
            args.impls.append(extra)
    args.modes = comma_list(p, "--modes", args.modes, MODES)
    if args.warmup is None:
        args.warmup = 2 if cuda else 0
    if args.repeats is None:
        args.repeats = 3 if (args.quick or not cuda) else 10
    args.name = args.name or f"logprobs_{'cuda' if cuda else 'cpu'}_{args.dtype}"
    return args


def kernel_record(spec: str) -> dict:
    """What the results file records of an outside kernel (`--impl`): its function
    (``module:qualname``), source file and that file's sha256 (16 hex digits; None when the
    function has no source file)."""
    fn = grpo_kernels.get_logprob_impl(spec)
    fn = getattr(fn, "func", fn)  # a functools.partial
    record = {"function": f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', '?')}"}
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:  # a builtin or a C extension's function
        path = None
    record["file"] = path
    record["sha256"] = None
    if path and os.path.isfile(path):
        with open(path, "rb") as f:
            record["sha256"] = hashlib.sha256(f.read()).hexdigest()[:16]
    return record


def stored_command(prog: str, argv: list[str]) -> str:
    """The command that reproduces the run: `prog` and its arguments, after
    ``TRITON_INTERPRET=<value>`` when that variable is set (interpreted Triton kernels)."""
    interpret = os.environ.get("TRITON_INTERPRET")
    prefix = f"TRITON_INTERPRET={shlex.quote(interpret)} " if interpret is not None else ""
    return f"{prefix}{prog} {shlex.join(argv)}".rstrip()


def main(argv=None, prog: str = "grpo bench logprobs") -> None:
    """Run the benchmark (module docstring); `prog`: how it was invoked, for the stored
    command."""
    args = parse_args(argv, prog)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    flops = matmul_ceiling_tflops(device, dtype, size=512 if args.quick else None)
    bandwidth = copy_bandwidth_gbps(device, mib=64 if args.quick else 256)
    print(
        f"measured {args.dtype} matmul ceiling: {flops:.2f} TFLOP/s, copy bandwidth "
        f"{bandwidth:.1f} GB/s",
        flush=True,
    )
    ceilings = {"tflops": flops, "gb_per_s": bandwidth}
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args, device, dtype, ceilings)
    roofline(rows, ceilings)
    argv = sys.argv[1:] if argv is None else list(argv)
    meta = {
        "command": stored_command(prog, argv),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "outside_kernels": {spec: kernel_record(spec) for spec in args.impl},
        "dtype": args.dtype,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "matmul_ceiling_tflops": round(flops, 3),
        "copy_bandwidth_gb_per_s": round(bandwidth, 1),
        "roofline_ceilings": {k: round(v, 3) for k, v in ceilings.items()},
        "ceilings_raised": [
            k for k, v in (("tflops", flops), ("gb_per_s", bandwidth)) if ceilings[k] > v
        ],  # an implementation beat the measured one
        "counted": "flops 2NCV fwd, 6NCV fwd_bwd and fwd_bwd_entropy, 4NCV fwd_bwd_frozen and "
        "bwd; bytes: fwd (NC+VC)s+12N, fwd_bwd 2(NC+VC)s+16N, fwd_bwd_entropy 2(NC+VC)s+20N, "
        "fwd_bwd_frozen (2NC+VC)s+16N, bwd fwd_bwd's - fwd's; bwd's time = fwd_bwd's - fwd's",
        "gate": "float64 torch (chunked on float64 operands): error <= the same-dtype chunked "
        "torch reference's + grpo.testing.kernels.SLACK[dtype] (gradients relative)",
    }
    write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    main()
