"""PPO with a critic against GRPO on the offline math demo, at the same rollout budget.

    python -m benchmarks.ppo_vs_grpo --out runs/ppo-vs-grpo [--seed 0] [--quick]

One SFT model (the math demo's: configs/demo_cpu.yaml, tiny Qwen3 from random init, SFT on
worked solutions), then two RL runs from it that differ only in the advantage: GRPO
(group-relative, `loss.advantage: grpo`) and PPO (`loss.advantage: gae` with the `critic`
module: a value model initialised from the SFT model, GAE over the token rewards, a clipped
value loss, a few critic-only warm-up steps). Same prompts x completions per step, same steps,
same policy optimizer; dynamic sampling is off for both (it would give GRPO extra rollouts).
Both are evaluated on the demo's held-out problems (greedy accuracy every eval_every steps).

Writes out/results.json (per-run held-out accuracy, the PPO critic's explained variance over
the last 20% of steps, times), out/curves.png (held-out accuracy and training reward of both
on one plot, and the critic's explained variance), and with --save the same into
benchmarks/results/ppo_vs_grpo_seed<N>.json and docs/img/ppo_vs_grpo_seed<N>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo_cpu.yaml"

# the RL settings both runs share, over the demo's GRPO stage (pipeline overrides)
COMMON = ["grpo.rollout.dynamic_sampling=false", "grpo.train.eval_every=25"]
# what makes the second run PPO (modules: the critic; its kwargs and optimizer)
PPO = [
    "grpo.loss.advantage=gae",
    "grpo.loss.gae_lambda=0.95",
    "grpo.train.critic_warmup_steps=10",
    "grpo.modules=[{name: critic, kwargs: {value_clip: 0.2}, optim: {lr: 1.0e-3, "
    "warmup_ratio: 0.0, schedule: constant}}]",
]


def curve(metrics: Path, key: str) -> list[tuple[int, float]]:
    out = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if key in r and isinstance(r[key], (int, float)):
            out.append((int(r["step"]), float(r[key])))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/ppo-vs-grpo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument(
        "--save", action="store_true", help="also write benchmarks/results/ and docs/img/ copies"
    )
    ap.add_argument("--tag", default="", help="--save: a suffix of the saved files' names")
    ap.add_argument("overrides", nargs="*", help="pipeline overrides for both runs")
    args = ap.parse_args(argv)

    import torch

    from grpo.apps.demo import _pipeline_file, load_demo_config, register_demo_data
    from grpo.apps.pipeline import grpo_config_from_sft, load_pipeline_config
    from grpo.eval import evaluate_config
    from grpo.loading import trained_model
    from grpo.tiny import make_tiny_model
    from grpo.train.grpo import train_grpo
    from grpo.train.sft import train_sft

    settings, pipeline, quick_over = load_demo_config(DEMO, args.quick)
    torch.set_num_threads(max(1, min(settings.threads, os.cpu_count() or 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    over = [*quick_over, *COMMON, *args.overrides]
    make_tiny_model(
        model_dir,
        size=settings.model_size,
        vocab_size=settings.vocab_size,
        seed=args.seed,
        max_position_embeddings=settings.context,
    )
    register_demo_data(settings)
    times: dict[str, float] = {}

    pcfg = load_pipeline_config(_pipeline_file(out, pipeline, model_dir, args.seed), over)
    t = time.perf_counter()
    sft = train_sft(pcfg.sft, overwrite=True)
    times["sft"] = time.perf_counter() - t

    results: dict = {
        "seed": args.seed,
        "quick": args.quick,
        "overrides": over,
        "ppo": PPO,
        "command": "python -m benchmarks.ppo_vs_grpo "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": {},
    }
    sft_eval = None
    for name, extra in (("grpo", []), ("ppo", PPO)):
        p = load_pipeline_config(out / "pipeline.yaml", [*over, *extra])
        cfg = grpo_config_from_sft(p.grpo, p.sft, sft["final"])
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, output_dir=str(out / name))
        )
        if sft_eval is None:
            sft_eval = evaluate_config(cfg, trained_model(cfg, sft["final"]))
            print(f"SFT: held-out greedy accuracy {sft_eval['accuracy']:.3f}", flush=True)
        t = time.perf_counter()
        run = train_grpo(cfg, overwrite=True)
        took = time.perf_counter() - t
        final_eval = evaluate_config(cfg, trained_model(cfg, run["final"]))
        metrics = out / name / "metrics.jsonl"
        ev = curve(metrics, "advantage/explained_variance")
        last = [v for s, v in ev if s > 0.8 * cfg.train.max_steps]
        step_s = [v for _, v in curve(metrics, "perf/step_s")]
        results["runs"][name] = {
            "accuracy": final_eval["accuracy"],
            "gain_over_sft": final_eval["accuracy"] - sft_eval["accuracy"],
            "eval_curve": curve(metrics, "eval/accuracy"),
            "reward_curve": curve(metrics, "rollout/reward_mean"),
            "explained_variance_curve": ev,
            "explained_variance_last_20pct": sum(last) / len(last) if last else None,
            # groups of G rollouts sampled on the logged steps (dynamic sampling refills more)
            "groups_sampled_logged": sum(v for _, v in curve(metrics, "rollout/groups_sampled")),
            "steps": run["step"],
            "train_s": round(took, 1),
            "step_s_median": sorted(step_s)[len(step_s) // 2] if step_s else None,
        }
        print(
            f"{name}: held-out greedy accuracy {final_eval['accuracy']:.3f} "
            f"(SFT {sft_eval['accuracy']:.3f}), {took:.0f} s",
            flush=True,
        )
    results["sft"] = {"accuracy": sft_eval["accuracy"], "train_s": round(times["sft"], 1)}
    results["eval"] = {"split": "test", "n": sft_eval["n"], "decoding": "greedy"}
    g, p = results["runs"]["grpo"], results["runs"]["ppo"]
    results["ppo_minus_grpo"] = p["accuracy"] - g["accuracy"]
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    png = plot(results, out / "curves.png")
    if args.save:
        tag = f"seed{args.seed}" + ("_quick" if args.quick else "") + args.tag
        (REPO / "benchmarks" / "results" / f"ppo_vs_grpo_{tag}.json").write_text(
            json.dumps(results, indent=2) + "\n"
        )
        plot(results, REPO / "docs" / "img" / f"ppo_vs_grpo_{tag}.png")
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=2))
    print(f"curves: {png}")
    return results


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    sft = results["sft"]["accuracy"]
    for name, run in results["runs"].items():
        pts = [(0, sft), *run["eval_curve"]]
        axes[0].plot(*zip(*pts), marker="o", label=f"{name.upper()} ({run['accuracy']:.3f})")
        r = run["reward_curve"]
        if r:
            axes[1].plot(*zip(*r), label=name.upper(), alpha=0.8)
    axes[0].axhline(sft, color="grey", ls="--", lw=1, label=f"SFT ({sft:.3f})")
    axes[0].set(title="held-out greedy accuracy", xlabel="step")
    axes[1].set(title="training reward (mean)", xlabel="step")
    ev = results["runs"]["ppo"]["explained_variance_curve"]
    if ev:
        axes[2].plot(*zip(*ev), color="tab:orange")
    axes[2].axhline(0, color="grey", ls="--", lw=1)
    axes[2].set(title="PPO critic: explained variance", xlabel="step", ylim=(-1, 1))
    for ax in axes[:2]:
        ax.legend()
    fig.suptitle(f"PPO (critic, GAE) vs GRPO, same rollout budget, seed {results['seed']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
