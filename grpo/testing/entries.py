"""The entries a researcher's plugins register, found by loading them: what the pytest plugin
checks, with the float64 references their modules export."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpo_kernels
from grpo.algo import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES
from grpo.envs import available_envs
from grpo.plugins import load_entry_point_plugins, load_plugins
from grpo.testing.references import BUILTIN_REFERENCES

REFERENCES_ATTR = "CONFORMANCE_REFERENCES"  # {registered name: float64 reference} in a module
SETTINGS_ATTR = "CONFORMANCE_SETTINGS"  # {policy loss name: {loss.* field: value}} in a module


@dataclass(frozen=True)
class Entries:
    """Registered names by kind, and the references to check them against (by name)."""

    plugins: tuple[str, ...] = ()
    advantages: tuple[str, ...] = ()
    policy_losses: tuple[str, ...] = ()
    kl_estimators: tuple[str, ...] = ()
    environments: tuple[str, ...] = ()
    logprob_impls: tuple[str, ...] = ()  # registered log-prob kernels (not the built-ins)
    references: dict[str, Callable | str] = field(default_factory=dict)
    settings: dict[str, dict] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return any(
            (
                self.advantages,
                self.policy_losses,
                self.kl_estimators,
                self.environments,
                self.logprob_impls,
            )
        )


def _registered() -> dict[str, set[str]]:
    return {
        "advantages": set(ADVANTAGES.names()),
        "policy_losses": set(POLICY_LOSSES.names()),
        "kl_estimators": set(KL_ESTIMATORS.names()),
        "environments": set(available_envs()),
        "logprob_impls": set(grpo_kernels.available_impls()) - set(grpo_kernels.IMPLS),
    }


def registered_by(plugins: Sequence[str]) -> Entries:
    """Load `plugins` as every grpo command does (`grpo.plugins.load_plugins`:
    ``package.module`` or ``package.module:function``) and return what they registered: the
    names new after loading them, and the algorithm entries whose function is defined in one of
    their modules (a module imported earlier). No plugins: every registered entry (the
    built-ins and the installed entry-point plugins'; of the log-prob kernels, those
    registered with `grpo_kernels.register_logprob_impl`, the built-ins being the kit's own
    references).

    References: the built-ins' (`BUILTIN_REFERENCES`), updated with each plugin module's
    ``CONFORMANCE_REFERENCES`` dict (a function or its ``package.module:function`` path);
    settings: each plugin module's ``CONFORMANCE_SETTINGS`` (the ``loss.*`` fields a policy
    loss is checked under, beside the kit's variants).

    Raises:
        GrpoError: a plugin failed to load (one line naming it).
    """
    load_entry_point_plugins()  # installed plugins are everywhere: not what is under test
    before = _registered()
    load_plugins(plugins, "--grpo-plugin")
    after = _registered()
    modules = [spec.partition(":")[0] for spec in plugins]
    references, settings = dict(BUILTIN_REFERENCES), {}
    for module in modules:
        references.update(getattr(sys.modules[module], REFERENCES_ATTR, None) or {})
        settings.update(getattr(sys.modules[module], SETTINGS_ATTR, None) or {})
    if not plugins:
        return Entries(
            (), *(tuple(sorted(after[k])) for k in after), references=references, settings=settings
        )
    found = {}
    for key, registry in (
        ("advantages", ADVANTAGES),
        ("policy_losses", POLICY_LOSSES),
        ("kl_estimators", KL_ESTIMATORS),
        ("environments", None),
        ("logprob_impls", None),
    ):
        get = registry.get if registry is not None else None
        if key == "logprob_impls":
            get = grpo_kernels.get_logprob_impl
        defined_here = {
            n
            for n in after[key]
            if get is not None and getattr(get(n), "__module__", None) in modules
        }
        found[key] = tuple(sorted((after[key] - before[key]) | defined_here))
    return Entries(tuple(plugins), references=references, settings=settings, **found)
