"""AdamW and the learning-rate schedule (linear warmup, then cosine decay or constant), and the
check that an update left the weights finite."""

from __future__ import annotations

import math

import torch

from grpo.errors import GrpoError


def build_optimizer(params, cfg) -> torch.optim.AdamW:
    """AdamW over `params` (trainable only); no weight decay on 1-d tensors (norms, biases).

    Args:
        params: iterable of parameters (those with requires_grad are kept).
        cfg: an `OptimConfig`.
    """
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_lambda(step: int, total_steps: int, cfg) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based) of `total_steps`.

    W = round(warmup_ratio * total_steps) warmup steps ramp linearly to 1 starting above 0:
    step k < W uses (k + 1) / W (W = 4: 0.25, 0.5, 0.75, 1.0), so no update runs at lr 0.
    Then `constant` holds 1; `cosine` goes from 1 at step W towards min_lr_ratio at step
    total_steps (which is never taken: the last update, total_steps - 1, is above it).
    """
    warmup = int(round(cfg.warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer, total_steps: int, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """The `lr_lambda` schedule over `total_steps` optimizer steps (one `scheduler.step()` after
    each `optimizer.step()`). Before update k (0-based) the optimizer's lr is
    cfg.lr * lr_lambda(k): read it then (`get_last_lr()`), since after the step it is the
    next update's lr.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, total_steps, cfg)
    )


@torch.no_grad()
def weights_finite(params) -> torch.Tensor:
    """0-d bool on the parameters' device, without a host sync: every element of every tensor
    in `params` is finite. FSDP's DTensor parameters count with this rank's shards (reduce the
    answer over ranks). Run once after each optimizer step; read it with the step's numbers."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    local = [t for t in local if t.numel()]  # an FSDP shard may be empty (a (1, C) head)
    if not local:
        return torch.ones((), dtype=torch.bool)
    # the largest |w| of each tensor (one multi-tensor kernel): inf or NaN iff some w is
    peaks = torch._foreach_norm(local, ord=float("inf"))
    return torch.stack([p.to(peaks[0].device) for p in peaks]).isfinite().all()


def nonfinite_weights_error(step: int | None, loss: float, grad_norm: float, lr: float):
    """The one line that stops a run whose update left a weight NaN or inf (raised before the
    step's checkpoint, so the last one written holds finite weights)."""
    where = f"step {step}: " if step is not None else ""
    return GrpoError(
        f"{where}the weights are not finite after the update (loss {loss:.4g}, grad norm "
        f"{grad_norm:.4g}, lr {lr:.3g}); lower optim.lr (and keep optim.max_grad_norm set); the "
        "checkpoints already written are kept: resume from the last with --resume"
    )
