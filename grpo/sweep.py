"""`grpo sweep`: hyper-parameter search over a training config, one run directory per trial.

    grpo sweep --config configs/tiny_ci.yaml --space space.yaml --method grid --metric eval/accuracy

The space YAML maps dotted config keys to the values to try:

    optim.lr: [1.0e-3, 3.0e-4]                       # a list: grid axis / random or optuna choice
    loss.beta: {low: 0.0, high: 0.1}                 # a range (random, optuna): uniform ...
    optim.lr: {low: 1.0e-6, high: 1.0e-4, log: true} # ... log-uniform ...
    lora.rank: {low: 4, high: 32, type: int}         # ... or integers

Trial i trains in OUT/trial_XXX (its train.output_dir) and writes OUT/trial_XXX/trial.json when
it finishes; a rerun skips finished trials (same parameters) and reruns failed or interrupted
ones. All trials, sorted by the metric, go to stdout and OUT/sweep_results.json / sweep_table.md.
`--method optuna` (TPE) needs the optional `optuna` package, imported only then.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo.config import ConfigError, load_config
from grpo.errors import GrpoError

log = logging.getLogger(__name__)

METHODS = ("grid", "random", "optuna")
TRIAL_FILE = "trial.json"


@dataclass(frozen=True)
class Range:
    """A continuous (or integer) range of one hyper-parameter."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    def sample(self, rng: random.Random) -> float | int:
        if self.integer:
            return rng.randint(int(self.low), int(self.high))
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)


Space = dict[str, list | Range]


def load_space(path: str | Path) -> Space:
    """Read and check a search-space YAML (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise GrpoError(f"--space: file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise GrpoError(f"--space: {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict) or not data:
        raise GrpoError(f"--space: {str(p)!r} must map dotted config keys to values")
    space: Space = {}
    for key, value in data.items():
        if isinstance(value, list):
            if not value:
                raise GrpoError(f"space {key}: the list of values is empty")
            space[str(key)] = value
        elif isinstance(value, dict):
            space[str(key)] = _range(str(key), value)
        else:
            raise GrpoError(
                f"space {key}: expected a list of values or {{low, high}}, got {value!r}"
            )
    return space


def _range(key: str, spec: dict) -> Range:
    extra = sorted(set(spec) - {"low", "high", "log", "type"})
    if extra:
        raise GrpoError(f"space {key}: unknown field {extra[0]!r} (low, high, log, type)")
    try:
        low, high = float(spec["low"]), float(spec["high"])
    except (KeyError, TypeError, ValueError):
        raise GrpoError(f"space {key}: needs numeric low and high, got {spec!r}") from None
    kind = spec.get("type", "float")
    if kind not in ("float", "int"):
        raise GrpoError(f"space {key}: type must be float or int, got {kind!r}")
    log_scale = spec.get("log", False)
    if not isinstance(log_scale, bool):
        raise GrpoError(f"space {key}: log must be true or false")
    if not low <= high:
        raise GrpoError(f"space {key}: low {low} > high {high}")
    if log_scale and low <= 0:
        raise GrpoError(f"space {key}: a log range needs low > 0, got {low}")
    return Range(low, high, log_scale, kind == "int")


def grid_trials(space: Space) -> list[dict]:
    """Every combination, in the space's key order (the last key varies fastest)."""
    for key, values in space.items():
        if isinstance(values, Range):
            raise GrpoError(f"space {key}: --method grid needs a list of values, not a range")
    keys = list(space)
    return [dict(zip(keys, combo)) for combo in itertools.product(*space.values())]


def random_trials(space: Space, n: int, seed: int) -> list[dict]:
    """`n` independent draws (lists: uniform choice; ranges: see `Range.sample`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(
            {k: v.sample(rng) if isinstance(v, Range) else rng.choice(v) for k, v in space.items()}
        )
    return out


def _override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"  # JSON is YAML: the override parser reads it back


@dataclass(frozen=True)
class SweepSetup:
    """What every trial shares."""

    config: str
    overrides: tuple[str, ...]
    out_dir: Path
    metric: str
    mode: str  # max | min
    trainer: str  # grpo | sft

    def trial_config(self, params: dict, trial_dir: Path):
        items = [*self.overrides, *(_override(k, v) for k, v in params.items())]
        items.append(_override("train.output_dir", str(trial_dir)))
        try:
            return load_config(self.config, items)
        except ConfigError as e:
            raise GrpoError(f"trial {params}: {e}") from None


def run_trial(setup: SweepSetup, index: int, params: dict) -> dict:
    """Train one trial in OUT/trial_XXX (or return its record if it already finished)."""
    trial_dir = setup.out_dir / f"trial_{index:03d}"
    record_path = trial_dir / TRIAL_FILE
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record.get("params") != json.loads(json.dumps(params)):
            raise GrpoError(
                f"{trial_dir} was run with other parameters ({record.get('params')}); "
                "use a new --out for a changed space, method or seed"
            )
        if record.get("status") == "done":
            log.info("trial %03d: done before, skipped", index)
            record["metric"] = record.get("metrics", {}).get(setup.metric)  # --metric may differ
            return record
    cfg = setup.trial_config(params, trial_dir)
    shutil.rmtree(trial_dir, ignore_errors=True)  # a failed or interrupted earlier attempt
    trial_dir.mkdir(parents=True)
    log.info("trial %03d: %s", index, params)
    record: dict[str, Any] = {"trial": index, "name": trial_dir.name, "params": params}
    t0 = time.perf_counter()
    try:
        if setup.trainer == "sft":
            from grpo.train.sft import train_sft

            summary = train_sft(cfg)
        else:
            from grpo.train.grpo import train_grpo

            summary = train_grpo(cfg)
    except Exception as e:  # one bad trial (e.g. a diverging lr) does not end the sweep
        log.warning("trial %03d failed: %s", index, e)
        log.debug("trial %03d failed", index, exc_info=True)
        record.update(status="failed", error=f"{type(e).__name__}: {e}")
    else:
        metrics = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
        record.update(status="done", metric=metrics.get(setup.metric), metrics=metrics)
        record["output_dir"], record["final"] = summary["output_dir"], summary["final"]
    record["seconds"] = round(time.perf_counter() - t0, 3)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def _sort_key(record: dict, mode: str):
    value = record.get("metric")
    if record.get("status") != "done":
        return (2, 0.0)
    if not isinstance(value, (int, float)) or math.isnan(value):
        return (1, 0.0)
    return (0, -value if mode == "max" else value)


def sweep_table(records: list[dict], keys: list[str], metric: str, mode: str) -> str:
    """A Markdown table of the trials, best first."""
    head = ["rank", "trial", *keys, metric, "status", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    ordered = sorted(records, key=lambda r: _sort_key(r, mode))
    for rank, r in enumerate(ordered, start=1):
        value = r.get("metric")
        cells = [
            str(rank), r["name"], *(_fmt(r["params"].get(k)) for k in keys),
            _fmt(value) if value is not None else "-", r.get("status", "?"),
            f"{r.get('seconds', 0):.1f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def run_sweep(
    config: str,
    space: Space,
    method: str = "grid",
    trials: int | None = None,
    metric: str = "eval/accuracy",
    mode: str = "max",
    out_dir: str | Path = "runs/sweep",
    overrides: list[str] | None = None,
    trainer: str = "grpo",
    seed: int = 0,
) -> list[dict]:
    """Run (or resume) a sweep; returns one record per trial, in trial order.

    Args:
        config: the training config every trial starts from.
        space: from `load_space`.
        method: grid (all combinations, or the first `trials`), random (`trials` draws,
            default 10), optuna (TPE, `trials` default 10).
        trials: number of trials (see `method`).
        metric: a key of the trainer's final metrics (e.g. eval/accuracy, train/loss).
        mode: max or min: which end of the metric is best.
        out_dir: the sweep directory (trial_XXX subdirectories).
        overrides: dotted overrides applied to every trial before its parameters.
        trainer: grpo or sft.
        seed: seeds random and optuna sampling.
    """
    if method not in METHODS:
        raise GrpoError(f"--method must be one of {list(METHODS)}, got {method!r}")
    if mode not in ("max", "min"):
        raise GrpoError(f"--mode must be max or min, got {mode!r}")
    if trainer not in ("grpo", "sft"):
        raise GrpoError(f"--trainer must be grpo or sft, got {trainer!r}")
    if trials is not None and trials < 1:
        raise GrpoError(f"--trials must be >= 1, got {trials}")
    out = Path(out_dir)
    setup = SweepSetup(config, tuple(overrides or []), out, metric, mode, trainer)
    keys = list(space)
    if method == "grid":
        plan = grid_trials(space)[:trials]
    elif method == "random":
        plan = random_trials(space, trials or 10, seed)
    else:
        plan = None
    if plan is not None:
        for i, params in enumerate(plan):  # every trial's config is valid before any runs
            setup.trial_config(params, out / f"trial_{i:03d}")
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []

    def save() -> None:
        summary = {"config": config, "method": method, "metric": metric, "mode": mode,
                   "space": {k: v if isinstance(v, list) else vars(v) for k, v in space.items()},
                   "trials": records}  # fmt: skip
        (out / "sweep_results.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "sweep_table.md").write_text(sweep_table(records, keys, metric, mode) + "\n")

    if plan is None:
        _run_optuna(setup, space, trials or 10, seed, records, save)
    else:
        for i, params in enumerate(plan):
            records.append(run_trial(setup, i, params))
            save()
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        raise GrpoError(f"every trial failed; see the errors in {out}/trial_*/{TRIAL_FILE}")
    if all(r.get("metric") is None for r in done):
        have = sorted(done[0].get("metrics", {}))
        raise GrpoError(f"--metric {metric!r} is not in the trials' metrics; have: {have}")
    return records


def _run_optuna(setup: SweepSetup, space: Space, n: int, seed: int, records: list, save) -> None:
    """TPE over the space with optuna's ask/tell API; finished trials are told, not rerun."""
    try:
        import optuna
    except ImportError:
        raise GrpoError("--method optuna needs the optuna package (pip install optuna)") from None
    dists = {}
    for key, v in space.items():
        if isinstance(v, Range) and v.integer:
            dists[key] = optuna.distributions.IntDistribution(int(v.low), int(v.high), log=v.log)
        elif isinstance(v, Range):
            dists[key] = optuna.distributions.FloatDistribution(v.low, v.high, log=v.log)
        else:
            dists[key] = optuna.distributions.CategoricalDistribution(v)
    direction = "maximize" if setup.mode == "max" else "minimize"
    study = optuna.create_study(direction=direction, sampler=optuna.samplers.TPESampler(seed=seed))
    for i in range(n):
        path = setup.out_dir / f"trial_{i:03d}" / TRIAL_FILE
        old = json.loads(path.read_text()) if path.is_file() else None
        if old and old.get("status") == "done":
            old["metric"] = old.get("metrics", {}).get(setup.metric)
        if old and old.get("status") == "done" and old.get("metric") is not None:
            study.add_trial(
                optuna.trial.create_trial(params=old["params"], distributions=dists,
                                          value=old["metric"])
            )  # fmt: skip
            records.append(old)
            save()
            continue
        if old:  # failed or without a metric: its record goes, a new draw takes its place
            path.unlink()
        trial = study.ask(dists)
        record = run_trial(setup, i, trial.params)
        records.append(record)
        save()
        if record.get("status") == "done" and record.get("metric") is not None:
            study.tell(trial, record["metric"])
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)


# --------------------------------------------------------------------------- CLI


def cmd_sweep(args) -> int:
    """`grpo sweep`: run or resume the trials, print the table sorted by the metric."""
    mode = args.mode or ("min" if "loss" in args.metric else "max")
    space = load_space(args.space)
    out = args.out or f"runs/sweep-{Path(args.config).stem}"
    records = run_sweep(
        args.config, space, method=args.method, trials=args.trials, metric=args.metric,
        mode=mode, out_dir=out, overrides=args.overrides, trainer=args.trainer, seed=args.seed,
    )  # fmt: skip
    print(sweep_table(records, list(space), args.metric, mode))
    best = sorted(records, key=lambda r: _sort_key(r, mode))[0]
    print(f"best: {best['name']} ({args.metric} = {_fmt(best.get('metric'))}): {best['params']}")
    print(f"results in {Path(out) / 'sweep_results.json'}")
    return 0


def add_parser(subparsers) -> None:
    """Add `grpo sweep` to the CLI's subparsers."""
    p = subparsers.add_parser("sweep", help="hyper-parameter search (grid, random, optuna)")
    p.add_argument("--config", required=True, help="the training config every trial starts from")
    p.add_argument("--space", required=True, help="YAML: dotted key -> [values] or {low, high}")
    p.add_argument("--method", default="grid", choices=METHODS)
    p.add_argument("--trials", type=int, default=None, help="trials (random/optuna default 10)")
    p.add_argument("--metric", default="eval/accuracy", help="final metric to sort by")
    p.add_argument("--mode", choices=("max", "min"), default=None,
                   help="best end of the metric (default: min for losses, else max)")  # fmt: skip
    p.add_argument("--out", default=None, help="sweep directory (default runs/sweep-CONFIG)")
    p.add_argument("--trainer", default="grpo", choices=("grpo", "sft"))
    p.add_argument("--seed", type=int, default=0, help="seed of random / optuna sampling")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every trial")
    p.set_defaults(func=cmd_sweep)
