"""Conformance: every *registered* advantage estimator, policy loss and KL estimator passes the
same checks, so a new variant is tested the moment it is registered.

Estimators: finite on all-equal groups and fully-masked rows, zero outside the mask, padding
columns change nothing, shift invariance / group zero-sum where the entry claims it
(`register_advantage(..., claims=...)`), two gloo ranks equal one process.
Policy losses: finite with fully-masked rows and NaN/inf at masked positions, gradient equal to
a slow float64 reference written from the paper's definition, micro-batches equal the full
batch, two gloo ranks equal one process (loss, gradient and reduced stats).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from algo_ddp_worker import B, G, T, loss_settings, make_inputs

from grpo.algo import (
    ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossSettings,
    compute_advantages,
    kl_penalty,
    loss_normalizer,
    policy_loss,
)
from grpo.train.grpo import StatSums

REPO = Path(__file__).resolve().parents[1]
ESTIMATORS = ADVANTAGES.names()
LOSSES = POLICY_LOSSES.names()


def advantages(name, x, **kw):
    return compute_advantages(name, x["token_rewards"], x["mask"], group_size=G, **kw)


# ----------------------------------------------------------------------------- estimators


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_shape_mask_and_equal_groups(name):
    x = make_inputs()
    a = advantages(name, x)
    assert a.shape == (B, T) and a.dtype == torch.float32
    assert torch.isfinite(a).all() and (a[~x["mask"]] == 0).all()
    # all-equal rewards in every group: finite (no 0/0), and no signal for the std-free ones
    same = dict(x, token_rewards=torch.where(x["mask"], 0.0, 0.0))
    same["token_rewards"][torch.arange(B), x["mask"].sum(-1) - 1] = 1.0
    a = advantages(name, same)
    assert torch.isfinite(a).all()
    if "group_zero_sum" in ADVANTAGES.claims(name):
        assert (a == 0).all()


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_fully_masked_rows_and_padding(name):
    x = make_inputs()
    x["mask"][3] = False  # a row with no counted token
    x["token_rewards"][3] = 0.0
    a = advantages(name, x)
    assert torch.isfinite(a).all() and (a[3] == 0).all()
    # padding columns with garbage (masked) change nothing: ranks pad to the longest T_c
    pad = 5
    wide = {
        "mask": torch.nn.functional.pad(x["mask"], (0, pad), value=False),
        "token_rewards": torch.nn.functional.pad(x["token_rewards"], (0, pad), value=float("nan")),
    }
    b = advantages(name, wide)
    torch.testing.assert_close(b[:, :T], a, rtol=0, atol=1e-6)
    assert (b[:, T:] == 0).all()


@pytest.mark.parametrize(
    "name", [n for n in ESTIMATORS if "shift_invariant" in ADVANTAGES.claims(n)]
)
def test_estimator_shift_invariance(name):
    x = make_inputs(1)
    a = advantages(name, x)
    shifted = x["token_rewards"].clone()
    shifted[torch.arange(B), x["mask"].sum(-1) - 1] += 3.5  # +c on every outcome reward
    b = advantages(name, dict(x, token_rewards=shifted))
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "name", [n for n in ESTIMATORS if "group_zero_sum" in ADVANTAGES.claims(n)]
)
def test_estimator_group_zero_sum(name):
    x = make_inputs(2)
    a = advantages(name, x)
    per_row = a[torch.arange(B), x["mask"].sum(-1) - 1]  # the row's (constant) value
    torch.testing.assert_close(per_row.view(-1, G).sum(-1), torch.zeros(B // G), atol=1e-5, rtol=0)


def test_every_builtin_claims_what_it_should():
    # a claim that silently disappeared would switch a check off: pin the built-ins' claims
    assert ADVANTAGES.claims("grpo") == {"shift_invariant", "group_zero_sum"}
    assert ADVANTAGES.claims("rloo") == {"shift_invariant", "group_zero_sum"}
    assert "group_zero_sum" not in ADVANTAGES.claims("opo")


# ----------------------------------------------------------------------------- losses

# Slow float64 references, token by token from each paper's definition (Python loops; the
# vectorized implementations are not used). Each returns the list of per-token losses of one
# row given that row's python lists; aggregation is done by `reference_loss`.


def _clip_token(r, A, el, eh, dual=None):
    s = min(r * A, min(max(r, 1 - el), 1 + eh) * A)
    if dual is not None and float(A) < 0:
        s = max(s, dual * A)
    return -s


def ref_clip(lp, old, A, kw):
    return [_clip_token(torch.exp(lp[t] - old[t]), A[t], 0.2, 0.2) for t in range(len(lp))]


def ref_gspo(lp, old, A, kw):
    s = torch.exp(sum(lp[t] - old[t] for t in range(len(lp))) / len(lp))
    return [_clip_token(s, A[t], 0.2, 0.2) for t in range(len(lp))]


def ref_gspo_token(lp, old, A, kw):
    seq = float(sum(float(lp[t] - old[t]) for t in range(len(lp))) / len(lp))
    out = []
    for t in range(len(lp)):
        s = torch.exp(seq + lp[t] - lp[t].detach())  # value exp(seq), gradient of lp[t]
        out.append(_clip_token(s, A[t], 0.2, 0.2))
    return out


def ref_cispo(lp, old, A, kw):
    return [
        -min(math.exp(float(lp[t].detach() - old[t])), 1.2) * A[t] * lp[t] for t in range(len(lp))
    ]


def ref_gmpo(lp, old, A, kw):
    logs = []
    for t in range(len(lp)):
        lr = lp[t] - old[t]
        if A[t] > 0:  # only the increasing side is clipped
            logs.append(torch.clamp(lr, max=0.2))
        elif A[t] < 0:
            logs.append(torch.clamp(lr, min=-0.2))
        else:
            logs.append(lr * 0.0)
    ratio = torch.exp(sum(logs) / len(lp))
    a_row = sum(A) / len(A)
    return [-a_row * ratio for _ in range(len(lp))]


def ref_sapo(lp, old, A, kw):
    out = []
    for t in range(len(lp)):
        tau = 1.0 if A[t] > 0 else 1.05
        r = torch.exp(lp[t] - old[t])
        out.append(-torch.sigmoid(tau * (r - 1)) * 4 / tau * A[t])
    return out


REFERENCES = {"clip": ref_clip, "gspo": ref_gspo, "gspo_token": ref_gspo_token,
              "cispo": ref_cispo, "gmpo": ref_gmpo, "sapo": ref_sapo}  # fmt: skip


def reference_loss(name, lp, old, ref, A, mask, aggregation, beta):
    """float64 loss: per-token policy loss + beta * k3, aggregated by definition."""
    rows, n_tok = [], 0
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not idx:
            rows.append([])
            continue
        pg = REFERENCES[name]([lp[i, t] for t in idx], [old[i, t] for t in idx],
                              [A[i, t] for t in idx], {})  # fmt: skip
        kl = [torch.exp(ref[i, t] - lp[i, t]) - (ref[i, t] - lp[i, t]) - 1 for t in idx]
        rows.append([p + beta * k for p, k in zip(pg, kl)])
        n_tok += len(idx)
    if aggregation == "token_mean":
        return sum(sum(r) for r in rows) / n_tok
    if aggregation == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows if r) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * mask.shape[1])


def test_every_loss_has_a_reference():
    missing = sorted(set(LOSSES) - set(REFERENCES))
    assert not missing, f"register a float64 reference for {missing} in this file"


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
@pytest.mark.parametrize("name", LOSSES)
def test_loss_gradient_equals_float64_reference(name, aggregation):
    x = make_inputs(3, rows=6, width=5)
    x["advantages"][0] = x["advantages"][0].abs()  # a row of positive advantages
    cfg = LossSettings(policy_loss=name, beta=0.05, aggregation=aggregation)
    lp = x["logprobs"].clone().requires_grad_(True)
    loss, _ = policy_loss(lp, x["old_logprobs"], x["ref_logprobs"], x["advantages"], x["mask"], cfg)
    (grad,) = torch.autograd.grad(loss, lp)

    lp64 = x["logprobs"].double().requires_grad_(True)
    want = reference_loss(name, lp64, x["old_logprobs"].double(), x["ref_logprobs"].double(),
                          x["advantages"].double(), x["mask"], aggregation, 0.05)  # fmt: skip
    (grad64,) = torch.autograd.grad(want, lp64)
    assert loss.item() == pytest.approx(want.item(), abs=1e-5)
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_loss_finite_with_masked_rows_and_garbage_at_padding(name):
    x = make_inputs(4)
    x["mask"][2] = False  # a fully-masked row
    clean_loss, clean_grad = _loss_and_grad(name, x)
    dirty = {k: v.clone() for k, v in x.items()}
    for key, bad in (("logprobs", float("nan")), ("old_logprobs", float("inf")),
                     ("ref_logprobs", float("-inf")), ("advantages", float("nan"))):  # fmt: skip
        dirty[key][~x["mask"]] = bad
    loss, grad = _loss_and_grad(name, dirty)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert loss == pytest.approx(clean_loss, abs=1e-6)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=1e-7)
    assert (grad[~x["mask"]] == 0).all()


def _loss_and_grad(name, x, rows=slice(None), normalizer=None):
    cfg = loss_settings(name)
    lp = x["logprobs"][rows].clone().requires_grad_(True)
    loss, _ = policy_loss(lp, x["old_logprobs"][rows], x["ref_logprobs"][rows],
                          x["advantages"][rows], x["mask"][rows], cfg, normalizer=normalizer,
                          max_new_tokens=T)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss), grad


@pytest.mark.parametrize("name", LOSSES)
def test_loss_micro_batches_equal_full_batch(name):
    x = make_inputs(5)
    cfg = loss_settings(name)
    norm = loss_normalizer(x["mask"], cfg.aggregation, T)
    full_loss, full_grad = _loss_and_grad(name, x, normalizer=norm)
    parts = [_loss_and_grad(name, x, rows=sl, normalizer=norm)
             for sl in (slice(0, 4), slice(4, 12), slice(12, B))]  # fmt: skip
    assert sum(p[0] for p in parts) == pytest.approx(full_loss, abs=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), full_grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_zero_on_policy_and_finite(name):
    x = make_inputs(6)
    lp = x["logprobs"]
    assert (kl_penalty(lp, lp, name).abs() < 1e-7).all()
    far = kl_penalty(lp, lp + 1e4, name, log_ratio_clamp=20.0, kl_clamp=10.0)
    assert torch.isfinite(far).all() and (far.abs() <= 10).all()


# ----------------------------------------------------------------------------- two ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("algo_ddp") / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "algo_ddp_worker.py"), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_two_ranks_equal_one_process(two_ranks, name):
    x = make_inputs()
    want = advantages(name, x)
    got = torch.tensor(two_ranks["advantages"][name])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_loss_two_ranks_equal_one_process(two_ranks, name):
    x = make_inputs()
    cfg = loss_settings(name)
    lp = x["logprobs"].clone().requires_grad_(True)
    loss, st = policy_loss(lp, x["old_logprobs"], x["ref_logprobs"], x["advantages"], x["mask"],
                           cfg, max_new_tokens=T)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    assert two_ranks["losses"][name] == pytest.approx(float(loss), abs=1e-6)
    torch.testing.assert_close(torch.tensor(two_ranks["grads"][name]), grad, rtol=0, atol=1e-7)
    want = _single(st)
    got = two_ranks["stats"][name]
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-7), k


def _single(st):
    from grpo.distributed import SINGLE

    sums = StatSums()
    sums.add(st)
    return sums.reduce(SINGLE)
