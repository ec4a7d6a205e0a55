"""`grpo pipeline`: prepare data -> SFT -> evaluate SFT -> GRPO from the SFT result -> evaluate
GRPO, with every stage's status, metrics, paths and timings in OUTPUT_DIR/training_results.json
(rewritten after every stage, so a failure keeps what the earlier stages produced).

A pipeline config is a YAML mapping (unknown keys fail):

    output_dir: runs/pipeline        # stage runs go to OUTPUT_DIR/sft and OUTPUT_DIR/grpo
    base: {model: {path: ...}}       # optional: config keys shared by both stages
    sft: {config: sft.yaml, overrides: ["optim.lr=5e-5"]}   # a config file (+ overrides) ...
    grpo: {rollout: {group_size: 4}}                        # ... or an inline config mapping
    evaluate_base: false             # also evaluate the base model, for a 3-way comparison

A stage's config is `base` deep-merged with the stage's file (paths relative to the pipeline
file) or inline mapping, then its overrides. GRPO starts from SFT's result, whatever GRPO's own
model.path / model.adapter say: a LoRA SFT adapter becomes GRPO's `model.adapter` (merged at
load, so the SFT model is also GRPO's reference policy); a full fine-tune's final directory
becomes GRPO's `model.path`. GRPO keeps its own model.dtype, device and other settings. The
SFT evaluation stops the pipeline when accuracy < the SFT config's
`eval.sft_accuracy_threshold`. The evaluation stages use `eval.max_samples` rows of
`data.eval_split` and also report `average_reward` under the stage's rewards. Plugins go in
`base: {plugins: [...]}` (or a stage's config) or come from `--plugin`: both stages import them.

The stages are core calls: `grpo.loading.load_rows` (prepare_data), `train_sft` /
`train_grpo`, and `grpo.eval.evaluate_config` on `grpo.loading.trained_model` (evaluations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo.checks import check_config
from grpo.config import Config, load_config
from grpo.errors import GrpoError, SignalStop
from grpo.eval import comparison_table, evaluate_config
from grpo.io import read_text
from grpo.loading import TrainedModel, config_model, load_rows, trained_model
from grpo.settings import ConfigError, build_settings

log = logging.getLogger(__name__)

RESULTS_FILE = "training_results.json"


@dataclass(frozen=True)
class PipelineFile:
    """The pipeline YAML's top level, parsed by the config's one builder (`build_settings`):
    the stages are config mappings or {config: FILE, overrides: [...]}, checked below."""

    output_dir: str
    sft: dict
    grpo: dict
    evaluate_base: bool = False
    base: dict = dataclasses.field(default_factory=dict)  # sections common to both stages


@dataclass(frozen=True)
class StageFile:
    """A stage given as a file: {config: FILE, overrides: ['section.key=value', ...]}."""

    config: str
    overrides: tuple[str, ...] = ()


STAGES = ("prepare_data", "base_eval", "sft", "sft_eval", "grpo", "grpo_eval")


class PipelineError(GrpoError):
    """A stage failed; the message names it and where the earlier results are."""


@dataclass(frozen=True)
class PipelineConfig:
    """The resolved pipeline: one validated `Config` per training stage.

    `grpo.model` still names SFT's base; `grpo_config_from_sft` points it at SFT's result.
    """

    output_dir: Path
    sft: Config
    grpo: Config
    evaluate_base: bool = False
    source: str | None = None  # the pipeline YAML, for the record


# --------------------------------------------------------------------------- config


def _deep_merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, recursively for mappings (lists are replaced, not merged)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{what}: config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(read_text(path, "a YAML pipeline config")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}: {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {str(path)!r} must hold a mapping at the top level")
    return data


def _stage_source(spec: Any, name: str, root: Path) -> tuple[dict, list[str]]:
    """(config dict, overrides) of a stage given inline or as {config: FILE, overrides: [...]}."""
    if "config" not in spec:
        return spec, []
    stage = build_settings(StageFile, {**spec, "overrides": spec.get("overrides") or []}, name)
    file = Path(stage.config).expanduser()
    return _read_yaml(file if file.is_absolute() else root / file, name), list(stage.overrides)


def _route_overrides(overrides: list[str]) -> tuple[dict, list[str], list[str]]:
    """Split CLI overrides: top-level keys, `sft.`-prefixed, `grpo.`-prefixed; the rest
    (optionally `base.`-prefixed) go to both stages."""
    top: dict = {}
    sft: list[str] = []
    grpo: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(
                f"override {item!r} must look like key=value or stage.section.key=value"
            )
        key = key.strip()
        if key in ("output_dir", "evaluate_base"):
            top[key] = yaml.safe_load(raw) if raw else ""
        elif key.startswith("sft."):
            sft.append(item.strip()[4:])
        elif key.startswith("grpo."):
            grpo.append(item.strip()[5:])
        else:
            rest = item.strip().removeprefix("base.")
            sft.append(rest)
            grpo.append(rest)
    return top, sft, grpo


def _stage_config(
    name: str, data: dict, overrides: list[str], out_dir: Path, plugins: Sequence[str] = ()
) -> Config:
    try:  # the stage's names and, for grpo, its rules: checked now, not after SFT has run
        cfg = check_config(load_config(None, overrides, base=data, plugins=plugins), name)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from None
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(out_dir)))


def load_pipeline_config(
    path: str | Path, overrides: list[str] | None = None, plugins: Sequence[str] = ()
) -> PipelineConfig:
    """Read and validate a pipeline YAML (see the module docstring).

    Args:
        path: the pipeline YAML.
        overrides: `output_dir=DIR`, `evaluate_base=true`, `sft.optim.lr=1e-4`,
            `grpo.rollout.group_size=8`, or `model.path=X` (no stage prefix: both stages).
        plugins: plugins (the CLI's `--plugin`) added to both stages' `plugins`.

    Returns:
        the `PipelineConfig`; raises `ConfigError` naming the stage and dotted field.
    """
    p = Path(path)
    data = _read_yaml(p, "pipeline")
    top, sft_over, grpo_over = _route_overrides(overrides or [])
    data.update(top)
    f = build_settings(PipelineFile, {**data, "base": data.get("base") or {}})
    if not f.output_dir:
        raise ConfigError("output_dir: expected a directory path, got ''")
    sft_data, sft_file_over = _stage_source(f.sft, "sft", p.parent)
    grpo_data, grpo_file_over = _stage_source(f.grpo, "grpo", p.parent)
    base, evaluate_base, out_dir = f.base, f.evaluate_base, Path(f.output_dir)
    sft = _stage_config(
        "sft", _deep_merge(base, sft_data), sft_file_over + sft_over, out_dir / "sft", plugins
    )
    # GRPO's model section names SFT's result, whatever a (standalone) GRPO config said
    grpo_dict = _deep_merge(base, grpo_data)
    grpo_dict["model"] = {**(grpo_dict.get("model") or {}), "path": sft.model.path, "adapter": None}
    grpo = _stage_config("grpo", grpo_dict, grpo_file_over + grpo_over, out_dir / "grpo", plugins)
    model = dataclasses.replace(
        grpo.model, path=sft.model.path, tokenizer=sft.model.tokenizer, adapter=None
    )
    grpo = dataclasses.replace(grpo, model=model)
    if sft.lora.enabled and sft.model.adapter:
        raise ConfigError(
            "sft: model.adapter with LoRA SFT would leave GRPO two adapters to merge; fold the "
            "first one in with `grpo merge` and use the result as model.path"
        )
    return PipelineConfig(out_dir, sft, grpo, evaluate_base, str(p))


def grpo_config_from_sft(grpo: Config, sft: Config, sft_final: str | Path) -> Config:
    """GRPO's config pointed at SFT's result.

    LoRA SFT: `model.adapter` = the SFT adapter (merged at load; also GRPO's reference).
    Full fine-tuning: `model.path` (and tokenizer) = SFT's final checkpoint directory.
    """
    if sft.lora.enabled:
        model = dataclasses.replace(
            grpo.model, path=sft.model.path, tokenizer=sft.model.tokenizer, adapter=str(sft_final)
        )
    else:
        model = dataclasses.replace(
            grpo.model, path=str(sft_final), tokenizer=str(sft_final), adapter=None
        )
    return dataclasses.replace(grpo, model=model)


# --------------------------------------------------------------------------- running


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _write_json(path: Path, data: dict) -> None:
    """Atomic write: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _split_summary(summary: dict) -> tuple[dict, dict]:
    """A trainer summary -> (paths, metrics)."""
    out = Path(summary["output_dir"])
    paths = {
        "output_dir": str(out),
        "final": str(summary["final"]),
        "config": str(out / "config.yaml"),
        "metrics": str(out / "metrics.jsonl"),
    }
    metrics = {k: v for k, v in summary.items() if k not in ("output_dir", "final")}
    return paths, metrics


def _check_single_process() -> None:
    from grpo.distributed import init_distributed, teardown

    dist = init_distributed("cpu")
    teardown()
    if dist.enabled:
        raise GrpoError(
            "grpo pipeline runs in one process; under torchrun run its stages "
            "(`grpo sft`, `grpo eval`, `grpo train`) one by one (see docs/distributed.md)"
        )


def preflight_pipeline(pcfg: PipelineConfig) -> dict:
    """Both stages' preflight checks (grpo/run/preflight.py: contexts, LoRA, data sizes,
    memory; the evaluation stages included) and the output directory, before anything is
    written or loaded; an error names the stage.

    Returns:
        stage name ("sft", "grpo") -> the checkpoint's `ModelConfig`.
    """
    from grpo.run.preflight import PreflightError, check_output_dir, preflight

    check_output_dir(pcfg.output_dir, "output_dir")
    configs = {}
    for name, cfg in (("sft", pcfg.sft), ("grpo", pcfg.grpo)):
        try:
            configs[name] = preflight(cfg, name, pipeline=True)
        except PreflightError as e:
            raise PreflightError(f"{name}: {e}") from None
    return configs


def run_pipeline(
    pcfg: PipelineConfig,
    overwrite: bool = False,
    details: bool = False,
    on_stage: Callable[[str], None] | None = None,
) -> dict:
    """Run the stages in order, rewriting OUTPUT_DIR/training_results.json after each.

    Args:
        pcfg: the pipeline (`load_pipeline_config`).
        overwrite: the training stages start afresh over an earlier pipeline's runs (else a
            stage whose directory holds one is refused). SIGTERM / SIGINT during a training
            stage saves its checkpoint and records the stage and the pipeline as "interrupted".
        details: keep every evaluation's per-problem records (completion, scores, ground
            truth): returned under `samples[stage]`, not written to the file.
        on_stage: called with each stage's name as it starts (e.g. to print a banner).

    Returns:
        the results dict; `status` is "completed", or "stopped" (SFT accuracy under the
        threshold; `message` says so). A failing stage raises `PipelineError` naming it, after
        recording it (status "failed", `failed_stage`, the stage's `error`) in the file.
        SIGTERM in any other stage (an evaluation, data preparation, a model loading) stops
        it at once, records it and the pipeline as "interrupted" and raises
        `TrainingInterrupted` (exit 143); between stages, the next one stops before it starts.
    """
    with _sigterm_stops_stages() as signals:
        return _run_stages(pcfg, overwrite, details, on_stage, signals)


@contextlib.contextmanager
def _sigterm_stops_stages() -> Iterator[dict]:
    """SIGTERM during the pipeline, outside a training stage's own handling (which checkpoints
    at a step boundary): inside a stage (`signals["in_stage"]`) the handler raises `SignalStop`
    at once, which unwinds like KeyboardInterrupt to the stage's record; between stages it is
    kept in `signals["signum"]` for the next stage to stop on. The previous handler comes back
    at the first signal (a second one has its usual effect) and when the pipeline ends. Only
    the main thread can set handlers; elsewhere nothing changes."""
    signals = {"signum": 0, "in_stage": False}
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous

    def handler(signum, frame) -> None:
        signal.signal(signum, previous)
        signals["signum"] = signum
        if signals["in_stage"]:
            raise SignalStop(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield signals
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_stages(
    pcfg: PipelineConfig,
    overwrite: bool,
    details: bool,
    on_stage: Callable[[str], None] | None,
    signals: dict,
) -> dict:
    """`run_pipeline`'s stages; `signals` from `_sigterm_stops_stages`."""
    from grpo.run.preflight import check_prompt_room
    from grpo.run.rundir import TrainingInterrupted
    from grpo.tokenizer import load_tokenizer
    from grpo.train.grpo import train_grpo
    from grpo.train.sft import tokenize_sft, train_sft

    _check_single_process()
    model_configs = preflight_pipeline(pcfg)  # both stages' checks, before anything is written
    out = pcfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    results: dict[str, Any] = {
        "status": "running",
        "config": pcfg.source,
        "output_dir": str(out),
        "started": _now(),
        "stages": {},
    }
    t_start = time.perf_counter()

    def save() -> None:
        results["total_s"] = round(time.perf_counter() - t_start, 3)
        _write_json(path, results)

    def stage(name: str, fn: Callable[[dict], Any]) -> Any:
        log.info("pipeline: stage %s", name)
        if on_stage is not None:
            on_stage(name)
        entry: dict[str, Any] = {"status": "running", "started": _now()}
        results["stages"][name] = entry
        save()
        t0 = time.perf_counter()
        try:
            signals["in_stage"] = True
            if signals["signum"]:  # a SIGTERM between stages: stop before this one
                raise SignalStop(signals["signum"])
            value = fn(entry)
            signals["in_stage"] = False
        except BaseException as e:
            signals["in_stage"] = False
            interrupted = isinstance(e, (KeyboardInterrupt, TrainingInterrupted, SignalStop))
            msg = str(e) if isinstance(e, GrpoError) else f"{type(e).__name__}: {e}"
            if isinstance(e, SignalStop):
                msg = f"interrupted by {signal.Signals(e.signum).name}"
            entry.update(status="interrupted" if interrupted else "failed", error=msg)
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            results.update(status=entry["status"], failed_stage=name, finished=_now())
            save()
            if isinstance(e, SignalStop):  # one line, exit 128 + N, as a training stage's
                raise TrainingInterrupted(
                    f"{msg} in stage {name!r} (results of earlier stages kept in {path})",
                    e.signum,
                ) from None
            if interrupted or not isinstance(e, Exception):
                raise
            log.debug("stage %s failed", name, exc_info=True)
            raise PipelineError(
                f"stage {name!r} failed: {msg} (results of earlier stages kept in {path})"
            ) from e
        entry["status"] = "done"
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        save()
        return value

    sft_cfg = pcfg.sft

    def prepare(entry: dict) -> None:
        tok = load_tokenizer(config_model(sft_cfg).tokenizer_path)
        data = sft_cfg.data
        rows = load_rows(data, data.split, data.max_samples, "sft", tok)
        evals = load_rows(data, data.eval_split, sft_cfg.eval.max_samples, "rl", tok)
        metrics = {
            "dataset": sft_cfg.data.dataset,
            "split": sft_cfg.data.split,
            "dataset_size": len(rows),
            "sample_keys": sorted(k for k in rows[0] if k != "prompt_ids"),
            "eval_split": sft_cfg.data.eval_split,
            "eval_size": len(evals),
            "max_prompt_tokens": max(len(r["prompt_ids"]) for r in rows),
        }
        g = pcfg.grpo
        grpo_rows, grpo_evals = rows, evals
        if g.data != sft_cfg.data:  # GRPO trains on other data: check it too
            grpo_rows = load_rows(g.data, g.data.split, g.data.max_samples, "rl", tok)
            grpo_evals = load_rows(g.data, g.data.eval_split, g.eval.max_samples, "rl", tok)
            metrics["grpo_dataset"] = g.data.dataset
            metrics["grpo_dataset_size"] = len(grpo_rows)
        # every prompt fits each stage's context with its budgets (before any training)
        sft_rows = tokenize_sft([dict(r) for r in rows], tok, sft_cfg.rollout.max_new_tokens)
        check_prompt_room(sft_cfg, model_configs["sft"], "sft", sft_rows, evals, pipeline=True)
        check_prompt_room(g, model_configs["grpo"], "grpo", grpo_rows, grpo_evals, pipeline=True)
        entry["metrics"] = metrics

    samples: dict[str, list[dict]] = {}  # details: model name -> per-problem records

    def evaluation(name: str, cfg: Config, spec: TrainedModel) -> Callable[[dict], dict]:
        def run(entry: dict) -> dict:
            entry["paths"] = {"model": spec.path, "adapters": list(spec.adapters)}
            entry["metrics"] = evaluate_config(cfg, spec, details=details)
            if details:
                samples[name] = entry["metrics"].pop("samples")
            return entry["metrics"]

        return run

    def training(train_fn: Callable, cfg: Config) -> Callable[[dict], dict]:
        def run(entry: dict) -> dict:
            entry["paths"] = {"output_dir": cfg.train.output_dir}
            summary = train_fn(cfg, overwrite=True) if overwrite else train_fn(cfg)
            entry["paths"], entry["metrics"] = _split_summary(summary)
            return summary

        return run

    compare: dict[str, dict] = {}
    stage("prepare_data", prepare)
    if pcfg.evaluate_base:
        compare["base"] = stage("base_eval", evaluation("base", sft_cfg, config_model(sft_cfg)))
    sft_summary = stage("sft", training(train_sft, sft_cfg))
    sft_model = trained_model(sft_cfg, sft_summary["final"])
    compare["sft"] = stage("sft_eval", evaluation("sft", sft_cfg, sft_model))
    threshold = sft_cfg.eval.sft_accuracy_threshold
    accuracy = compare["sft"].get("accuracy", 0.0)
    if accuracy < threshold:
        results.update(
            status="stopped",
            finished=_now(),
            message=(
                f"stopped after SFT evaluation: accuracy {accuracy:.4f} < "
                f"eval.sft_accuracy_threshold {threshold}; GRPO was not run. Train SFT longer "
                "or lower the threshold (sft.eval.sft_accuracy_threshold=...)"
            ),
        )
        save()
        return {**results, "samples": samples} if details else results
    grpo_cfg = grpo_config_from_sft(pcfg.grpo, sft_cfg, sft_summary["final"])
    grpo_summary = stage("grpo", training(train_grpo, grpo_cfg))
    grpo_model = trained_model(grpo_cfg, grpo_summary["final"])
    compare["grpo"] = stage("grpo_eval", evaluation("grpo", grpo_cfg, grpo_model))
    results["summary"] = {
        name: {k: s.get(k) for k in ("accuracy", "average_reward", "format_rate", "avg_length")}
        for name, s in compare.items()
    }
    results["table"] = comparison_table(compare)
    results.update(status="completed", finished=_now())
    save()
    return {**results, "samples": samples} if details else results


# --------------------------------------------------------------------------- CLI


def cmd_pipeline(args) -> int:
    """`grpo pipeline --config C [overrides]`: exit 0 completed, 1 stopped at the threshold."""
    import sys

    plugins = getattr(args, "plugin", ())  # `grpo --plugin` (cli.build_parser adds it)
    pcfg = load_pipeline_config(args.config, args.overrides, plugins=plugins)
    results = run_pipeline(pcfg, overwrite=args.overwrite)
    path = Path(results["output_dir"]) / RESULTS_FILE
    if results["status"] == "stopped":
        print(f"grpo pipeline: {results['message']}", file=sys.stderr)
        print(f"results in {path}")
        return 1
    print(results["table"])
    print(f"results in {path}")
    return 0


def add_parser(subparsers) -> None:
    """Add `grpo pipeline` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "pipeline", help="data -> SFT -> eval -> GRPO -> eval -> training_results.json"
    )
    p.add_argument("--config", required=True, help="pipeline YAML (output_dir, base, sft, grpo)")
    p.add_argument(
        "overrides",
        nargs="*",
        help="output_dir=DIR, sft.optim.lr=1e-4, grpo.loss.beta=0.0, model.path=X (both stages)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="rerun the training stages over an earlier pipeline's runs",
    )
    p.set_defaults(func=cmd_pipeline)
