"""One metric logger: a compact stdout line, `metrics.jsonl`, optional TensorBoard / wandb."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from tqdm.auto import tqdm

from grpo.io import open_text, read_text, write_text

log = logging.getLogger(__name__)


class Sum(float):
    """A metric value summed over ranks (a count): ``{"groups_kept": Sum(3)}``. A plain float
    is averaged over ranks; `Max` and `Min` take the extreme. Being floats, they log as such."""

    op = "sum"


class Max(float):
    """A metric value whose max over ranks is logged."""

    op = "max"


class Min(float):
    """A metric value whose min over ranks is logged."""

    op = "min"


REDUCTIONS = {"mean": float, "sum": Sum, "max": Max, "min": Min}


def reduction(value) -> str:
    """How a metric value is reduced over ranks: "sum", "max", "min" or "mean" (anything else:
    a float, an int, a 0-d tensor)."""
    return getattr(value, "op", "mean")


def tagged(value: float, op: str):
    """`value` as the metric type that `reduction` reads back as `op`."""
    return REDUCTIONS[op](value)


def split_metrics(result, who: str) -> tuple:
    """(value, metrics) of what a registered function returned: ``(value, {"name": scalar})``
    or just the value. Each metric is a finite number (a one-element tensor is read); `Sum` /
    `Max` / `Min` keep their type. Raises GrpoError naming `who` and the bad metric."""
    from grpo.errors import GrpoError

    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        return result, {}
    value, reported = result
    out = {}
    for key, v in reported.items():
        if hasattr(v, "numel") and v.numel() == 1:  # a tensor
            v = float(v.detach().item())
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not isinstance(key, str) or not key or not ok:
            shown = f"a tensor of shape {tuple(v.shape)}" if hasattr(v, "shape") else repr(v)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."  # one line, short
            raise GrpoError(
                f"{who} reported the metric {key!r}: {shown}; a metric is a string "
                "name and a finite number"
            )
        out[key] = v if hasattr(v, "op") else float(v)
    return value, out


# (metric, short label, format) shown on the stdout line when present.
STDOUT_KEYS = [
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/accuracy", "acc", "{:.2f}"),
    ("train/loss", "loss", "{:.4f}"),
    ("train/accuracy", "pair_acc", "{:.3f}"),  # grpo rm
    ("train/kl", "kl", "{:.4f}"),
    ("train/clip_frac_high", "clip+", "{:.3f}"),
    ("rollout/completion_len_mean", "len", "{:.1f}"),
    ("train/grad_norm", "gnorm", "{:.3f}"),
    ("train/lr", "lr", "{:.2e}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("perf/step_s", "s/step", "{:.2f}"),
]


class MetricLogger:
    """Writes each `log(step, metrics)` as one JSON line and a short stdout line.

    Args:
        out_dir: run directory; metrics go to out_dir/metrics.jsonl (appended, so a resumed
            run continues the same file).
        enabled: False on ranks other than 0 (then every call is a no-op).
        tensorboard / wandb: also send scalars there (optional dependencies).
        config: the resolved config dict, given to wandb.
        resume_step: a resumed run drops records after this step (logged by the killed run
            after its last checkpoint, and about to be logged again).
        header: string fields (``run/<name>``: the estimator, loss, ... a run uses) added to
            the first record this logger writes, so that each start of a run names its choices
            in metrics.jsonl without a record of its own (step lists stay 1, 2, ...). Sent to
            neither stdout nor TensorBoard; wandb has them in its config.
    """

    def __init__(
        self,
        out_dir: str | Path,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "grpo",
        config: dict | None = None,
        resume_step: int | None = None,
        header: dict[str, str] | None = None,
    ):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb = self._wandb = None
        self._header = dict(header or {})  # written with the first record, then cleared
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep), atomic=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
        if wandb:
            import wandb as wb

            self._wandb = wb.init(project=wandb_project, config=config, dir=str(out_dir))

    def log(self, step: int, metrics: dict[str, float], stdout: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        with open_text(self.path, "a") as f:
            f.write(json.dumps({"step": step, **self._header, **clean}) + "\n")
        self._header = {}
        if stdout:
            parts = [f"step {step}"]
            for key, label, fmt in STDOUT_KEYS:
                v = clean.get(key)
                if isinstance(v, float) and math.isfinite(v):
                    parts.append(f"{label} {fmt.format(v)}")
            tqdm.write(" | ".join(parts))
        for k, v in clean.items():
            if isinstance(v, float):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl (a torn last line, from a kill, is skipped)."""
    rows = []
    for line in read_text(path, "metrics records, one JSON object a line").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
