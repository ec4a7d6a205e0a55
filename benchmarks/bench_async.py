"""Synchronous vs asynchronous GRPO, as a user runs it: `grpo train` with a config, N steps.

    python -m benchmarks.bench_async                      # about 4 minutes on 2 cores
    python -m benchmarks.bench_async --steps 8 --repeats 1 --placements colocated
    python -m benchmarks.bench_async --name async_cpu_long rollout.max_new_tokens=64

Two placements, each measured side by side with its synchronous twin, runs interleaved
(`--repeats` rounds of every mode, so a slow moment of the machine hits all modes alike):

- colocated: one process (`python -m grpo train`), rollout.async off vs on (a producer
  thread on a copy of the policy; rollout.max_staleness = --staleness);
- disaggregated: `torchrun --nproc_per_node=2`: 2 synchronous DDP ranks vs 1 trainer rank +
  1 producer rank (rollout.ranks=1), one thread per rank (torchrun's OMP_NUM_THREADS=1).

Every run is a fresh process: model load, compile warm-up and the first step are in `wall_s`
and `first_step_s`; `steady_s` sums the logged `perf/step_s` of steps 2..N (the time the
trainer spent per step: with asynchronous rollouts the rollout part of it is its wait for the
producer). From metrics.jsonl: the synchronous step's rollout share (`perf/rollout_s` over
`perf/step_s`, what overlap could hide at most) and, for asynchronous runs, the mean time the
trainer waited for a batch and the producer waited for weights. `ratio` is the run's
steady-state time over its synchronous twin's (below 1: faster).

The model is the quickstart's tiny random-init Qwen3 (`grpo tiny-model`, built into a
temporary directory unless --model is given); --config and overrides choose the workload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import add_output_args, write_results

REPO = Path(__file__).resolve().parents[1]
COLUMNS = [
    "placement",
    "mode",
    "ranks",
    "wall_s",
    "first_step_s",
    "steady_s",
    "ratio",
    "median_step_s",
    "rollout_share",
    "trainer_wait_s",
    "producer_wait_s",
    "staleness_max",
]


def modes(placement: str, k: int) -> dict[str, tuple[int, list[str]]]:
    """mode -> (processes, overrides)."""
    if placement == "colocated":
        asynchronous = ["rollout.async=on", f"rollout.max_staleness={k}"]
        return {"sync": (1, []), f"async k={k}": (1, asynchronous)}
    return {
        "sync DDP": (2, []),
        f"async 1+1 k={k}": (
            2,
            ["rollout.async=on", f"rollout.max_staleness={k}", "rollout.ranks=1"],
        ),
    }


def run_once(n: int, config: str, model: Path, steps: int, extra: list[str], out: Path) -> dict:
    cmd = (
        [sys.executable, "-m", "grpo"]
        if n == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            "-m",
            "grpo",
        ]
    )
    cmd += [
        "train",
        "--config",
        config,
        f"model.path={model}",
        f"train.output_dir={out}",
        f"train.max_steps={steps}",
        "train.progress=false",
        "train.save_every=0",
        "train.log_every=1",
        *extra,
        "--overwrite",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if n > 1 else dict(os.environ)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "perf/step_s" in x]
    step = [x["perf/step_s"] for x in rows]
    share = [x["perf/rollout_s"] / x["perf/step_s"] for x in rows[1:]]

    def mean(key):
        vals = [x[key] for x in rows[1:] if key in x]
        return statistics.fmean(vals) if vals else None

    return {
        "wall_s": wall,
        "first_step_s": step[0],
        "steady_s": sum(step[1:]),
        "median_step_s": statistics.median(step[1:]),
        "rollout_share": statistics.fmean(share),
        "trainer_wait_s": mean("async/trainer_wait_s"),
        "producer_wait_s": mean("async/producer_wait_s"),
        "staleness_max": max(x.get("async/staleness", 0) for x in rows),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    p.add_argument("--model", default=None, help="default: a fresh `grpo tiny-model`")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--placements", default="colocated,disaggregated")
    p.add_argument("overrides", nargs="*", help="config overrides for every run, a.b=c")
    add_output_args(p, "async_cpu")
    args = p.parse_args(argv)
    placements = [x for x in args.placements.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        tmp = Path(tmp)
        model = Path(args.model) if args.model else tmp / "model"
        if not args.model:
            subprocess.run(
                [sys.executable, "-m", "grpo", "tiny-model", "--out", str(model)],
                check=True,
                capture_output=True,
            )
        results: dict[tuple[str, str], list[dict]] = {}
        for rep in range(args.repeats):
            for placement in placements:
                for mode, (n, extra) in modes(placement, args.staleness).items():
                    out = tmp / f"{placement}-{mode.replace(' ', '_')}-{rep}"
                    res = run_once(
                        n, args.config, model, args.steps, [*args.overrides, *extra], out
                    )
                    results.setdefault((placement, mode), []).append(res)
                    print(
                        f"{placement} {mode} #{rep}: steady {res['steady_s']:.2f} s, "
                        f"wall {res['wall_s']:.1f} s",
                        flush=True,
                    )
    rows = []
    for placement in placements:
        base = None
        for mode, (n, _) in modes(placement, args.staleness).items():
            runs = results[(placement, mode)]
            row = {"placement": placement, "mode": mode, "ranks": n}
            for key in runs[0]:  # the median run of each number
                vals = [r[key] for r in runs if r[key] is not None]
                row[key] = round(statistics.median(vals), 4) if vals else None
            base = base or row["steady_s"]
            row["ratio"] = round(row["steady_s"] / base, 3)
            rows.append(row)
    write_results(
        args.name,
        rows,
        COLUMNS,
        out_dir=args.out_dir,
        meta={
            "command": " ".join(["python -m benchmarks.bench_async", *(argv or sys.argv[1:])]),
            "config": args.config,
            "overrides": args.overrides,
            "steps": args.steps,
            "staleness": args.staleness,
            "repeats": args.repeats,
            "timing": "steady_s = sum of perf/step_s over steps 2..N; wall_s includes start-up, "
            "compile and the final save; medians over repeats",
        },
    )


if __name__ == "__main__":
    main()
