"""The learning-rate schedule (grpo/run/optim.py): hand-computed values, no update at lr 0,
resume, and the lr the trainers log is the one their update used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo.config import OptimConfig, load_config
from grpo.run.optim import build_optimizer, build_scheduler, lr_lambda

REPO = Path(__file__).resolve().parents[1]


def used_lrs(cfg: OptimConfig, total: int) -> list[float]:
    """The lr of each of `total` AdamW updates, read from the optimizer just before its step."""
    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = build_optimizer([w], cfg)
    sched = build_scheduler(opt, total, cfg)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr()[0] == lrs[-1]
        w.grad = torch.ones_like(w)
        opt.step()
        sched.step()
    return lrs


def test_warmup_then_cosine_by_hand():
    # total 10, warmup_ratio 0.2 -> W = 2 warmup steps: (k + 1) / W = 0.5, 1.0.
    # Then 0.1 + 0.9 * (1 + cos(pi * (k - 2) / 8)) / 2 for k = 2..9:
    #   k=2: cos 0 = 1 -> 1.0;  k=3: cos(pi/8) = 0.92388 -> 0.1 + 0.9 * 0.96194 = 0.96575
    #   k=4: cos(pi/4) = 0.70711 -> 0.86820;  k=5: cos(3pi/8) = 0.38268 -> 0.72221
    #   k=6: cos(pi/2) = 0 -> 0.55;  k=7: -0.38268 -> 0.37779;  k=8: -0.70711 -> 0.23180
    #   k=9: -0.92388 -> 0.1 + 0.9 * 0.03806 = 0.13425;  k=10 (never taken): 0.1 = min_lr_ratio
    cfg = OptimConfig(lr=0.1, warmup_ratio=0.2, min_lr_ratio=0.1)
    want = [0.5, 1.0, 1.0, 0.96575, 0.86820, 0.72221, 0.55, 0.37779, 0.23180, 0.13425]
    assert [lr_lambda(k, 10, cfg) for k in range(11)] == pytest.approx(want + [0.1], abs=1e-5)
    assert used_lrs(cfg, 10) == pytest.approx([0.1 * m for m in want], abs=1e-6)


def test_constant_schedule_by_hand():
    # total 8, warmup_ratio 0.5 -> W = 4: 1/4, 2/4, 3/4, 4/4, then 1 to the end
    cfg = OptimConfig(lr=2e-3, schedule="constant", warmup_ratio=0.5)
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert used_lrs(cfg, 8) == pytest.approx([2e-3 * m for m in want], rel=1e-6)


def test_no_warmup_starts_at_full_lr():
    # warmup_ratio 0 -> W = 0: step 0 is cosine at progress 0 -> 1.0; total 4, min 0:
    # (1 + cos(pi * k / 4)) / 2 = 1.0, 0.85355, 0.5, 0.14645
    cfg = OptimConfig(lr=1e-3)
    assert used_lrs(cfg, 4) == pytest.approx([1e-3, 0.85355e-3, 0.5e-3, 0.14645e-3], abs=1e-8)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("warmup_ratio", [0.0, 0.05, 0.1, 0.3, 0.9])
def test_no_update_runs_at_lr_zero(schedule, warmup_ratio):
    """Every update of every run length has lr > 0, the first and the last included (min_lr_ratio
    0 is reached only at step `total`, which is never taken)."""
    cfg = OptimConfig(lr=1e-3, schedule=schedule, warmup_ratio=warmup_ratio)
    for total in range(1, 41):
        factors = [lr_lambda(k, total, cfg) for k in range(total)]
        assert min(factors) > 0, (total, factors)
        assert max(factors) == pytest.approx(1.0), (total, factors)


def test_resumed_scheduler_continues_the_schedule():
    cfg = OptimConfig(lr=0.1, warmup_ratio=0.2, min_lr_ratio=0.1)
    w = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([w], cfg)
    sched = build_scheduler(opt, 10, cfg)
    for _ in range(4):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = build_optimizer([w], cfg)
    sched2 = build_scheduler(opt2, 10, cfg)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr()[0] == pytest.approx(0.1 * 0.86820, abs=1e-6)  # update k=4
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.1 * 0.72221, abs=1e-6)  # k=5


def logged_lrs(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/lr"] for r in recs if "train/lr" in r]


@pytest.mark.parametrize("trainer", ["grpo", "sft"])
def test_logged_lr_is_the_lr_of_the_steps_update(shared_tiny_model, tmp_path, trainer):
    """train/lr of step s is the lr its (first) update ran at, not the next update's (so
    `grpo train --config configs/tiny_ci.yaml train.max_steps=1` no longer logs lr 0, the
    cosine's end, at step 1)."""
    from grpo.train.grpo import train_grpo
    from grpo.train.sft import train_sft

    steps = 2 if trainer == "grpo" else 4
    cfg = load_config(
        REPO / "configs" / "tiny_ci.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={tmp_path / 'run'}",
            f"train.max_steps={steps}",
            "optim.warmup_ratio=0.5",
            "loss.num_iterations=2",
            "data.eval_samples=0",
            "train.save_every=0",
            "train.log_every=1",
            "train.progress=false",
        ],
    )
    # Both make 4 updates with W = round(0.5 * 4) = 2: lr 0.5, 1.0, then cosine
    # (1 + cos(pi * (k - 2) / 2)) / 2 = 1.0, 0.5 (x 1e-3). GRPO: 2 steps of 2 passes each,
    # logged at each step's first update (k = 0, 2); SFT: one update per step.
    if trainer == "grpo":
        train_grpo(cfg)
        want = [0.5e-3, 1e-3]
    else:
        train_sft(cfg)
        want = [0.5e-3, 1e-3, 1e-3, 0.5e-3]
    assert logged_lrs(tmp_path / "run") == pytest.approx(want, rel=1e-6)
