"""Per-rank memory and step time of full fine-tuning, DDP vs FSDP2, at 1, 2 and 4 CPU ranks.

    python -m benchmarks.bench_fsdp                          # about 3 minutes on 2 cores
    python -m benchmarks.bench_fsdp --ranks 1,2 --repeats 3  # quicker

For each (parallel, ranks) the benchmark launches the ranks itself (`torch.distributed.run
--standalone`, gloo, OMP_NUM_THREADS=1 per rank) running this file's worker mode; each rank
writes its numbers to a JSON file that the launcher reads back. A worker builds the same
random-init Qwen3-shaped `Decoder` on every rank (about 34M parameters, float32), wraps it
the way `grpo train` does (`grpo.distributed.wrap_ddp`, or `grpo.distributed.shard_model`:
each block a unit, then the root), and trains every weight with AdamW
(`grpo.run.optim.build_optimizer`) on a fixed batch through `CompletionLogprobs`.

Memory is counted exactly, not sampled: per rank, the sum of numel * element_size of the
tensors it holds (a DTensor shard counts its `.to_local()`): parameters, gradients after a
backward, AdamW's states after one `optimizer.step()`; the table shows the largest rank.
DDP's all-reduce buckets (another gradient's worth with the default
gradient_as_bucket_view=False) and FSDP's transient per-block gathers are not in these
totals; two resident-memory columns see them: `step_peak_mib`, the RSS a step adds at its
peak (the harness's measure), and `rss_mib`, the process's whole RSS at the peak of a step
(torch runtime, kept state, buckets, activations, gathers, allocator slack). On glibc the
RSS columns depend on the allocator: freed buffers under its dynamic mmap threshold (up to
32 MiB: FSDP's per-block gathers) stay in the heap; `MALLOC_MMAP_THRESHOLD_=65536` returns
them at once (the meta line `malloc` says which was used).
Time: the median over `--repeats` steps (forward + backward + gradient clipping + AdamW
step) after `--warmup`, slowest rank; `gather_ms` is one `full_weights(model)` enter + exit,
the gather every rollout, evaluation and final save pays under FSDP.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import add_output_args, comma_list, measure, write_results
from grpo.algo.logprobs import CompletionLogprobs
from grpo.config import OptimConfig
from grpo.distributed import (
    clip_grad_norm,
    full_weights,
    init_distributed,
    reshard,
    shard_model,
    teardown,
    wrap_ddp,
)
from grpo.models import Decoder, ModelConfig
from grpo.run.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
PARALLEL = ("ddp", "fsdp")
COLUMNS = [
    "parallel",
    "ranks",
    "params_mib",
    "grads_mib",
    "optim_mib",
    "total_mib",
    "ratio",
    "target",
    "met",
    "step_ms",
    "step_ratio",
    "gather_ms",
    "step_peak_mib",
    "rss_mib",
]
_MIB = 2**20


def model_config(args) -> ModelConfig:
    """Qwen3-shaped, tied embeddings: with the defaults 8 blocks of 3.15M parameters plus a
    16384 x 512 embedding, 33.6M parameters (134 MB in float32)."""
    return ModelConfig(
        family="qwen3",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        qk_norm=True,
    )


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def peak_rss_mib() -> float | None:
    """The process's resident-set high-water mark (VmHWM), in MiB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def optimizer_tensors(opt: torch.optim.Optimizer):
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def worker(args) -> None:
    """One rank: measure, write rank<r>.json, leave the group."""
    dist = init_distributed("cpu", timeout_s=args.timeout)
    out = measure_rank(args, dist)
    Path(args.worker_out, f"rank{dist.rank}.json").write_text(json.dumps(out) + "\n")
    teardown()  # after measure_rank returned: its DDP wrapper is gone (grpo.distributed)


def measure_rank(args, dist) -> dict:
    """Build, wrap, count the bytes, time the step and the gather."""
    model = Decoder(model_config(args))
    model.init_weights(std=0.02, seed=0)  # the same weights on every rank
    sharded = args.parallel == "fsdp" and dist.enabled  # one process trains unsharded
    if sharded:
        shard_model(model, dist)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, OptimConfig(lr=1e-5))
    scorer = wrap_ddp(CompletionLogprobs(model), dist, torch.device("cpu"))  # FSDP: as is
    gen = torch.Generator().manual_seed(1 + dist.rank)  # each rank its own rows
    B, T_p, T_c = args.batch, args.prompt_len, args.completion_len
    ids = torch.randint(0, args.vocab, (B, T_p + T_c), generator=gen)  # (B, T)
    attention_mask = torch.ones(B, T_p + T_c, dtype=torch.bool)  # (B, T)
    completion_mask = torch.ones(B, T_c, dtype=torch.bool)  # (B, T_c)

    def backward():
        logprobs = scorer(ids, attention_mask, T_p, completion_mask)  # (B, T_c)
        (-logprobs.mean()).backward()

    def update():
        clip_grad_norm(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    backward()
    reshard(model)  # the shards, not a gathered copy, are the parameters now
    params_bytes, grads_bytes = local_bytes(params), local_bytes(p.grad for p in params)
    update()
    optim_bytes = local_bytes(optimizer_tensors(opt))

    def step():
        backward()
        update()

    def gather():
        with full_weights(model):
            pass

    t_step = measure(step, warmup=args.warmup, repeats=args.repeats)
    rss_mib = peak_rss_mib()  # the last timed step's peak (measure resets the mark per repeat)
    t_gather = measure(gather, warmup=1, repeats=args.repeats) if sharded else None
    return {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "sharded": sharded,
        "num_params": sum(p.numel() for p in model.parameters()) if not sharded else None,
        "params_bytes": params_bytes,
        "grads_bytes": grads_bytes,
        "optim_bytes": optim_bytes,
        "step_ms": t_step.median_ms,
        "step_p20_ms": t_step.p20_ms,
        "step_p80_ms": t_step.p80_ms,
        "step_peak_mib": t_step.peak_mem_mib,
        "rss_mib": rss_mib,
        "gather_ms": t_gather.median_ms if t_gather else None,
        "gather_p20_ms": t_gather.p20_ms if t_gather else None,
        "gather_p80_ms": t_gather.p80_ms if t_gather else None,
    }


def model_flags(args) -> list[str]:
    names = (
        "hidden",
        "layers",
        "heads",
        "kv_heads",
        "intermediate",
        "vocab",
        "batch",
        "prompt_len",
        "completion_len",
        "warmup",
        "repeats",
        "timeout",
    )
    return [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names]


def launch(parallel: str, ranks: int, args, tmp: Path) -> list[dict]:
    """Run the worker on `ranks` ranks under torchrun; every rank's JSON, rank order."""
    out = tmp / f"{parallel}_{ranks}"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "benchmarks.bench_fsdp",
        "--worker",
        f"--parallel={parallel}",
        f"--worker-out={out}",
        *model_flags(args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        sys.exit(f"bench_fsdp: {parallel} on {ranks} ranks ran past --timeout={args.timeout} s")
    if r.returncode != 0:
        sys.exit(f"bench_fsdp: {parallel} on {ranks} ranks failed:\n{r.stderr[-3000:]}")
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(ranks)]


def row(parallel: str, ranks: int, per_rank: list[dict], ddp: dict | None) -> dict:
    """The table row: bytes and times of the worst rank, ratios against `ddp` (the DDP row at
    `ranks`; None for that row itself)."""
    mib = {k: max(r[f"{k}_bytes"] for r in per_rank) / _MIB for k in ("params", "grads", "optim")}
    total = max(sum(r[f"{k}_bytes"] for k in ("params", "grads", "optim")) for r in per_rank)
    gathers = [r["gather_ms"] for r in per_rank if r["gather_ms"] is not None]
    out = {
        "parallel": parallel,
        "ranks": ranks,
        "sharded": per_rank[0]["sharded"],
        "params_mib": mib["params"],
        "grads_mib": mib["grads"],
        "optim_mib": mib["optim"],
        "total_mib": total / _MIB,
        "step_ms": max(r["step_ms"] for r in per_rank),
        "step_p20_ms": max(r["step_p20_ms"] for r in per_rank),
        "step_p80_ms": max(r["step_p80_ms"] for r in per_rank),
        "step_peak_mib": max(r["step_peak_mib"] for r in per_rank),
        "rss_mib": max((r["rss_mib"] or 0.0) for r in per_rank) or None,
        "gather_ms": max(gathers) if gathers else None,
        "per_rank": per_rank,
    }
    ddp = ddp or out  # the DDP row is its own baseline
    out["ratio"] = out["total_mib"] / ddp["total_mib"]
    out["step_ratio"] = out["step_ms"] / ddp["step_ms"]
    if parallel == "fsdp" and ranks > 1:  # one rank: both unsharded, no target
        out["target"] = 1.05 / ranks
        out["met"] = "yes" if out["ratio"] <= out["target"] else "no"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="comma list of world sizes")
    p.add_argument("--parallel", default="ddp,fsdp", help="comma list of ddp, fsdp")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2, help="rows per rank")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    add_output_args(p, "fsdp_cpu")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    modes = [m for m in PARALLEL if m in comma_list(p, "--parallel", args.parallel, PARALLEL)]
    if "ddp" not in modes:
        p.error("--parallel: ddp is the baseline every ratio is taken against")
    world_sizes = [int(n) for n in args.ranks.split(",") if n]
    cfg = model_config(args)
    meta = {
        "command": " ".join(["python -m benchmarks.bench_fsdp", *sys.argv[1:]]),
        "model": f"random-init qwen3 L={cfg.num_hidden_layers} C={cfg.hidden_size} "
        f"H={cfg.num_attention_heads} H_kv={cfg.num_key_value_heads} "
        f"I={cfg.intermediate_size} V={cfg.vocab_size}, tied embeddings, float32, "
        "full fine-tuning, AdamW",
        "batch": f"B={args.batch} rows per rank, T_p={args.prompt_len}, T_c={args.completion_len}",
        "memory": "exact per-rank bytes of parameters, gradients (after backward) and AdamW "
        "states (after one step); a DTensor counts its local shard; the largest rank is shown. "
        "DDP's all-reduce buckets and FSDP's transient block gathers are not counted; "
        "step_peak_mib (the RSS a step adds at its peak) and rss_mib (the process's whole RSS "
        "at the peak of a step, runtime included) see them",
        "ratio": "total / DDP total at the same ranks; target = 1.05 / ranks "
        "(1/N of DDP's, plus 5%)",
        "one rank": "DDP and FSDP are both unsharded (one process trains unsharded): the same "
        "numbers, no target, no gather",
        "time": f"median of {args.repeats} steps after {args.warmup} warm-up "
        "(forward + backward + clip + AdamW step), slowest rank; gather_ms is one "
        "full_weights enter + exit (what every rollout pays under FSDP)",
        "malloc": "MALLOC_MMAP_THRESHOLD_=" + os.environ["MALLOC_MMAP_THRESHOLD_"]
        if "MALLOC_MMAP_THRESHOLD_" in os.environ
        else "glibc's default (a dynamic mmap "
        "threshold: freed buffers under 32 MiB stay in the heap and count in the RSS columns)",
        "cpu": f"gloo, OMP_NUM_THREADS=1 per rank, {os.cpu_count()} cores: "
        + (
            "4 ranks oversubscribe the CPU, so their times are slow and noisy; the memory "
            "numbers are exact regardless"
            if max(world_sizes) > (os.cpu_count() or 1)
            else "one core per rank"
        ),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in world_sizes:
            ddp = None
            for parallel in modes:
                print(f"bench_fsdp: {parallel} on {ranks} rank(s)", file=sys.stderr, flush=True)
                r = row(parallel, ranks, launch(parallel, ranks, args, Path(tmp)), ddp)
                ddp = ddp or r
                rows.append(r)
                meta["num_params"] = rows[0]["per_rank"][0]["num_params"]
                write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    main()
