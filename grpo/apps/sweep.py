"""`grpo sweep`: hyper-parameter search over a training config, one run directory per trial.

    grpo sweep --config configs/tiny_ci.yaml --space space.yaml --method grid --metric eval/accuracy

The space YAML maps dotted config keys to the values to try:

    optim.lr: [1.0e-3, 3.0e-4]                       # a list: grid axis / random or optuna choice
    loss.beta: {low: 0.0, high: 0.1}                 # a range (random, optuna): uniform ...
    optim.lr: {low: 1.0e-6, high: 1.0e-4, log: true} # ... log-uniform ...
    lora.rank: {low: 4, high: 32, type: int}         # ... or integers

Trial i trains in OUT/trial_XXX (its train.output_dir) and writes OUT/trial_XXX/trial.json when
it finishes. OUT must be new or empty; `--resume` continues the sweep in it: finished trials are
kept, failed (grid / random) and interrupted ones run again. All trials, sorted by the metric, go
to stdout and OUT/sweep_results.json / sweep_table.md.

`--method optuna` (the optional `optuna` package, imported only then): TPE draws each trial from
the trials so far; the study lives in OUT/optuna.db (sqlite), so a killed sweep resumes; the
trainer reports the metric at every step where it has one (eval/* every train.eval_every
steps) and the median pruner stops a trial that trails the finished ones at the same step.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.io import read_json, read_text, write_json, write_text
from grpo.settings import ConfigError, between, build_settings, check_value, one_of

log = logging.getLogger(__name__)

METHODS = ("grid", "random", "optuna")
PRUNERS = ("median", "none")
FINISHED = ("done", "pruned", "failed")  # a trial's record statuses
TRIAL_FILE = "trial.json"
STUDY_DB = "optuna.db"  # optuna's sqlite storage, in the sweep directory
STUDY_NAME = "grpo-sweep"


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
        data = yaml.safe_load(read_text(p, "a YAML search space"))
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


@dataclass(frozen=True)
class RangeSpec:
    """A range as written in the space file (`{low, high, log, type}`), parsed and type-checked
    by the config's one builder (`grpo.settings.build_settings`)."""

    low: float
    high: float
    log: bool = False
    type: Literal["float", "int"] = "float"


def _range(key: str, spec: dict) -> Range:
    try:
        r = build_settings(RangeSpec, spec, f"space {key}")
    except ConfigError as e:
        raise GrpoError(str(e)) from None
    if not r.low <= r.high:
        raise GrpoError(f"space {key}: low {r.low} > high {r.high}")
    if r.log and r.low <= 0:
        raise GrpoError(f"space {key}: a log range needs low > 0, got {r.low}")
    return Range(r.low, r.high, r.log, r.type == "int")


# A sweep is a sequence of training runs: more trials than this is a typo, not a plan.
MAX_TRIALS = 10_000


def grid_trials(space: Space, limit: int | None = None) -> list[dict]:
    """The first `limit` combinations (all by default), in the space's key order (the last key
    varies fastest); the grid's size is checked before any combination is built."""
    for key, values in space.items():
        if isinstance(values, Range):
            raise GrpoError(f"space {key}: --method grid needs a list of values, not a range")
    size = math.prod(len(v) for v in space.values())
    if (limit or size) > MAX_TRIALS:
        raise GrpoError(
            f"the grid has {size} combinations; at most {MAX_TRIALS} trials run in "
            "one sweep (pass --trials N to run the first N)"
        )
    keys = list(space)
    combos = itertools.islice(itertools.product(*space.values()), limit)
    return [dict(zip(keys, combo)) for combo in combos]


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
    plugins: tuple[str, ...] = ()  # the CLI's --plugin, added to every trial's config

    def trial_config(self, params: dict, trial_dir: Path):
        from grpo.checks import check_config  # lazy: the registries import torch

        items = [*self.overrides, *(_override(k, v) for k, v in params.items())]
        items.append(_override("train.output_dir", str(trial_dir)))
        try:
            return check_config(load_config(self.config, items, plugins=self.plugins))
        except ConfigError as e:
            raise GrpoError(f"trial {params}: {e}") from None


class _Pruned(Exception):
    """Raised from a trial's step callback when optuna's pruner stops it."""

    def __init__(self, step: int, value: float, metrics: dict):
        super().__init__(f"pruned at step {step}")
        self.step, self.value, self.metrics = step, value, metrics


def _numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def _read_record(path: Path) -> dict:
    record = read_json(path, "a sweep trial record (trial.json)")
    if not isinstance(record, dict):
        raise GrpoError(f"{path}: holds a {type(record).__name__}; expected an object")
    return record


def run_trial(setup: SweepSetup, index: int, params: dict, on_step=None) -> dict:
    """Train one trial in OUT/trial_XXX (or return its record if it already finished).

    Args:
        setup: what every trial shares.
        index: the trial's number (its directory name).
        params: dotted key -> value for this trial.
        on_step: passed to the trainer (called with (step, metrics)); optuna's pruning hook.

    Returns:
        the trial's record (also written to OUT/trial_XXX/trial.json): status done, pruned
        or failed, the metric, the final (or, pruned, the last) numeric metrics, seconds.
    """
    trial_dir = setup.out_dir / f"trial_{index:03d}"
    record_path = trial_dir / TRIAL_FILE
    if record_path.is_file():
        record = _read_record(record_path)
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
    from grpo.run.rundir import TrainingInterrupted

    try:
        if setup.trainer == "sft":
            from grpo.train.sft import train_sft

            summary = train_sft(cfg, on_step=on_step)
        else:
            from grpo.train.grpo import train_grpo

            summary = train_grpo(cfg, on_step=on_step)
    except (KeyboardInterrupt, TrainingInterrupted) as e:  # the sweep stops; a rerun redoes it
        record.update(status="interrupted", error=f"{type(e).__name__}: {e}")
        record["seconds"] = round(time.perf_counter() - t0, 3)
        write_json(record_path, record)
        raise
    except _Pruned as e:
        log.info("trial %03d pruned at step %d (%s = %.4g)", index, e.step, setup.metric, e.value)
        record.update(status="pruned", metric=e.value, metrics=e.metrics, pruned_at=e.step)
    except Exception as e:  # one bad trial (e.g. a diverging lr) does not end the sweep
        log.warning("trial %03d failed: %s", index, e)
        log.debug("trial %03d failed", index, exc_info=True)
        record.update(status="failed", error=f"{type(e).__name__}: {e}")
    else:
        metrics = _numbers(summary)
        record.update(status="done", metric=metrics.get(setup.metric), metrics=metrics)
        record["output_dir"], record["final"] = summary["output_dir"], summary["final"]
    record["seconds"] = round(time.perf_counter() - t0, 3)
    write_json(record_path, record)
    return record


def _sort_key(record: dict, mode: str):
    """done (by the metric) < done without the metric < pruned (by its last value) < failed."""
    value = record.get("metric")
    status = record.get("status")
    if status not in ("done", "pruned"):
        return (3, 0.0)
    if not isinstance(value, (int, float)) or math.isnan(value):
        return (1 if status == "done" else 3, 0.0)
    return (0 if status == "done" else 2, -value if mode == "max" else value)


def sweep_table(records: list[dict], keys: list[str], metric: str, mode: str) -> str:
    """A Markdown table of the trials, best first (a pruned trial shows its last value)."""
    head = ["rank", "trial", *keys, metric, "status", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    ordered = sorted(records, key=lambda r: _sort_key(r, mode))
    for rank, r in enumerate(ordered, start=1):
        value = r.get("metric")
        cells = [
            str(rank),
            r["name"],
            *(_fmt(r["params"].get(k)) for k in keys),
            _fmt(value) if value is not None else "-",
            r.get("status", "?"),
            f"{r.get('seconds', 0):.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _check_out_dir(out: Path, method: str, resume: bool) -> None:
    """Without --resume the sweep directory must be new or empty; with it, it must hold a
    sweep of the same kind (optuna's study database, or grid / random trial directories)."""
    existing = out.is_dir() and any(out.iterdir())
    if out.exists() and not out.is_dir():
        raise GrpoError(f"--out {out} exists and is not a directory")
    if existing and not resume:
        raise GrpoError(
            f"--out {out} holds a sweep already; pass --resume to continue it, or use a new --out"
        )
    if resume and not existing:
        raise GrpoError(f"--resume: no sweep in {out}")
    if resume and (method == "optuna") != (out / STUDY_DB).is_file():
        kind = "an optuna" if (out / STUDY_DB).is_file() else "a grid / random"
        raise GrpoError(f"--resume: {out} holds {kind} sweep, not --method {method}")


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
    resume: bool = False,
    pruner: str = "median",
    prune_startup: int = 3,
    prune_warmup: int = 0,
    plugins: Sequence[str] = (),
) -> list[dict]:
    """Run (or, with `resume`, continue) a sweep; returns one record per trial, in trial order.

    Args:
        config: the training config every trial starts from.
        space: from `load_space`.
        method: grid (all combinations, or the first `trials`), random (`trials` draws,
            default 10), optuna (TPE, `trials` default 10; a study in OUT/optuna.db).
        trials: number of trials (see `method`).
        metric: a key of the trainer's metrics (e.g. eval/accuracy, train/loss).
        mode: max or min: which end of the metric is best.
        out_dir: the sweep directory (trial_XXX subdirectories); must be new or empty unless
            `resume`.
        overrides: dotted overrides applied to every trial before its parameters.
        trainer: grpo or sft.
        seed: seeds random and optuna sampling.
        resume: continue the sweep in `out_dir`: finished trials are kept, interrupted ones
            run again with their parameters.
        pruner: optuna only: median (stop a trial whose best `metric` so far is worse than the
            median of finished trials at the same step; needs the metric during training, e.g.
            eval/* with train.eval_every) or none.
        prune_startup: no pruning until this many trials have finished.
        prune_warmup: no pruning before this step of a trial.
        plugins: plugins (the CLI's `--plugin`) added to every trial's config.
    """
    check_value("--method", method, one_of(METHODS))
    check_value("--mode", mode, one_of(("max", "min")))
    check_value("--trainer", trainer, one_of(("grpo", "sft")))
    if trials is not None:
        check_value("--trials", trials, between(1, MAX_TRIALS))
    check_value("--pruner", pruner, one_of(PRUNERS))
    check_value("--prune-startup", prune_startup, between(0))
    check_value("--prune-warmup", prune_warmup, between(0))
    out = Path(out_dir)
    setup = SweepSetup(config, tuple(overrides or []), out, metric, mode, trainer, tuple(plugins))
    keys = list(space)
    if method == "grid":
        plan = grid_trials(space, trials)
    elif method == "random":
        plan = random_trials(space, trials or 10, seed)
    else:  # optuna draws as it goes: check the space's first values (ranges: their low end)
        plan = None
        _import_optuna()
        first = {k: v.low if isinstance(v, Range) else v[0] for k, v in space.items()}
        setup.trial_config(first, out / "trial_000")
    for i, params in enumerate(plan or []):  # every trial's config is valid before any runs
        setup.trial_config(params, out / f"trial_{i:03d}")
    _check_out_dir(out, method, resume)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []

    def save() -> None:
        summary = {
            "config": config,
            "method": method,
            "metric": metric,
            "mode": mode,
            "space": {k: v if isinstance(v, list) else vars(v) for k, v in space.items()},
            "trials": records,
        }
        write_json(out / "sweep_results.json", summary)
        write_text(out / "sweep_table.md", sweep_table(records, keys, metric, mode) + "\n")

    if plan is None:
        opts = {"pruner": pruner, "startup": prune_startup, "warmup": prune_warmup}
        _run_optuna(setup, space, trials or 10, seed, records, save, opts)
    else:
        for i, params in enumerate(plan):
            records.append(run_trial(setup, i, params))
            save()
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        raise GrpoError(f"every trial failed or was pruned; see {out}/trial_*/{TRIAL_FILE}")
    if all(r.get("metric") is None for r in done):
        have = sorted(done[0].get("metrics", {}))
        raise GrpoError(f"--metric {metric!r} is not in the trials' metrics; have: {have}")
    return records


def _import_optuna():
    try:
        import optuna
    except ImportError:
        raise GrpoError("--method optuna needs the optuna package (pip install optuna)") from None
    return optuna


def _distributions(optuna, space: Space) -> dict:
    dists = {}
    for key, v in space.items():
        if isinstance(v, Range) and v.integer:
            dists[key] = optuna.distributions.IntDistribution(int(v.low), int(v.high), log=v.log)
        elif isinstance(v, Range):
            dists[key] = optuna.distributions.FloatDistribution(v.low, v.high, log=v.log)
        else:
            dists[key] = optuna.distributions.CategoricalDistribution(v)
    return dists


def _open_study(optuna, setup: SweepSetup, dists: dict, seed: int, opts: dict):
    """Create, or load and check, the study in OUT/optuna.db (sqlite: a killed sweep's
    finished trials, intermediate values and pending retries survive)."""
    fingerprint = {
        "metric": setup.metric,
        "mode": setup.mode,
        "seed": seed,
        "space": {k: optuna.distributions.distribution_to_json(d) for k, d in dists.items()},
    }
    storage = f"sqlite:///{(setup.out_dir / STUDY_DB).resolve()}"
    exists = (setup.out_dir / STUDY_DB).is_file()
    if opts["pruner"] == "median":
        pruner = optuna.pruners.MedianPruner(opts["startup"], opts["warmup"])
    else:
        pruner = optuna.pruners.NopPruner()
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=STUDY_NAME,
            load_if_exists=True,
            pruner=pruner,
            direction="maximize" if setup.mode == "max" else "minimize",
        )
    except Exception as e:  # not sqlite, or not optuna's schema
        raise GrpoError(f"{setup.out_dir / STUDY_DB}: cannot be opened as a study: {e}") from None
    # A resumed study seeds its sampler past the draws it has made, so it does not repeat them.
    study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.get_trials(deepcopy=False)))
    if not exists:
        study.set_user_attr("sweep", fingerprint)
    elif study.user_attrs.get("sweep") != fingerprint:
        raise GrpoError(
            f"--resume: {setup.out_dir} was swept with another metric, mode, seed or space "
            f"({study.user_attrs.get('sweep')}); use a new --out"
        )
    return study


def _run_optuna(
    setup: SweepSetup, space: Space, n: int, seed: int, records: list, save, opts: dict
) -> None:
    """TPE over the space with optuna's ask/tell API, the study stored in OUT/optuna.db, the
    trainer reporting `setup.metric` at every step so that the pruner can stop a bad trial.

    Resuming: a trial that was running when the sweep died is told FAIL (or, if its record
    was written before the death, told that outcome), then run again with the same parameters
    as a new trial whose user attribute `retry_of` names it; such interrupted trials neither
    count toward `n` nor appear in the table.
    """
    optuna = _import_optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    states = optuna.trial.TrialState
    dists = _distributions(optuna, space)
    study = _open_study(optuna, setup, dists, seed, opts)

    def record_path(number: int) -> Path:
        return setup.out_dir / f"trial_{number:03d}" / TRIAL_FILE

    def tell(number: int, record: dict) -> None:
        if record.get("status") == "done" and record.get("metric") is not None:
            study.tell(number, record["metric"])
        elif record.get("status") == "pruned":
            study.tell(number, state=states.PRUNED)
        else:  # failed, or finished without the metric
            study.tell(number, state=states.FAIL)

    for t in study.get_trials(deepcopy=False, states=(states.RUNNING,)):
        path = record_path(t.number)
        old = _read_record(path) if path.is_file() else None
        if old and old.get("params") == t.params and old.get("status") in FINISHED:
            tell(t.number, old)  # it finished; the sweep died before telling the study
            continue
        log.info("trial %03d was interrupted: running its parameters again", t.number)
        study.tell(t.number, state=states.FAIL)
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        shutil.rmtree(path.parent, ignore_errors=True)

    def counted() -> list:
        trials = study.get_trials(deepcopy=False)
        retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
        return [t for t in trials if t.state != states.WAITING and t.number not in retried]

    for t in counted():
        path = record_path(t.number)
        if path.is_file():
            records.append(_read_record(path))
    if records:
        save()
    while len(counted()) < n:
        trial = study.ask(dists)
        record = run_trial(setup, trial.number, trial.params, on_step=_reporter(trial, setup))
        records.append(record)
        save()
        tell(trial.number, record)


def _reporter(trial, setup: SweepSetup):
    """The trainer's step callback: report `setup.metric` when present, stop when pruned."""

    def on_step(step: int, metrics: dict) -> None:
        value = metrics.get(setup.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        trial.report(float(value), step)
        if trial.should_prune():
            raise _Pruned(step, float(value), _numbers(metrics))

    return on_step


# --------------------------------------------------------------------------- CLI


def cmd_sweep(args) -> int:
    """`grpo sweep`: run or resume the trials, print the table sorted by the metric."""
    mode = args.mode or ("min" if "loss" in args.metric else "max")
    space = load_space(args.space)
    out = args.out or f"runs/sweep-{Path(args.config).stem}"
    records = run_sweep(
        args.config,
        space,
        method=args.method,
        trials=args.trials,
        metric=args.metric,
        mode=mode,
        out_dir=out,
        overrides=args.overrides,
        trainer=args.trainer,
        seed=args.seed,
        resume=args.resume,
        pruner=args.pruner,
        prune_startup=args.prune_startup,
        prune_warmup=args.prune_warmup,
        plugins=getattr(args, "plugin", ()),
    )
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
    p.add_argument(
        "--metric",
        default="eval/accuracy",
        help="metric to sort by (optuna: to optimize and prune on)",
    )
    p.add_argument(
        "--mode",
        choices=("max", "min"),
        default=None,
        help="best end of the metric (default: min for losses, else max)",
    )
    p.add_argument("--out", default=None, help="sweep directory (default runs/sweep-CONFIG)")
    p.add_argument("--trainer", default="grpo", choices=("grpo", "sft"))
    p.add_argument("--seed", type=int, default=0, help="seed of random / optuna sampling")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep in --out (finished trials are kept)",
    )
    p.add_argument(
        "--pruner",
        default="median",
        choices=PRUNERS,
        help="optuna: stop a trial whose metric trails the median",
    )
    p.add_argument(
        "--prune-startup",
        type=int,
        default=3,
        help="optuna: trials that finish before any is pruned (default 3)",
    )
    p.add_argument(
        "--prune-warmup",
        type=int,
        default=0,
        help="optuna: steps of a trial before it may be pruned (default 0)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides for every trial")
    p.set_defaults(func=cmd_sweep)
