"""Run one `grpo train` command of the GPU check, then summarize its metrics.jsonl in one row:
step time, peak memory, the sampler-vs-trainer log-prob difference, and how the job trained
(`run/parallel`: "ddp over 1 rank (nccl)" proves the NCCL group and DDP ran).

    python -m benchmarks.gpu_run --name grpo_ddp_gpu --metrics RUN/metrics.jsonl \\
        --accept 1e-4 --parallel "ddp over 1 rank (nccl)" -- torchrun ... -m grpo train ...

Exits with the command's status if it failed, 1 if a number misses its acceptance bound.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics as st
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import write_results
from grpo.metrics import read_metrics


def summarize(recs: list[dict]) -> dict:
    """One row over the run's records (medians over steps 2..N: step 1 compiles)."""
    later = recs[1:] or recs

    def med(k):
        return st.median(r[k] for r in later)

    row = {
        "steps": len(recs),
        "parallel": recs[0].get("run/parallel", "unrecorded"),
        "first_step_s": recs[0]["perf/step_s"],
        "step_s": med("perf/step_s"),
        "rollout_s": med("perf/rollout_s"),
        "logprob_s": med("perf/logprob_s"),
        "update_s": med("perf/update_s"),
        "tokens_per_s": med("perf/tokens_per_s"),
        "peak_mem_mib": max(r["perf/peak_mem_mib"] for r in recs),
        "logprob_diff_max": max(r["rollout/logprob_diff_max"] for r in recs),
        "logprob_diff_mean": st.mean(r["rollout/logprob_diff_mean"] for r in recs),
        "first_pass_ratio_mean": st.mean(r["rollout/first_pass_ratio_mean"] for r in recs),
        "reward_first": recs[0]["rollout/reward_mean"],
        "reward_last": recs[-1]["rollout/reward_mean"],
    }
    for phase in ("rollout", "logprob", "update"):  # per-phase peaks (CUDA: reset per phase)
        key = f"perf/peak_mem_{phase}_mib"
        if key in recs[0]:
            row[f"peak_{phase}_mib"] = max(r[key] for r in recs)
    if "perf/sampler_cache_mib" in recs[0]:
        row["sampler_cache_mib"] = recs[-1]["perf/sampler_cache_mib"]
    return row


def verdict(row: dict, accept: float, parallel: str | None) -> list[str]:
    """What misses its bound, one clause each (empty: the run passes)."""
    bad = []
    if row["logprob_diff_max"] > accept:
        bad.append(f"logprob_diff_max {row['logprob_diff_max']:.3g} > {accept:g}")
    if abs(row["first_pass_ratio_mean"] - 1) > accept:
        bad.append(
            f"|first_pass_ratio_mean - 1| {abs(row['first_pass_ratio_mean'] - 1):.3g} > {accept:g}"
        )
    if parallel is not None and row["parallel"] != parallel:
        bad.append(f"run/parallel is {row['parallel']!r}, expected {parallel!r}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="result name (JSON + Markdown)")
    p.add_argument("--metrics", required=True, type=Path, help="the run's metrics.jsonl")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument(
        "--accept",
        type=float,
        default=1e-4,
        help="bound on the log-prob diff and |ratio - 1|; inf: report",
    )
    p.add_argument("--parallel", default=None, help="the run/parallel the run must record")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the grpo train command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command:
        code = subprocess.run(command).returncode
        if code != 0:
            print(f"{args.name}: the run exited {code}")
            return code
    recs = [r for r in read_metrics(args.metrics) if "perf/step_s" in r or "run/parallel" in r]
    header = {k: v for r in recs if "run/parallel" in r for k, v in r.items()}
    recs = [{**header, **r} for r in recs if "perf/step_s" in r]
    if not recs:
        print(f"{args.name}: no step recorded in {args.metrics}")
        return 1
    shutil.copy(args.metrics, args.out_dir / f"{args.name}_metrics.jsonl")
    row = summarize(recs)
    bad = verdict(row, args.accept, args.parallel)
    meta = {
        "command": shlex.join(command),
        "medians": "over steps 2..N (step 1 compiles)",
        "logprob_diff": "max / mean over steps of the first pass vs the sampler (per token)",
        "acceptance": f"logprob_diff_max <= {args.accept} and |first_pass_ratio_mean - 1| "
        f"<= {args.accept}" + (f"; run/parallel == {args.parallel!r}" if args.parallel else ""),
    }
    write_results(args.name, [row], list(row), out_dir=args.out_dir, meta=meta)
    print(
        f"{args.name}: {row['steps']} steps, {row['parallel']}, median step "
        f"{row['step_s']:.3f} s, peak {row['peak_mem_mib']:.0f} MiB, logprob diff max "
        f"{row['logprob_diff_max']:.2e}: " + ("; ".join(bad) if bad else "ok")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
