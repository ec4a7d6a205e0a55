"""The quickstart's learning curve: the two README commands, once per advantage estimator.

`grpo tiny-model --out WORK/tiny-model`, then for each estimator
`grpo train --config configs/quickstart.yaml model.path=WORK/tiny-model loss.advantage=ADV`,
each timed end to end as a subprocess (start-up, decode-step compile and final save included;
each run gets an empty TORCHINDUCTOR_CACHE_DIR, as on a fresh machine, unless --warm-cache);
the per-step reward mean comes from the run's metrics.jsonl.

    python -m benchmarks.bench_quickstart                         # grpo and rloo, 30 steps
    python -m benchmarks.bench_quickstart --advantages grpo,rloo,dr_grpo --name quickstart_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import add_output_args, comma_list, write_results
from grpo.algo import ADVANTAGES

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/quickstart.yaml"
CHECKPOINTS = (1, 5, 10, 15, 20, 25, 30)  # steps shown in the table (all are in the JSON)


def grpo(*args: str, inductor_cache: Path | None = None) -> float:
    """Run `python -m grpo ARGS` from the repository root; its wall time in seconds.
    `inductor_cache`: emptied and used as TORCHINDUCTOR_CACHE_DIR (a cold compile)."""
    env = dict(os.environ)
    if inductor_cache is not None:
        shutil.rmtree(inductor_cache, ignore_errors=True)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "grpo", *args],
        cwd=REPO,
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def step_records(run_dir: Path) -> list[dict]:
    """The per-step training records of metrics.jsonl (the header record has no reward)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "rollout/reward_mean" in r]


def curve_row(advantage: str, wall_s: float, recs: list[dict]) -> dict:
    """One table row: the reward mean at CHECKPOINTS, the step-1 signal and the lr of step 1."""
    reward = [r["rollout/reward_mean"] for r in recs]
    first = recs[0]
    row = {
        "advantage": advantage,
        "wall_s": round(wall_s, 1),
        "steps": len(recs),
        "step1_reward_std": first["rollout/reward_std"],
        "step1_frac_zero_std": first["rollout/frac_zero_std_groups"],
        "step1_lr": first["train/lr"],
        "first_step_at_0.5": next(
            (r["step"] for r in recs if r["rollout/reward_mean"] >= 0.5), None
        ),
    }
    row.update({f"r@{s}": reward[s - 1] for s in CHECKPOINTS if s <= len(reward)})
    row["reward_mean"] = reward  # the whole curve, JSON only
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--advantages", default="grpo,rloo", help="comma list of loss.advantage")
    p.add_argument("--work", default="runs/bench_quickstart", help="model and run folders")
    p.add_argument("--steps", type=int, default=None, help="train.max_steps (default: config's)")
    p.add_argument(
        "--warm-cache",
        action="store_true",
        help="keep the user's inductor cache (default: a cold compile per run)",
    )
    add_output_args(p, "quickstart_cpu")
    args = p.parse_args(argv)
    advantages = comma_list(p, "--advantages", args.advantages, ADVANTAGES.names())
    work = Path(args.work).resolve()
    model = work / "tiny-model"
    tiny_s = grpo("tiny-model", "--out", str(model))
    rows = []
    for adv in advantages:
        out = work / adv
        extra = [f"train.max_steps={args.steps}"] if args.steps else []
        cache = None if args.warm_cache else work / "inductor-cache"
        wall = grpo(
            "train",
            "--config",
            CONFIG,
            f"model.path={model}",
            f"train.output_dir={out}",
            f"loss.advantage={adv}",
            "train.progress=false",
            "--overwrite",
            *extra,
            inductor_cache=cache,
        )
        rows.append(curve_row(adv, wall, step_records(out)))
    columns = [
        "advantage",
        "wall_s",
        "step1_reward_std",
        "step1_frac_zero_std",
        "step1_lr",
        *[f"r@{s}" for s in CHECKPOINTS],
        "first_step_at_0.5",
    ]
    meta = {
        "command": f"grpo tiny-model --out {model} && grpo train --config {CONFIG} "
        f"model.path={model} loss.advantage=ADV",
        "tiny_model_s": round(tiny_s, 1),
        "load_average_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "threads": os.environ.get("OMP_NUM_THREADS", "torch default"),
        "inductor_cache": "warm (the user's)" if args.warm_cache else "cold (emptied per run)",
        "r@k": "rollout/reward_mean at step k (reward: grpo.tiny:digit_share)",
    }
    write_results(
        args.name, rows, [c for c in columns if c in rows[0]], out_dir=args.out_dir, meta=meta
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
