"""Slow float64 references for the built-in policy losses, and the float64 objective around any
reference (the per-token loss + beta * k3, aggregated by definition).

A reference has the policy loss's own signature (inputs by parameter name, see
`grpo.algo.policy_losses`) and is called on float64 tensors. The built-ins' references are
written token by token from each paper's definition (Python loops; the vectorized
implementations are not used): a row function over the row's counted tokens, turned into a
reference by `per_row`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

RowFn = Callable[[list, list, list, dict], list]


def per_row(row_fn: RowFn) -> Callable[..., torch.Tensor]:
    """A reference from a function of one row: ``row_fn(lp, old, A, kw) -> per-token losses``,
    where lp, old and A are lists of 0-d float64 tensors over the row's counted tokens and kw
    holds the scalar inputs (epsilon_low, ..., policy_loss_kwargs). Masked tokens get 0."""

    def reference(logprobs, old_logprobs, advantages, mask, **kw):
        zero = logprobs.new_zeros(())
        rows = []
        for i in range(mask.shape[0]):
            idx = [t for t in range(mask.shape[1]) if mask[i, t]]
            values = (
                row_fn(
                    [logprobs[i, t] for t in idx],
                    [old_logprobs[i, t] for t in idx],
                    [advantages[i, t] for t in idx],
                    kw,
                )
                if idx
                else []
            )
            by_t = dict(zip(idx, values))
            rows.append(torch.stack([zero + by_t.get(t, 0.0) for t in range(mask.shape[1])]))
        return torch.stack(rows)  # (B, T_c)

    reference.__name__ = reference.__qualname__ = row_fn.__name__
    return reference


def _clip_token(r, A, el, eh, dual=None):
    s = min(r * A, min(max(r, 1 - el), 1 + eh) * A)
    if dual is not None and float(A) < 0:
        s = max(s, dual * A)
    return -s


def _eps(kw):
    return kw.get("epsilon_low", 0.2), kw.get("epsilon_high", 0.2)


def ref_clip(lp, old, A, kw):
    el, eh = _eps(kw)
    return [
        _clip_token(torch.exp(lp[t] - old[t]), A[t], el, eh, kw.get("dual_clip"))
        for t in range(len(lp))
    ]


def ref_gspo(lp, old, A, kw):
    el, eh = _eps(kw)
    s = torch.exp(sum(lp[t] - old[t] for t in range(len(lp))) / len(lp))
    return [_clip_token(s, A[t], el, eh, kw.get("dual_clip")) for t in range(len(lp))]


def ref_gspo_token(lp, old, A, kw):
    seq = sum(float(lp[t].detach() - old[t]) for t in range(len(lp))) / len(lp)
    out = []
    for t in range(len(lp)):
        s = torch.exp(seq + lp[t] - lp[t].detach())  # value exp(seq), gradient of lp[t]
        out.append(_clip_token(s, A[t], *_eps(kw)))  # no dual clip in GSPO-token
    return out


def ref_cispo(lp, old, A, kw):
    el, eh = _eps(kw)
    out = []
    for t in range(len(lp)):
        w = min(math.exp(float(lp[t].detach() - old[t])), 1 + eh)
        if kw.get("clip_low"):
            w = max(w, 1 - el)
        out.append(-w * A[t] * lp[t])
    return out


def ref_gmpo(lp, old, A, kw):
    el, eh = _eps(kw)
    logs = []
    for t in range(len(lp)):
        lr = lp[t] - old[t]
        if A[t] > 0:  # only the increasing side is clipped
            logs.append(torch.clamp(lr, max=eh))
        elif A[t] < 0:
            logs.append(torch.clamp(lr, min=-el))
        else:
            logs.append(lr * 0.0)
    ratio = torch.exp(sum(logs) / len(lp))
    a_row = sum(A) / len(A)
    return [-a_row * ratio for _ in range(len(lp))]


def ref_sapo(lp, old, A, kw):
    out = []
    for t in range(len(lp)):
        tau = kw.get("tau_pos", 1.0) if A[t] > 0 else kw.get("tau_neg", 1.05)
        r = torch.exp(lp[t] - old[t])
        out.append(-torch.sigmoid(tau * (r - 1)) * 4 / tau * A[t])
    return out


BUILTIN_REFERENCES: dict[str, Callable[..., torch.Tensor]] = {
    name: per_row(fn)
    for name, fn in {
        "clip": ref_clip,
        "gspo": ref_gspo,
        "gspo_token": ref_gspo_token,
        "cispo": ref_cispo,
        "gmpo": ref_gmpo,
        "sapo": ref_sapo,
    }.items()
}


def reference_objective(
    pg: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    beta: float,
) -> torch.Tensor:
    """float64 loss by definition: per-token `pg` (B, T_c) + beta * k3, aggregated by
    `aggregation` over the counted tokens, row by row."""
    rows, n_tok = [], 0
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t]]
        d = [ref_logprobs[i, t] - logprobs[i, t] for t in idx]
        rows.append([pg[i, t] + beta * (torch.exp(dt) - dt - 1) for t, dt in zip(idx, d)])
        n_tok += len(idx)
    if aggregation == "token_mean":
        return sum(sum(r) for r in rows) / n_tok
    if aggregation == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows if r) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * mask.shape[1])
