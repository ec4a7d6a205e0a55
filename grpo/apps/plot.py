"""PNG training curves of a run from its `metrics.jsonl` (matplotlib, Agg backend).

    grpo plot runs/demo        ->  runs/demo/curves.png

A record may carry a ``stage`` ("sft", "grpo"); each stage gets one row of panels, and a
panel is drawn only when the stage logged one of its metrics, so an SFT-only run (just a loss)
plots as well as a full demo.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path

from grpo.errors import GrpoError
from grpo.metrics import read_metrics

COLUMNS = 3  # panels per row
SMOOTH_ABOVE = 30  # series longer than this get a moving average over the raw values
# (title, y label, [(metric or glob, legend label), ...]) in drawing order; a glob's label
# gets the matched name's last part in its {}.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Loss", "loss", [("train/loss", "train loss")]),
    (
        "Reward",
        "mean reward per completion",
        [
            ("rollout/reward_mean", "total"),
            ("rewards/accuracy", "accuracy"),
            ("rewards/format", "format"),
            ("rewards/reward_model", "reward model"),
        ],
    ),
    (
        "Accuracy",
        "fraction correct",
        [
            ("rollout/accuracy", "rollouts (sampled)"),
            ("eval/accuracy", "held-out (greedy)"),
            ("eval/pass@*", "held-out {}"),
        ],
    ),
    ("KL to reference", "KL (nats / token)", [("train/kl", "KL")]),
    (
        "Completion length",
        "tokens",
        [("rollout/completion_len_mean", "rollouts (mean)"), ("eval/avg_length", "held-out")],
    ),
    ("Entropy", "nats / token", [("train/entropy", "policy entropy")]),
    (
        "Tool use",
        "per trajectory",
        [
            ("env/tool_calls_mean", "tool calls (rollouts)"),
            ("env/invalid_call_rate", "invalid-call rate (rollouts)"),
            ("eval/tool_calls_mean", "tool calls (held-out)"),
        ],
    ),
]


def _draw(ax, xs: list[float], ys: list[float], label: str) -> None:
    """One curve: points for a few values; for many, the raw values faint under a moving
    average (per-step rollout numbers are noisy)."""
    if len(xs) <= SMOOTH_ABOVE:
        ax.plot(xs, ys, "o-", label=label, markersize=4, linewidth=1.5)
        return
    w = max(3, len(ys) // 15)
    smooth = [
        sum(ys[max(0, i - w + 1) : i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(ys))
    ]
    (line,) = ax.plot(xs, ys, "-", alpha=0.25, linewidth=1.0)
    ax.plot(xs, smooth, "-", color=line.get_color(), linewidth=1.8, label=f"{label} (avg of {w})")


def _matching(rows: list[dict], pattern: str) -> list[str]:
    """The metric names of `rows` that match `pattern` (a name, or a glob like eval/pass@*)."""
    if "*" not in pattern:
        return [pattern]
    return sorted({k for r in rows for k in r if fnmatch.fnmatchcase(k, pattern)})


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """The (steps, values) of `key` over `rows`, skipping rows without a finite value."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(r.get("step", len(xs))))
            ys.append(float(v))
    return xs, ys


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of `run_dir/metrics.jsonl` into `run_dir/curves.png` (or `out`).

    Args:
        run_dir: a run directory holding metrics.jsonl (or the metrics.jsonl file itself).
        out: where to write the PNG (default: curves.png beside metrics.jsonl).

    Returns:
        the path of the PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir)
    metrics_file = path if path.is_file() else path / "metrics.jsonl"
    if not metrics_file.is_file():
        raise GrpoError(f"plot: no metrics.jsonl in {str(path)!r}")
    rows = read_metrics(metrics_file)
    stages: dict[str, list[dict]] = {}
    for r in rows:
        stages.setdefault(str(r.get("stage", "")), []).append(r)
    # Per stage, the panels that have data (a panel with no metric of that stage is left out).
    grid = []
    for stage, srows in stages.items():
        panels = []
        for title, ylabel, keys in PANELS:
            lines = [
                (label.format(k.split("/")[-1]), *_series(srows, k))
                for pattern, label in keys
                for k in _matching(srows, pattern)
            ]
            lines = [line for line in lines if line[1]]
            if lines:
                panels.append((title, ylabel, lines))
        if panels:
            grid.append((stage, panels))
    if not grid:
        raise GrpoError(f"plot: {metrics_file} has no metrics to plot")
    # Each stage starts a new row; a stage with more than COLUMNS panels wraps.
    cells: list[list[tuple[str, tuple] | None]] = []
    for stage, panels in grid:
        for start in range(0, len(panels), COLUMNS):
            cells.append([(stage, p) for p in panels[start : start + COLUMNS]])
    ncols = min(COLUMNS, max(len(p) for _, p in grid))
    fig, axes = plt.subplots(
        len(cells), ncols, figsize=(4.6 * ncols, 3.5 * len(cells)), squeeze=False
    )
    for i, row in enumerate(cells):
        for j in range(ncols):
            ax = axes[i][j]
            if j >= len(row):
                ax.axis("off")
                continue
            stage, (title, ylabel, lines) = row[j]
            for label, xs, ys in lines:
                _draw(ax, xs, ys, label)
            ax.set_title(f"{stage.upper()}: {title}" if stage else title, fontsize=11)
            ax.set_xlabel(f"{stage.upper()} step" if stage else "step")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if len(lines) > 1 or title in ("Accuracy", "Reward"):
                ax.legend(fontsize=8)
    fig.suptitle(f"{metrics_file.parent.name}: training curves", fontsize=13)
    fig.tight_layout()
    png = Path(out) if out is not None else metrics_file.parent / "curves.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
