"""The conformance kit: the checks the suite applies to the built-in advantage estimators,
policy losses, KL estimators and environments, as functions for your own entries, and a pytest
entry that runs them over the entries your modules register (docs/extending.md).

    python -m pytest -p grpo.testing.plugin --pyargs grpo.testing --grpo-plugin myalgo.ext

Functions (each raises `ConformanceError` naming the entry and the failed check):
`check_advantage`, `check_policy_loss` (against a float64 reference you pass in),
`check_kl`, `check_environment`, `check_logprob_impl` (a fused log-prob kernel against
float64 torch), `check_two_ranks` (two gloo ranks under torchrun = one
process; `run_two_ranks` runs many entries in one job). Optional: nothing in the core imports
this package, and only the pytest entry (`grpo.testing.plugin`) needs pytest.
"""

from grpo.testing.conformance import (
    ConformanceError,
    advantage_checks,
    check_advantage,
    check_kl,
    check_policy_loss,
    kl_checks,
    make_inputs,
    policy_loss_checks,
)
from grpo.testing.entries import Entries, registered_by
from grpo.testing.environments import check_environment, environment_checks
from grpo.testing.kernels import check_logprob_impl, logprob_impl_checks
from grpo.testing.references import BUILTIN_REFERENCES, per_row
from grpo.testing.two_ranks import check_two_ranks, run_two_ranks

__all__ = [
    "BUILTIN_REFERENCES",
    "ConformanceError",
    "Entries",
    "advantage_checks",
    "check_advantage",
    "check_environment",
    "check_kl",
    "check_logprob_impl",
    "check_policy_loss",
    "check_two_ranks",
    "environment_checks",
    "kl_checks",
    "logprob_impl_checks",
    "make_inputs",
    "per_row",
    "policy_loss_checks",
    "registered_by",
    "run_two_ranks",
]
