"""Name -> function registries for the algorithm's plug-in points, and keyword binding.

A variant is one function plus one decorator:

    @register_advantage("my_adv")
    def my_adv(scores, mask, *, group_size, eps): ...

Configs select it by name (``loss.advantage: my_adv``) or by ``package.module:function``
(imported on first use, no registration needed). A registered function declares the inputs it
wants by parameter name; `call` passes only those (unless it takes ``**kwargs``), so adding an
input later never breaks an existing variant. The inputs each registry offers are listed in
`grpo.algo.advantages`, `grpo.algo.policy_losses` and `grpo.algo.kl`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from grpo.errors import GrpoError
from grpo.plugins import import_callable, no_exit, note_replacement


class Registry:
    """Functions of one kind (e.g. "advantage estimator") by name."""

    def __init__(self, kind: str, config_key: str):
        self.kind = kind  # for messages: "advantage estimator"
        self.config_key = config_key  # for messages: "loss.advantage"
        self._fns: dict[str, Callable[..., Any]] = {}
        self._claims: dict[str, frozenset[str]] = {}

    def register(self, name: str, *, overwrite: bool = False, claims: tuple[str, ...] = ()):
        """Decorator: make the function available as `name`.

        `claims` are properties the conformance kit (`grpo.testing`) then checks for this
        entry, e.g. "shift_invariant" or "group_zero_sum" for estimators. Replacing another
        function (`overwrite`) is logged and recorded in the run's metadata
        (`grpo.plugins.note_replacement`)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise GrpoError(f"{self.kind} name must be a non-empty string without ':': {name!r}")

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if not callable(fn):
                raise GrpoError(f"{self.kind} {name!r}: expected a function, got {type(fn)}")
            old = self._fns.get(name)
            if old is not None and old is not fn:
                if not overwrite:
                    raise GrpoError(
                        f"{self.kind} {name!r} is already registered; pass "
                        "overwrite=True to replace it"
                    )
                note_replacement(self.kind, name, old, fn)
            self._fns[name] = fn
            self._claims[name] = frozenset(claims)
            return fn

        return deco

    def names(self) -> list[str]:
        return sorted(self._fns)

    def claims(self, name: str) -> frozenset[str]:
        """The properties `name` was registered with."""
        return self._claims.get(name, frozenset())

    def get(self, spec: str | Callable[..., Any]) -> Callable[..., Any]:
        """The function for a registered name, a ``package.module:function`` path or a callable."""
        if callable(spec):
            return spec
        if not isinstance(spec, str):
            raise GrpoError(f"{self.config_key}: expected a name, got {spec!r}")
        if spec in self._fns:
            return self._fns[spec]
        if ":" in spec:
            return import_callable(spec, f"{self.config_key}: {spec!r}")
        raise GrpoError(
            f"{self.config_key}: unknown {self.kind} {spec!r}; registered: "
            f"{', '.join(self.names())} (or a 'package.module:function' path)"
        )

    def declares(self, spec: str | Callable[..., Any], name: str) -> bool:
        """Whether the function of `spec` receives the input `name` from `call`: it names the
        parameter, or takes ``**kwargs`` (an input that costs something to compute, such as a
        differentiable entropy, is computed only then)."""
        sig = _signature(self.get(spec))
        if sig is None:
            return True
        params = sig.parameters
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def check_params(self, spec: str, params: Mapping[str, Any], offered: set[str]) -> None:
        """Fail now, naming the key, if `params` holds a name the function does not accept or
        if the function needs an argument that neither the registry nor `params` provides."""
        fn = self.get(spec)
        sig = _signature(fn)
        if sig is None:
            return
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        names = [n for n, p in sig.parameters.items() if p.kind not in variadic]
        if not accepts_any:
            for key in params:
                if key not in names:
                    raise GrpoError(
                        f"{self.config_key}_kwargs: {key!r} is not a parameter of {self.kind} "
                        f"{spec!r} (parameters: {', '.join(names) or 'none'})"
                    )
        for n, p in sig.parameters.items():
            missing = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            if missing and n not in offered and n not in params:
                raise GrpoError(
                    f"{self.config_key}: {self.kind} {spec!r} needs argument {n!r}, which is not "
                    f"an input ({', '.join(sorted(offered))}); set it in {self.config_key}_kwargs"
                )

    def call(self, spec: str | Callable[..., Any], inputs: Mapping[str, Any]) -> Any:
        """Call the function with the subset of `inputs` its signature names.

        A plug-in (any function not defined in `grpo`) that raises is a GrpoError naming it:
        ``advantage estimator 'mymod:fn' raised ValueError: ...`` (the original chained); a
        built-in's exception propagates as it is (a bug of ours keeps its traceback)."""
        fn = self.get(spec)
        sig = _signature(fn)
        if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            inputs = {k: v for k, v in inputs.items() if k in sig.parameters}
        name = spec if isinstance(spec, str) else getattr(fn, "__name__", repr(fn))
        try:
            with no_exit(f"{self.kind} {name!r}"):
                return fn(**inputs)
        except GrpoError:
            raise
        except Exception as e:
            if _is_builtin(fn):
                raise
            raise GrpoError(f"{self.kind} {name!r} raised {type(e).__name__}: {e}") from e


def _is_builtin(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is one of the package's own functions (not a user's plug-in)."""
    module = getattr(fn, "__module__", None) or ""
    return module == "grpo" or module.startswith("grpo.")


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return None


ADVANTAGES = Registry("advantage estimator", "loss.advantage")
POLICY_LOSSES = Registry("policy loss", "loss.policy_loss")
KL_ESTIMATORS = Registry("KL estimator", "loss.kl_estimator")


# estimator function -> the metric it minimises (`register_advantage(..., minimises=...)`)
_OBJECTIVES: dict[Callable[..., Any], str] = {}


def register_advantage(
    name: str,
    *,
    overwrite: bool = False,
    claims: tuple[str, ...] = (),
    minimises: str | None = None,
):
    """Decorator: an advantage estimator selectable as ``loss.advantage: name``.

    The function returns (B, T_c) advantages, optionally with metrics and with extras for the
    policy loss (see `grpo.algo.advantages` for its inputs and what it may return).
    claims: properties the conformance suite checks: "shift_invariant" (adding a constant to
    every reward changes nothing), "group_zero_sum" (each group's per-row advantages sum to 0).
    minimises: the metric the estimator reports (``advantage/<minimises>``) that falls as the
    run learns (a distillation's reverse KL): the learning-health check judges the run by it
    instead of by the rewards (grpo.run.health).
    """
    if minimises is not None and (not isinstance(minimises, str) or not minimises):
        raise GrpoError(f"advantage estimator {name!r}: minimises must be a metric name")
    register = ADVANTAGES.register(name, overwrite=overwrite, claims=claims)

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        register(fn)
        if minimises is not None:
            _OBJECTIVES[fn] = minimises
        return fn

    return deco


def estimator_objective(spec: str | Callable[..., Any]) -> str | None:
    """The metric the estimator `spec` declared it minimises (`register_advantage`), or None."""
    try:
        return _OBJECTIVES.get(ADVANTAGES.get(spec))
    except GrpoError:
        return None


def register_policy_loss(name: str, *, overwrite: bool = False):
    """Decorator: a policy loss selectable as ``loss.policy_loss: name``.

    The function returns (B, T_c) per-token losses, optionally with a dict of (B, T_c)
    per-token stats (see `grpo.algo.policy_losses` for its inputs)."""
    return POLICY_LOSSES.register(name, overwrite=overwrite)


def register_kl(name: str, *, overwrite: bool = False):
    """Decorator: a KL estimator ``fn(logprobs, ref_logprobs) -> (B, T_c)`` selectable as
    ``loss.kl_estimator: name``."""
    return KL_ESTIMATORS.register(name, overwrite=overwrite)
