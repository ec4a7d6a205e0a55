"""`grpo demo --task rlhf`: the tutorial's SFT -> reward model -> RL chain on a CPU, offline,
where the policy never sees a rule-based reward.

    tokenizer + tiny Qwen3 (random init)  -> SFT on worked solutions     (out/sft)
      -> preference pairs: a correct worked solution against a wrong one (5 error kinds)
      -> `grpo rm` from the SFT model: Bradley-Terry, held-out pair accuracy   (out/rm)
      -> evaluate the SFT model: true (rule-checked) greedy accuracy, reward-model score
      -> GRPO from the SFT model, the reward model its ONLY reward            (out/grpo)
         (the strict accuracy reward rides along at weight 0: logged, never trained on)
      -> evaluate the GRPO model the same way
      -> GRPO again from the SFT model, same seed and steps, its reward a reward model trained
         online: the one above, updated every step on preference labels of the policy's own
         samples, a labeller (the rule verifier standing in for people) answering at most
         `label_budget` pairs per step (grpo/modules/online_rm.py)          (out/grpo_online)
      -> evaluate that model the same way
      -> results.json, metrics.jsonl, curves.png (true accuracy beside the reward model's
         score, so reward hacking would show: the score rising while accuracy falls) and
         rm_variants.png / rm_variants.json: both variants' true accuracy and reward-model
         score per step on one plot

Settings: configs/demo_rlhf_cpu.yaml (the math demo's `demo` and `pipeline` sections, an `rm`
section: the `grpo rm` config over the pipeline's `base`, and an `online_rm` section: the online
reward model's module `kwargs` and `optim`). Overrides: the pipeline's
``stage.section.key=value``, ``rm.section.key=value`` for the reward model and
``online_rm.kwargs.key=value`` / ``online_rm.optim.key=value`` for the online one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from grpo.settings import ConfigError

PREFERENCES = "demo-preferences"  # the pairs the demo registers (train / test)
STEPS = 8
ONLINE = "online_reward_model"  # the module the online variant trains beside the policy


def _say(i: int, what: str) -> None:
    print(f"\n== {i}/{STEPS} {what}", flush=True)


def register_preferences(settings, seed: int) -> dict[str, Any]:
    """Pairs from the demo's training problems (train) and validation problems (test, held
    out: no question shared with train), registered as `PREFERENCES`; counts per kind."""
    from collections import Counter

    from datasets import DatasetDict

    from grpo.apps.demo import DATASET
    from grpo.data import get_dataset, register_dataset
    from grpo.data.preferences import math_preferences

    n = settings.pairs_per_problem
    train_problems = get_dataset(DATASET, "train").to_list()
    test_problems = get_dataset(DATASET, "validation").to_list()
    train = math_preferences(train_problems, seed, n)
    test = math_preferences(test_problems, seed + 1, n)
    keep = ("prompt", "chosen", "rejected")
    register_dataset(
        PREFERENCES,
        DatasetDict(
            train=_dataset([{k: r[k] for k in keep} for r in train]),
            test=_dataset([{k: r[k] for k in keep} for r in test]),
        ),
        overwrite=True,
    )
    return {
        "train": len(train),
        "test": len(test),
        "kinds": dict(sorted(Counter(r["kind"] for r in train).items())),
        "test_rows": test,
    }


def accuracy_by_kind(rm_dir: str, rows: list[dict], max_length: int) -> dict[str, float]:
    """The reward model's held-out pair accuracy per error kind (r_chosen > r_rejected)."""
    import torch

    from grpo.data.preferences import preference_pairs
    from grpo.models.classifier import sequence_scores
    from grpo.rewards.model import load_reward_model

    model, tok = load_reward_model(rm_dir, "cpu")
    pad = model.config.pad_token_id
    out: dict[str, list[int]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        some = [r for r in rows if r["kind"] == kind]
        pairs, _ = preference_pairs(some, tok, max_length)
        wins = []
        for p in pairs:
            seqs = [p.prompt_ids + p.chosen_ids, p.prompt_ids + p.rejected_ids]
            T = max(map(len, seqs))
            ids = torch.full((2, T), pad, dtype=torch.long)
            mask = torch.zeros(2, T, dtype=torch.bool)
            for b, q in enumerate(seqs):
                ids[b, : len(q)], mask[b, : len(q)] = torch.tensor(q), True
            with torch.no_grad():
                s = sequence_scores(model, ids, mask, pad)[:, 0]
            wins.append(int(s[0] > s[1]))
        out[kind] = wins
    return {k: round(sum(v) / len(v), 3) for k, v in out.items() if v}


def _dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)


def rm_config(
    base: dict, section: dict, sft_final: str, out: Path, seed: int, overrides: list[str]
):
    """The reward model's `grpo rm` config: the pipeline's base, the demo's `rm` section, the
    SFT model as its start and the registered pairs as its data."""
    from grpo.apps.pipeline import _deep_merge
    from grpo.config import load_config

    data = _deep_merge(base, section)
    data["model"] = {**(data.get("model") or {}), "path": sft_final, "tokenizer": sft_final}
    data["data"] = {
        **(data.get("data") or {}),
        "dataset": PREFERENCES,
        "split": "train",
        "eval_split": "test",
    }
    data["train"] = {**(data.get("train") or {}), "seed": seed, "output_dir": str(out)}
    return load_config(base=data, overrides=overrides)


def run_rlhf(
    out: str | Path = "runs/rlhf",
    quick: bool = False,
    seed: int = 0,
    config: str | Path | None = None,
    task: str | None = "rlhf",
    overrides: list[str] | tuple[str, ...] = (),
) -> dict:
    """`grpo demo --task rlhf`: the arguments of `grpo.apps.demo.run_demo`; returns what it
    writes to out/results.json."""
    import torch

    from grpo.apps.demo import (
        _clean,
        _demo_file,
        check_task,
        demo_config_path,
        load_demo_config,
    )

    path = demo_config_path(config, task or "rlhf")
    settings, pipeline, quick_overrides = load_demo_config(path, quick)
    check_task(settings, task)
    if settings.task != "rlhf":
        raise ConfigError(f"{path}: demo.task is {settings.task!r}, not 'rlhf'")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(settings.threads, os.cpu_count() or 1)))
    try:
        return run_rlhf_demo(
            out,
            settings,
            pipeline,
            _demo_file(path).rm,
            [*quick_overrides, *overrides],
            seed,
            quick,
            _demo_file(path).online_rm,
        )
    finally:
        torch.set_num_threads(threads_before)


def run_rlhf_demo(
    out: Path,
    settings,
    pipeline: dict,
    rm_section: dict,
    overrides: list[str],
    seed: int,
    quick: bool,
    online_section: dict | None = None,
) -> dict:
    """Run the demo (module docstring) into `out`; returns what it writes to results.json."""
    import torch

    from grpo.apps.demo import _combined_metrics, _pipeline_file, _print_eval, register_demo_data
    from grpo.apps.pipeline import grpo_config_from_sft, load_pipeline_config
    from grpo.apps.plot import plot_run
    from grpo.eval import evaluate_config
    from grpo.loading import trained_model
    from grpo.models import load_model
    from grpo.tiny import make_tiny_model
    from grpo.train.grpo import train_grpo
    from grpo.train.rm import train_rm
    from grpo.train.sft import train_sft

    t_start, cpu_start = time.perf_counter(), time.process_time()
    times: dict[str, float] = {}
    rm_over = [o.removeprefix("rm.") for o in overrides if o.startswith("rm.")]
    online_over = [o for o in overrides if o.startswith("online_rm.")]
    pipe_over = [o for o in overrides if not o.startswith(("rm.", "online_rm."))]
    online_section = online_settings(online_section or {}, online_over)

    _say(1, "tokenizer, model and problems")
    model_dir = out / "model"
    rm_final = out / "rm" / "final"
    pipeline = json.loads(json.dumps(pipeline))
    for spec in pipeline.get("grpo", {}).get("rewards") or []:  # the reward model to train
        if spec.get("name") == "reward_model":
            spec.setdefault("kwargs", {})["path"] = str(rm_final)
    pcfg = load_pipeline_config(_pipeline_file(out, pipeline, model_dir, seed, "math"), pipe_over)
    make_tiny_model(
        model_dir,
        size=settings.model_size,
        vocab_size=settings.vocab_size,
        seed=seed,
        max_position_embeddings=settings.context,
    )
    sizes = register_demo_data(settings, solutions=True)
    n_params = sum(p.numel() for p in load_model(model_dir, device="cpu").parameters())
    print(
        f"model: {settings.model_size} ({n_params / 1e6:.2f}M parameters); problems: {sizes}",
        flush=True,
    )
    times["setup"] = time.perf_counter() - t_start

    _say(2, "SFT on worked solutions")
    t = time.perf_counter()
    sft_cfg = pcfg.sft
    sft = train_sft(sft_cfg, overwrite=True)
    times["sft"] = time.perf_counter() - t

    _say(3, "preference pairs and the reward model (grpo rm, from the SFT model)")
    t = time.perf_counter()
    pairs = register_preferences(settings, settings.data_seed)
    test_rows = pairs.pop("test_rows")
    print(f"preference pairs: {pairs}", flush=True)
    base = json.loads(json.dumps(pipeline.get("base") or {}))
    rcfg = rm_config(base, rm_section, sft["final"], out / "rm", seed, rm_over)
    t_rm = time.perf_counter()
    rm = train_rm(rcfg, overwrite=True)
    times["rm_train"] = time.perf_counter() - t_rm
    rm_eval = {k.removeprefix("eval/"): v for k, v in rm.items() if k.startswith("eval/")}
    by_kind = accuracy_by_kind(rm["final"], test_rows, rcfg.rm.max_length)
    print(
        f"reward model: held-out pair accuracy {rm_eval.get('accuracy', float('nan')):.3f} "
        f"on {rm_eval.get('pairs', 0)} pairs; by error kind on all {len(test_rows)}: "
        f"{by_kind}",
        flush=True,
    )
    times["rm"] = time.perf_counter() - t

    grpo_cfg = grpo_config_from_sft(pcfg.grpo, sft_cfg, sft["final"])
    _say(4, "evaluate the SFT model: true accuracy and the reward model's score")
    t = time.perf_counter()
    # GRPO's config: its rewards (the reward model; accuracy at weight 0) score the greedy
    # completions, so average_reward is the reward model's mean score
    sft_eval = evaluate_config(grpo_cfg, trained_model(grpo_cfg, sft["final"]), details=True)
    sft_samples = sft_eval.pop("samples")
    _print_eval("SFT", sft_eval, grpo_cfg.eval.k)
    times["eval_sft"] = time.perf_counter() - t

    _say(5, "GRPO from the SFT model, the reward model its only reward")
    t = time.perf_counter()
    grpo = train_grpo(grpo_cfg, overwrite=True)
    times["grpo"] = time.perf_counter() - t

    _say(6, "evaluate the GRPO model on the same problems")
    t = time.perf_counter()
    grpo_eval = evaluate_config(grpo_cfg, trained_model(grpo_cfg, grpo["final"]), details=True)
    grpo_samples = grpo_eval.pop("samples")
    _print_eval("GRPO", grpo_eval, grpo_cfg.eval.k)
    times["eval_grpo"] = time.perf_counter() - t

    _say(7, "GRPO from the SFT model again, its reward a reward model trained online")
    t = time.perf_counter()
    online_cfg = online_config(grpo_cfg, online_section, str(rm_final), out / "grpo_online")
    online = train_grpo(online_cfg, overwrite=True)
    times["grpo_online"] = time.perf_counter() - t

    _say(8, "evaluate the online variant's model on the same problems")
    t = time.perf_counter()
    # the same evaluation (true accuracy; the offline reward model's score), plus the score
    # of the online reward model as it ended
    online_eval = evaluate_config(grpo_cfg, trained_model(grpo_cfg, online["final"]), details=True)
    online_samples = online_eval.pop("samples")
    online_rm_score = final_online_score(str(rm_final), online["final"], online_samples, online_cfg)
    _print_eval("GRPO, online reward model", online_eval, grpo_cfg.eval.k)
    times["eval_grpo_online"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - t_start
    times["cpu"] = time.process_time() - cpu_start

    metrics = _combined_metrics(
        out, sft["step"], grpo["step"], {"sft": sft_eval, "grpo": grpo_eval}
    )
    curves = plot_run(out)
    variants = compare_variants(out, sft_eval, grpo_eval, online_eval)
    from grpo.apps.demo import _examples

    results = {
        "task": "rlhf",
        "quick": quick,
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "problems": sizes,
        "preference_pairs": pairs,
        "reward_model": {
            "eval": rm_eval,
            "steps": rm["step"],
            "accuracy_by_kind": by_kind,
            "train_accuracy_last": rm.get("train/accuracy"),
        },
        "eval": {
            "split": grpo_cfg.data.eval_split,
            "n": sft_eval["n"],
            "k": grpo_cfg.eval.k,
            "decoding": "greedy for accuracy and the reward model's score",
        },
        "sft": {"eval": sft_eval, "rm_score": sft_eval["average_reward"]},
        "grpo": {
            "eval": grpo_eval,
            "rm_score": grpo_eval["average_reward"],
            "steps": grpo["step"],
            "reward_last": grpo.get("rollout/reward_mean"),
            "kl_last": grpo.get("train/kl"),
        },
        "grpo_online": {
            "eval": online_eval,
            "rm_score": online_eval["average_reward"],
            "online_rm_score": online_rm_score,
            "steps": online["step"],
            "reward_last": online.get("rollout/reward_mean"),
            "kl_last": online.get("train/kl"),
            "labels": online.get(f"module/{ONLINE}/labels_total"),
            "module": {k: v for k, v in online_section.items()},
        },
        "accuracy_gain": grpo_eval["accuracy"] - sft_eval["accuracy"],
        "rm_score_gain": grpo_eval["average_reward"] - sft_eval["average_reward"],
        "online_accuracy_gain": online_eval["accuracy"] - sft_eval["accuracy"],
        "examples": _examples(sft_samples, grpo_samples),
        "examples_online": _examples(sft_samples, online_samples),
        "time_s": {k: round(v, 2) for k, v in times.items()},
        "threads": torch.get_num_threads(),
        "paths": {
            "model": str(model_dir),
            "sft": sft["final"],
            "rm": rm["final"],
            "grpo": grpo["final"],
            "grpo_online": online["final"],
            "metrics": str(metrics),
            "curves": str(curves),
            "rm_variants": str(variants),
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + summary_table(results))
    print(f"results.json, metrics.jsonl, curves.png and rm_variants.png are in {out}", flush=True)
    return results


def summary_table(results: dict) -> str:
    """The closing table: true accuracy and the reward model's score, before and after."""
    from grpo.apps.demo import _fmt_s

    rm = results["reward_model"]["eval"]
    lines = [
        "| model | true greedy accuracy | reward-model score | format | length | train time |",
        "|---|---|---|---|---|---|",
    ]
    names = {"sft": "SFT", "grpo": "GRPO, offline RM", "grpo_online": "GRPO, online RM"}
    for name, title in names.items():
        e = results[name]["eval"]
        lines.append(
            f"| {title} | {e['accuracy']:.3f} | {results[name]['rm_score']:+.3f} "
            f"| {e['format_rate']:.3f} | {e['avg_length']:.1f} | "
            f"{_fmt_s(results['time_s'][name])} |"
        )
    lines += [
        "",
        f"reward model: held-out pair accuracy {rm.get('accuracy', float('nan')):.3f} "
        f"({rm.get('pairs', 0)} pairs), trained in "
        f"{_fmt_s(results['time_s']['rm_train'])}",
        f"GRPO - SFT: {100 * results['accuracy_gain']:+.1f} points of true accuracy, "
        f"{results['rm_score_gain']:+.3f} reward-model score on {results['eval']['n']} "
        f"held-out problems",
        f"GRPO with the online reward model - SFT: "
        f"{100 * results['online_accuracy_gain']:+.1f} points of true accuracy "
        f"({results['grpo_online']['labels']:.0f} labels); total "
        f"{_fmt_s(results['time_s']['total'])} on {os.cpu_count()} core(s)",
    ]
    return "\n".join(lines)


def online_settings(section: dict, overrides: list[str]) -> dict:
    """The online reward model's `kwargs` and `optim` (the demo file's `online_rm` section)
    with ``online_rm.kwargs.key=value`` / ``online_rm.optim.key=value`` overrides (values
    parsed as YAML)."""
    import yaml

    unknown = sorted(set(section) - {"kwargs", "optim"})
    if unknown:
        raise ConfigError(f"online_rm.{unknown[0]}: unknown key; valid keys: kwargs, optim")
    out = {"kwargs": dict(section.get("kwargs") or {}), "optim": dict(section.get("optim") or {})}
    for o in overrides:
        key, eq, value = o.partition("=")
        parts = key.split(".")
        if not eq or len(parts) != 3 or parts[1] not in out:
            raise ConfigError(
                f"override {o!r}: expected online_rm.kwargs.KEY=VALUE or online_rm.optim.KEY=VALUE"
            )
        out[parts[1]][parts[2]] = yaml.safe_load(value)
    return out


def online_config(grpo_cfg, section: dict, rm_path: str, output_dir: Path):
    """The online variant's GRPO config: the offline one with the `reward_model` reward
    replaced by the online reward model (`ONLINE`, from `rm_path`) and its own output
    directory; the weight-0 accuracy reward still rides along."""
    from grpo.config import ModuleConfig

    rewards = tuple(r for r in grpo_cfg.rewards if r.name != "reward_model")
    kwargs = {"init": rm_path, **section["kwargs"]}
    module = ModuleConfig(ONLINE, kwargs=kwargs, optim=dict(section["optim"]))
    train = dataclasses.replace(grpo_cfg.train, output_dir=str(output_dir))
    return dataclasses.replace(grpo_cfg, rewards=rewards, modules=(module,), train=train)


def final_online_score(rm_path: str, final: str, samples: list[dict], cfg) -> float:
    """The mean score the online reward model, as it ended (final/modules/...), gives the
    evaluation's completions."""
    from grpo.io import load_safetensors
    from grpo.models import load_model
    from grpo.rewards.model import score_completions
    from grpo.tokenizer import load_tokenizer

    weights = load_safetensors(Path(final) / "modules" / ONLINE / "weights.safetensors")
    model = load_model(rm_path, device="cpu")
    model.load_state_dict(
        {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    )
    kwargs = dict(cfg.modules[0].kwargs)
    scores = score_completions(
        model.eval(),
        load_tokenizer(rm_path),
        [s["question"] for s in samples],
        [s["completion"] for s in samples],
        kwargs.get("batch_size", 64),
        kwargs.get("max_length", 1024),
        kwargs.get("system_prompt"),
    )
    return float(scores.mean())


def variant_curves(run_dir: Path, score_key: str) -> dict[str, list]:
    """Per-step series of one GRPO run: steps, the sampled completions' true accuracy
    (`rollout/accuracy`), the reward model's mean score (`score_key`), and the held-out
    greedy accuracy where evaluated."""
    from grpo.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "rollout/accuracy" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    return {
        "step": [r["step"] for r in steps],
        "sampled_accuracy": [r["rollout/accuracy"] for r in steps],
        "rm_score": [r.get(score_key) for r in steps],
        "eval_step": [r["step"] for r in evals],
        "eval_accuracy": [r["eval/accuracy"] for r in evals],
    }


def compare_variants(out: Path, sft_eval: dict, offline_eval: dict, online_eval: dict) -> Path:
    """out/rm_variants.png and .json: true accuracy (sampled, per step; held-out greedy from
    the SFT model to the end) and the reward model's score per step, offline and online."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {
        "sft_accuracy": sft_eval["accuracy"],
        "offline": variant_curves(out / "grpo", "rewards/reward_model"),
        "online": variant_curves(out / "grpo_online", "rewards/online_rm"),
    }
    for name, final in (("offline", offline_eval), ("online", online_eval)):
        c = data[name]
        last = c["step"][-1] if c["step"] else 0
        # the held-out curve runs from the SFT model (step 0) to the final evaluation
        points = [(0, sft_eval["accuracy"])]
        points += [(s, a) for s, a in zip(c["eval_step"], c["eval_accuracy"]) if s < last]
        points.append((last, final["accuracy"]))
        c["eval_step"], c["eval_accuracy"] = [p[0] for p in points], [p[1] for p in points]
        c["final_accuracy"] = final["accuracy"]
    (out / "rm_variants.json").write_text(json.dumps(data, indent=1) + "\n")
    fig, (acc, score) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"offline": "tab:red", "online": "tab:blue"}
    for name in ("offline", "online"):
        c, col = data[name], colors[name]
        acc.plot(c["step"], c["sampled_accuracy"], color=col, alpha=0.3, lw=0.8)
        acc.plot(c["eval_step"], c["eval_accuracy"], "o-", color=col, label=f"{name} RM")
        score.plot(c["step"], c["rm_score"], color=col, label=f"{name} RM (its own score)")
    acc.axhline(sft_eval["accuracy"], color="gray", ls="--", lw=1, label="SFT")
    acc.set(title="true accuracy (dots: held-out greedy; thin: samples)", xlabel="GRPO step")
    score.set(title="reward-model score of the step's samples", xlabel="GRPO step")
    acc.legend()
    score.legend()
    fig.tight_layout()
    path = out / "rm_variants.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
