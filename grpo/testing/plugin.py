"""The conformance kit's pytest plugin: one test per check of each entry that the plugins
named by ``--grpo-plugin`` register (every registered entry when none is named).

    python -m pytest -p grpo.testing.plugin --pyargs grpo.testing --grpo-plugin myalgo.ext

The tests are `grpo/testing/test_conformance.py`; a module's ``CONFORMANCE_REFERENCES``
(registered name -> float64 reference) supplies the references (`grpo.testing.entries`).
"""

from __future__ import annotations

import pytest

from grpo.errors import GrpoError
from grpo.testing.entries import Entries, registered_by

ENTRIES = pytest.StashKey[Entries]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("grpo", "grpo conformance kit (grpo.testing)")
    group.addoption(
        "--grpo-plugin",
        action="append",
        default=[],
        metavar="PLUGIN",
        help="a plugin (package.module or package.module:function, as grpo's --plugin) whose "
        "registered estimators, policy losses, KL estimators, environments and log-prob "
        "kernels are checked; "
        "repeatable, or comma-separated. None: every registered entry (the built-ins).",
    )


def pytest_configure(config: pytest.Config) -> None:
    specs = [m.strip() for opt in config.getoption("grpo_plugin") for m in opt.split(",")]
    plugins = [m for m in specs if m]
    try:
        entries = registered_by(plugins)
    except GrpoError as e:
        raise pytest.UsageError(str(e)) from None
    if plugins and not entries:
        raise pytest.UsageError(
            f"--grpo-plugin {','.join(plugins)}: registered no advantage estimator, policy "
            "loss, KL estimator, environment or log-prob kernel (register them when the "
            "module is imported)"
        )
    config.stash[ENTRIES] = entries


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from grpo.testing import (
        advantage_checks,
        environment_checks,
        kl_checks,
        logprob_impl_checks,
        policy_loss_checks,
    )

    entries = metafunc.config.stash.get(ENTRIES, None)
    if entries is None:
        return
    refs = entries.references
    cases = {
        "advantage_check": [
            (n, c) for n in entries.advantages for c in advantage_checks(n, refs.get(n))
        ],
        "policy_loss_check": [(n, c) for n in entries.policy_losses for c in policy_loss_checks(n)],
        "kl_check": [(n, c) for n in entries.kl_estimators for c in kl_checks(n, refs.get(n))],
        "environment_check": [(n, c) for n in entries.environments for c in environment_checks(n)],
        "logprob_impl_check": [
            (n, c) for n in entries.logprob_impls for c in logprob_impl_checks()
        ],
        "two_ranks_entry": [("advantage", n) for n in entries.advantages]
        + [("policy_loss", n) for n in entries.policy_losses],
    }
    for fixture, values in cases.items():
        if fixture in metafunc.fixturenames:
            ids = [f"{a}-{b}" for a, b in values]
            metafunc.parametrize(fixture, values, ids=ids)


@pytest.fixture(scope="session")
def grpo_entries(pytestconfig: pytest.Config) -> Entries:
    """The entries under test and their references."""
    return pytestconfig.stash[ENTRIES]


@pytest.fixture(scope="session")
def grpo_two_ranks(grpo_entries: Entries) -> dict:
    """One two-rank torchrun job over every estimator and policy loss under test."""
    from grpo.testing import run_two_ranks

    return run_two_ranks(
        advantages=grpo_entries.advantages,
        losses=grpo_entries.policy_losses,
        plugins=grpo_entries.plugins,
    )
