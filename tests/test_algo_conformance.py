"""Conformance: every *registered* advantage estimator, policy loss and KL estimator passes the
same checks, so a new variant is tested the moment it is registered. The checks are the public
kit's (`grpo.testing`, which researchers run on their own modules); this file runs them over
the registry and pins what the built-ins must keep (their claims, their references).

Estimators: finite on all-equal groups and fully-masked rows, zero outside the mask, padding
columns change nothing, shift invariance / group zero-sum where the entry claims it
(`register_advantage(..., claims=...)`), two gloo ranks equal one process.
Policy losses: finite with fully-masked rows and NaN/inf at masked positions, gradient equal to
a slow float64 reference written from the paper's definition (`grpo.testing.references`),
micro-batches equal the full batch, two gloo ranks equal one process (loss, gradient and
reduced stats). KL estimators: zero on-policy, finite and clamped far from it.
"""

from __future__ import annotations

import pytest

from grpo.algo import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES
from grpo.testing import (
    BUILTIN_REFERENCES,
    advantage_checks,
    check_advantage,
    check_kl,
    check_policy_loss,
    check_two_ranks,
    policy_loss_checks,
)
from grpo.testing.two_ranks import two_ranks_spec, with_kwargs

ESTIMATORS = ADVANTAGES.names()
LOSSES = POLICY_LOSSES.names()


@pytest.mark.parametrize("name,check", [(n, c) for n in ESTIMATORS for c in advantage_checks(n)])
def test_estimator(name, check):
    check_advantage(name, checks=[check])


def test_every_builtin_claims_what_it_should():
    # a claim that silently disappeared would switch a check off: pin the built-ins' claims
    assert ADVANTAGES.claims("grpo") == {"shift_invariant", "group_zero_sum"}
    assert ADVANTAGES.claims("rloo") == {"shift_invariant", "group_zero_sum"}
    assert "group_zero_sum" not in ADVANTAGES.claims("opo")


def test_every_loss_has_a_reference():
    missing = sorted(set(LOSSES) - set(BUILTIN_REFERENCES))
    assert not missing, f"add a float64 reference for {missing} to grpo/testing/references.py"


@pytest.mark.parametrize("name,check", [(n, c) for n in LOSSES for c in policy_loss_checks(n)])
def test_policy_loss(name, check):
    check_policy_loss(name, BUILTIN_REFERENCES.get(name), checks=[check])


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator(name):
    check_kl(name)


@pytest.fixture(scope="module")
def two_ranks(rank_pool):
    # `run_two_ranks`' job for every entry, in the session's ranks instead of a torchrun launch
    spec = two_ranks_spec(ESTIMATORS, LOSSES)
    [result, _] = rank_pool.run("grpo.testing.two_ranks_worker:run_rank", spec)
    return with_kwargs(result, spec)


@pytest.mark.parametrize(
    "kind,name", [("advantage", n) for n in ESTIMATORS] + [("policy_loss", n) for n in LOSSES]
)
def test_two_ranks_equal_one_process(two_ranks, kind, name):
    check_two_ranks(kind, name, two_ranks)
