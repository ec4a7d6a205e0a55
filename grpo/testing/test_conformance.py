"""The conformance suite over the entries `grpo.testing.plugin` found (one test per check):

    python -m pytest -p grpo.testing.plugin --pyargs grpo.testing --grpo-plugin myalgo.ext

A failure is one line naming the entry and the check (`grpo.testing.ConformanceError`).
"""

from __future__ import annotations

import pytest

from grpo.testing import (
    ConformanceError,
    check_advantage,
    check_environment,
    check_kl,
    check_logprob_impl,
    check_policy_loss,
    check_two_ranks,
)


def _run(check, *args, **kwargs) -> None:
    """`check`, failing the test with the kit's one-line message (no library traceback)."""
    try:
        check(*args, **kwargs)
        return
    except ConformanceError as e:
        failure = str(e)
    pytest.fail(failure, pytrace=False)


def test_advantage(grpo_entries, advantage_check):
    name, check = advantage_check
    _run(check_advantage, name, reference=grpo_entries.references.get(name), checks=[check])


def test_policy_loss(grpo_entries, policy_loss_check):
    name, check = policy_loss_check
    _run(
        check_policy_loss,
        name,
        grpo_entries.references.get(name),
        settings=grpo_entries.settings.get(name),
        checks=[check],
    )


def test_kl(grpo_entries, kl_check):
    name, check = kl_check
    _run(check_kl, name, reference=grpo_entries.references.get(name), checks=[check])


def test_environment(environment_check):
    name, check = environment_check
    _run(check_environment, name, checks=[check])


def test_logprob_impl(logprob_impl_check):
    name, check = logprob_impl_check
    _run(check_logprob_impl, name, checks=[check])


def test_two_ranks(grpo_two_ranks, two_ranks_entry):
    kind, name = two_ranks_entry
    _run(check_two_ranks, kind, name, grpo_two_ranks)
