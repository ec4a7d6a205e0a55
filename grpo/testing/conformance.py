"""The conformance checks, as functions: what every advantage estimator, policy loss and KL
estimator must satisfy, on fixed seeded tensors (no pytest needed).

Each ``check_<kind>(spec, ...)`` runs the named checks that apply to `spec` (a registered name,
a ``package.module:function`` path or the function) and raises `ConformanceError` naming the
entry and the first check that failed; ``<kind>_checks(...)`` lists those check names (for one
test per check). Environments are checked in `grpo.testing.environments`, two ranks against
one process in `grpo.testing.two_ranks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from grpo.algo import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossSettings,
    compute_advantages,
    kl_penalty,
    loss_normalizer,
    policy_loss,
)
from grpo.algo.advantages import EstimatorRollout, wants_rollout

B, G, T = 16, 4, 9  # rows, group size, completion width of the fixed batch
# the batch extras a built-in estimator reads (`check_advantage` fills them for it)
BUILTIN_EXTRAS = {"gae": ("values",), "distill": ("teacher_logprobs",)}
CLAIMS = ("shift_invariant", "group_zero_sum")  # what an estimator may claim (register_advantage)
BETA = 0.05  # the KL weight every loss check runs with (k3 in the loss)
# every policy-loss check runs at the settings given, and again with these on top: a clip
# range that is not symmetric (a swapped epsilon_low / epsilon_high shows) and the dual clip
VARIANTS = {
    "": {},
    "asymmetric": {"epsilon_low": 0.2, "epsilon_high": 0.28},
    "dual_clip": {"dual_clip": 3.0},
}


class ConformanceError(AssertionError):
    """A conformance check failed: ``<kind> <name>: <check> failed: <detail>``."""


def make_inputs(seed: int = 0, rows: int = B, width: int = T) -> dict[str, torch.Tensor]:
    """Seeded (rows, width) tensors: ragged completions (every row >= 1 token, row 0 full width),
    outcome rewards in {0, 1} plus small process rewards, log-probs near each other."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0] = width
    mask = torch.arange(width)[None, :] < lengths[:, None]  # (B, T)
    outcome = (torch.rand(rows, generator=g) > 0.5).float()
    token_rewards = (
        0.1 * torch.randn(rows, width, generator=g) * (torch.rand(rows, width, generator=g) > 0.7)
    )
    token_rewards[torch.arange(rows), lengths - 1] += outcome
    logprobs = -3 * torch.rand(rows, width, generator=g) - 0.05
    old = logprobs + 0.3 * torch.randn(rows, width, generator=g)
    ref = logprobs + 0.5 * torch.randn(rows, width, generator=g)
    advantages = torch.randn(rows, width, generator=g)
    entropy = 2 * torch.rand(rows, width, generator=g)  # drawn last: the others stay as they were
    return {
        "mask": mask,
        "token_rewards": torch.where(mask, token_rewards, 0.0),
        "logprobs": logprobs,
        "old_logprobs": old,
        "ref_logprobs": ref,
        "advantages": advantages,
        "entropy": entropy,
    }


def loss_inputs(x: Mapping[str, torch.Tensor], rows=slice(None)) -> dict[str, Any]:
    """The inputs a loss may declare beyond the basics, as every policy-loss check passes them
    (rows `rows` of `x`): the entropy (fixed: no gradient of its own here), the sampler's
    log-probs equal to pi_old, step 1, no extras."""
    return {
        "entropy": x["entropy"][rows],
        "behaviour_logprobs": x["old_logprobs"][rows],
        "step": 1,
    }


def loss_settings(
    spec: str | Callable,
    kwargs: Mapping | None = None,
    aggregation: str = "seq_mean_token_mean",
    settings: Mapping | None = None,
) -> LossSettings:
    """The loss configuration every check runs a policy loss under (beta = BETA, k3, then
    `settings`: any other `loss.*` field)."""
    base = {
        "policy_loss": spec,
        "policy_loss_kwargs": dict(kwargs or {}),
        "beta": BETA,
        "aggregation": aggregation,
    }
    known = {f.name for f in dataclasses.fields(LossSettings)}
    unknown = sorted(set(settings or {}) - known)
    if unknown:
        raise ValueError(
            f"settings: {unknown} are not loss settings; known: {', '.join(sorted(known))}"
        )
    return LossSettings(**{**base, **(settings or {})})


def resolve(reference: Callable | str | None) -> Callable | None:
    """A reference given as a ``package.module:function`` path, imported; else as it is."""
    if isinstance(reference, str):
        from grpo.plugins import import_callable

        return import_callable(reference, f"reference {reference!r}")
    return reference


def spec_name(spec: Any) -> str:
    """A registered name or path as is, a callable by its qualified name."""
    return spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))


def label(kind: str, spec: Any) -> str:
    """``policy loss 'name'``, for messages."""
    return f"{kind} {spec_name(spec)!r}"


@contextlib.contextmanager
def checking(what: str, check: str) -> Iterator[None]:
    """Re-raise anything raised inside as one ConformanceError naming `what` and `check`."""
    try:
        yield
    except ConformanceError:
        raise
    except Exception as e:  # an assertion, a GrpoError from the library's own checks, a crash
        detail = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
        # one line: a multi-line message (torch.testing.assert_close's) joined with "; "
        detail = "; ".join(line.strip() for line in detail.splitlines() if line.strip())
        raise ConformanceError(f"{what}: {check} failed: {detail}") from e


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def close(got: float, want: float, *, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """|got - want| <= max(rtol * |want|, atol) (pytest.approx's rule; NaN is never close)."""
    return math.isfinite(got) and abs(got - want) <= max(rtol * abs(want), atol)


def run_checks(
    kind: str, spec: Any, table: Mapping[str, Callable[[], None]], checks: Iterable[str]
):
    for check in checks:
        if check not in table:
            raise ValueError(f"unknown {kind} check {check!r}; known: {', '.join(table)}")
        with checking(label(kind, spec), check):
            table[check]()


# ----------------------------------------------------------------------------- estimators


def kit_rollout(spec, mask: torch.Tensor, names: Iterable[str]) -> EstimatorRollout | None:
    """The `EstimatorRollout` of the kit's batch for an estimator that declares `rollout`
    (None for one that does not): its extras `names` seeded (B, T) values, NaN in the columns
    past T (the padding check's)."""
    if not wants_rollout(spec):
        return None
    rows, width = mask.shape
    g = torch.Generator().manual_seed(11)
    made = {n: torch.randn(rows, T, generator=g) for n in names}
    made = {
        n: torch.nn.functional.pad(v, (0, width - T), value=float("nan")) for n, v in made.items()
    }
    return EstimatorRollout(
        completion_ids=torch.where(mask, 5, 0),
        completion_mask=mask,
        generated_mask=mask,
        turn_ids=torch.where(mask, 0, -1),
        logprobs=torch.where(mask, -1.0, 0.0),
        prompt_lens=torch.full((rows,), 3),
        extras=made,
    )


def advantage_checks(spec: str | Callable, reference: Callable | None = None) -> list[str]:
    """The checks that apply to an estimator: its claims switch on the claimed properties."""
    claims = ADVANTAGES.claims(spec) if isinstance(spec, str) else frozenset()
    checks = ["claims", "shape_and_equal_groups", "masked_rows_and_padding"]
    checks += [c for c in CLAIMS if c in claims]  # a claim's check has the claim's name
    return checks + (["reference"] if reference is not None else [])


def check_advantage(
    spec: str | Callable,
    *,
    reference: Callable | None = None,
    kwargs: Mapping | None = None,
    checks: Iterable[str] | None = None,
    extras: Iterable[str] | None = None,
) -> None:
    """Check an advantage estimator; raises ConformanceError naming the failed check.

    Args:
        spec: a registered name, a ``package.module:function`` path or the function.
        reference: optional float64 twin with the estimator's signature (same input names);
            its (B, T_c) result must agree within 1e-5 on the counted tokens.
        kwargs: ``loss.advantage_kwargs`` for the estimator.
        checks: the checks to run (default: `advantage_checks(spec, reference)`): claims (only
            known claims), shape_and_equal_groups, masked_rows_and_padding, shift_invariant,
            group_zero_sum (the claimed properties), reference.
        extras: names of (B, T_c) per-row tensors the estimator reads from its `rollout`
            (e.g. a critic's ``values``): an estimator that declares `rollout` gets an
            `EstimatorRollout` of the kit's batch with these filled with seeded values (the
            padding check pads them with NaN, as it pads the rewards). Default: what a
            built-in reads (`BUILTIN_EXTRAS`), else none.
    """

    reference = resolve(reference)
    if extras is None:
        extras = BUILTIN_EXTRAS.get(spec, ()) if isinstance(spec, str) else ()
    names = tuple(extras)

    def rollout_of(x: Mapping[str, torch.Tensor]) -> EstimatorRollout | None:
        return kit_rollout(spec, x["mask"], names)

    def adv(x: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return compute_advantages(
            spec, x["token_rewards"], x["mask"], group_size=G, params=kwargs, rollout=rollout_of(x)
        )

    def claims():
        unknown = sorted(ADVANTAGES.claims(spec) - set(CLAIMS)) if isinstance(spec, str) else []
        expect(not unknown, f"unknown claims {unknown}; known: {', '.join(CLAIMS)}")

    def shape_and_equal_groups():
        x = make_inputs()
        a = adv(x)
        expect(a.shape == (B, T) and a.dtype == torch.float32, f"got {a.shape} {a.dtype}")
        expect(bool(torch.isfinite(a).all()), "non-finite advantages")
        expect(bool((a[~x["mask"]] == 0).all()), "non-zero outside the mask")
        # all-equal rewards in every group: finite (no 0/0), and no signal for the zero-sum ones
        same = dict(x, token_rewards=torch.zeros(B, T))
        same["token_rewards"][torch.arange(B), x["mask"].sum(-1) - 1] = 1.0
        a = adv(same)
        expect(bool(torch.isfinite(a).all()), "non-finite advantages on all-equal groups")
        if "group_zero_sum" in (ADVANTAGES.claims(spec) if isinstance(spec, str) else ()):
            expect(bool((a == 0).all()), "claims group_zero_sum but all-equal groups get != 0")

    def masked_rows_and_padding():
        x = make_inputs()
        x["mask"][3] = False  # a row with no counted token
        x["token_rewards"][3] = 0.0
        a = adv(x)
        expect(
            bool(torch.isfinite(a).all()) and bool((a[3] == 0).all()),
            "a fully-masked row gets a non-finite or non-zero advantage",
        )
        # padding columns with garbage (masked) change nothing: ranks pad to the longest T_c
        pad = 5
        wide = {
            "mask": torch.nn.functional.pad(x["mask"], (0, pad), value=False),
            "token_rewards": torch.nn.functional.pad(
                x["token_rewards"], (0, pad), value=float("nan")
            ),
        }
        b = adv(wide)
        torch.testing.assert_close(b[:, :T], a, rtol=0, atol=1e-6)
        expect(bool((b[:, T:] == 0).all()), "padding columns get non-zero advantages")

    def shift_invariant():
        x = make_inputs(1)
        shifted = x["token_rewards"].clone()
        shifted[torch.arange(B), x["mask"].sum(-1) - 1] += 3.5  # +c on every outcome reward
        torch.testing.assert_close(adv(dict(x, token_rewards=shifted)), adv(x), rtol=0, atol=1e-5)

    def group_zero_sum():
        x = make_inputs(2)
        per_row = adv(x)[torch.arange(B), x["mask"].sum(-1) - 1]  # the row's (constant) value
        sums = per_row.view(-1, G).sum(-1)
        tol = 1e-5
        bad = (sums.abs() > tol).nonzero().flatten().tolist()
        expect(
            not bad,
            f"group {bad[0] if bad else -1} of {G} rows sums to "
            f"{float(sums[bad[0]]) if bad else 0.0:.3g} (tolerance {tol:g}); "
            f"{len(bad)} of {B // G} groups miss it",
        )

    def reference_check():
        expect(reference is not None, "no float64 reference was given")
        x = make_inputs(7)
        rewards = x["token_rewards"].double()
        inputs = {
            "token_rewards": rewards,
            "scores": rewards.sum(-1),
            "mask": x["mask"],
            "group_size": G,
            "eps": 1e-4,
            "gamma": 1.0,
            "turn_ids": torch.zeros(B, T, dtype=torch.long),
            "turn_gamma": 1.0,
            "gae_lambda": 1.0,
            "rollout": rollout_of(x),
            **(kwargs or {}),
        }
        want = ADVANTAGES.call(reference, inputs)  # (B, T_c), like the estimator
        m = x["mask"]
        torch.testing.assert_close(adv(x).double()[m], want.double()[m], rtol=1e-5, atol=1e-5)

    table = {
        "claims": claims,
        "shape_and_equal_groups": shape_and_equal_groups,
        "masked_rows_and_padding": masked_rows_and_padding,
        "shift_invariant": shift_invariant,
        "group_zero_sum": group_zero_sum,
        "reference": reference_check,
    }
    run_checks(
        "advantage estimator",
        spec,
        table,
        advantage_checks(spec, reference) if checks is None else checks,
    )


# ----------------------------------------------------------------------------- policy losses


def policy_loss_checks(spec: str | Callable | None = None) -> list[str]:
    """The checks of a policy loss (the same for every one): the gradient against its float64
    reference under each aggregation, NaN/inf at masked positions, padding columns,
    micro-batches; each at the settings given and at every `VARIANTS` entry
    (``gradient:token_mean@asymmetric``, ``micro_batches@dual_clip``, ...)."""
    base = [f"gradient:{a}" for a in AGGREGATIONS] + [
        "masked_garbage",
        "padding_columns",
        "micro_batches",
    ]
    return [f"{c}@{v}" if v else c for v in VARIANTS for c in base]


def check_policy_loss(
    spec: str | Callable,
    reference: Callable | str | None,
    *,
    kwargs: Mapping | None = None,
    settings: Mapping | None = None,
    checks: Iterable[str] | None = None,
) -> None:
    """Check a policy loss; raises ConformanceError naming the failed check.

    Args:
        spec: a registered name, a ``package.module:function`` path or the function.
        reference: the float64 twin, written from the definition, with the loss's signature
            (inputs by name, see `grpo.algo.policy_losses`), or its ``package.module:function``
            path; called on float64 tensors (masked positions hold 0), it returns the (B, T_c)
            per-token loss (or (loss, stats)). Required by the gradient checks.
        kwargs: ``loss.policy_loss_kwargs``, passed to both.
        settings: other ``loss.*`` fields (``epsilon_low``, ``epsilon_high``, ``dual_clip``,
            ...): the loss and its reference get them (default: the config's defaults).
        checks: the checks to run (default: all of `policy_loss_checks()`):
            gradient:<aggregation> (loss within 1e-5, gradient rtol 1e-5 / atol 1e-6 of the
            reference + beta * k3 aggregated by definition), masked_garbage (a fully-masked
            row and NaN/inf at masked positions change nothing, zero gradient there),
            padding_columns (masked columns appended change nothing: the loss reads only the
            counted tokens), micro_batches (three micro-batches sum to the full batch's loss and
            gradient); a ``@variant`` suffix runs it with `VARIANTS[variant]` on top of
            `settings`.
    """
    reference = resolve(reference)
    loss_settings(spec, kwargs, settings=settings)  # an unknown setting: a ValueError now

    def run(check: str) -> None:
        name, _, variant = check.partition("@")
        if variant not in VARIANTS:
            raise ValueError(
                f"unknown settings variant {variant!r}; known: "
                f"{', '.join(v for v in VARIANTS if v)}"
            )
        chosen = {**(settings or {}), **VARIANTS[variant]}
        try:
            table(chosen)[name]()
        except AssertionError as e:
            shown = ", ".join(f"{k}={v}" for k, v in chosen.items())
            raise AssertionError(f"{e} (at {shown})" if shown else str(e)) from None

    def table(chosen: Mapping) -> dict[str, Callable[[], None]]:
        def loss_and_grad(x, rows=slice(None), normalizer=None, aggregation="seq_mean_token_mean"):
            cfg = loss_settings(spec, kwargs, aggregation, chosen)
            lp = x["logprobs"][rows].clone().requires_grad_(True)
            width = x["mask"].shape[1]
            loss, _ = policy_loss(
                lp,
                x["old_logprobs"][rows],
                x["ref_logprobs"][rows],
                x["advantages"][rows],
                x["mask"][rows],
                cfg,
                normalizer=normalizer,
                max_new_tokens=width,
                **loss_inputs(x, rows),
            )
            (grad,) = torch.autograd.grad(loss, lp)
            return loss.item(), grad

        def gradient(aggregation: str):
            expect(
                reference is not None,
                "no float64 reference was given: pass the loss's "
                "float64 twin (the pytest entry: CONFORMANCE_REFERENCES in the plugin "
                "module)",
            )
            x = make_inputs(3, rows=6, width=5)
            x["advantages"][0] = x["advantages"][0].abs()  # a row of positive advantages
            loss, grad = loss_and_grad(x, aggregation=aggregation)
            lp64 = x["logprobs"].double().requires_grad_(True)
            want = reference_loss(reference, lp64, x, aggregation, kwargs, chosen)
            (grad64,) = torch.autograd.grad(want, lp64)
            if not close(loss, want.item(), atol=1e-5):
                why = _diagnose(loss, want.item(), lp64, x, aggregation)
                raise AssertionError(f"loss {loss:.8g}, its reference {want.item():.8g}{why}")
            torch.testing.assert_close(grad.double(), grad64, rtol=1e-5, atol=1e-6)

        def _diagnose(loss, want, lp64, x, aggregation) -> str:
            """What a mismatch looks like, where it looks like a known mistake."""
            negated = reference_loss(
                reference, lp64.detach(), x, aggregation, kwargs, chosen, negate=True
            )
            if close(loss, negated.item(), atol=1e-6):
                return ": its per-token loss is the negative of its reference's (a flipped sign)"
            pad = {
                k: torch.nn.functional.pad(v, (0, 3), value=False if k == "mask" else 0.0)
                for k, v in x.items()
            }
            if not close(
                loss_and_grad(pad, aggregation=aggregation)[0], loss, rtol=1e-6, atol=1e-7
            ):
                return (
                    ": it also changes when masked (padding) columns are appended: it reads "
                    "padding (a mean over every column instead of the counted tokens?)"
                )
            el, eh = chosen.get("epsilon_low", 0.2), chosen.get("epsilon_high", 0.2)
            if el != eh:
                swapped = {**chosen, "epsilon_low": eh, "epsilon_high": el}
                other = reference_loss(reference, lp64.detach(), x, aggregation, kwargs, swapped)
                if close(loss, other.item(), atol=1e-6):
                    return ": it equals the reference with epsilon_low and epsilon_high swapped"
            return ""

        def masked_garbage():
            x = make_inputs(4)
            x["mask"][2] = False  # a fully-masked row
            clean_loss, clean_grad = loss_and_grad(x)
            dirty = {k: v.clone() for k, v in x.items()}
            garbage = {
                "logprobs": float("nan"),
                "old_logprobs": float("inf"),
                "ref_logprobs": float("-inf"),
                "advantages": float("nan"),
                "entropy": float("nan"),
            }
            for key, bad in garbage.items():
                dirty[key][~x["mask"]] = bad
            loss, grad = loss_and_grad(dirty)
            expect(
                math.isfinite(loss) and bool(torch.isfinite(grad).all()),
                "NaN/inf at masked positions reach the loss or its gradient",
            )
            expect(
                close(loss, clean_loss, atol=1e-6), "NaN/inf at masked positions change the loss"
            )
            torch.testing.assert_close(grad, clean_grad, rtol=0, atol=1e-7)
            expect(bool((grad[~x["mask"]] == 0).all()), "non-zero gradient at masked positions")

        def padding_columns():
            x = make_inputs(9)
            pad = 4
            wide = {
                k: torch.nn.functional.pad(v, (0, pad), value=False if k == "mask" else 0.0)
                for k, v in x.items()
            }
            for agg in ("token_mean", "seq_mean_token_mean"):  # normalizers without the width
                loss, grad = loss_and_grad(x, aggregation=agg)
                loss_w, grad_w = loss_and_grad(wide, aggregation=agg)
                expect(
                    close(loss_w, loss, rtol=1e-6, atol=1e-7),
                    f"{pad} masked (padding) columns appended change the {agg} loss from "
                    f"{loss:.8g} to {loss_w:.8g}: the loss reads padding (a mean over every "
                    "column instead of the counted tokens?)",
                )
                torch.testing.assert_close(grad_w[:, :T], grad, rtol=1e-5, atol=1e-7)

        def micro_batches():
            x = make_inputs(5)
            norm = loss_normalizer(x["mask"], "seq_mean_token_mean", T)
            full_loss, full_grad = loss_and_grad(x, normalizer=norm)
            parts = [
                loss_and_grad(x, rows=sl, normalizer=norm)
                for sl in (slice(0, 4), slice(4, 12), slice(12, B))
            ]
            total = sum(p[0] for p in parts)
            expect(
                close(total, full_loss, atol=1e-6),
                f"micro-batches sum to {total:.8g}, the full batch to {full_loss:.8g}",
            )
            torch.testing.assert_close(
                torch.cat([p[1] for p in parts]), full_grad, rtol=0, atol=1e-7
            )

        out: dict[str, Callable[[], None]] = {
            f"gradient:{a}": (lambda a=a: gradient(a)) for a in AGGREGATIONS
        }
        out.update(
            masked_garbage=masked_garbage,
            padding_columns=padding_columns,
            micro_batches=micro_batches,
        )
        return out

    wanted = policy_loss_checks(spec) if checks is None else list(checks)
    known = {c.partition("@")[0] for c in policy_loss_checks(spec)}
    runners = {
        c: (lambda c=c: run(c))
        for c in wanted
        if c.partition("@")[0] in known and c.partition("@")[2] in VARIANTS
    }
    for c in wanted:
        if c not in runners:
            variants = ", ".join(v for v in VARIANTS if v)
            raise ValueError(
                f"unknown policy loss check {c!r}; known: {', '.join(sorted(known))}"
                f" (with an optional @variant: {variants})"
            )
    run_checks("policy loss", spec, runners, wanted)


def reference_loss(
    reference: Callable,
    logprobs: torch.Tensor,
    x: Mapping[str, torch.Tensor],
    aggregation: str,
    kwargs: Mapping | None = None,
    settings: Mapping | None = None,
    negate: bool = False,
) -> torch.Tensor:
    """The float64 objective: `reference` on float64 inputs (0 at masked positions, as the
    library hands them to a loss; log_ratio unclamped) + BETA * k3, aggregated by definition;
    the clip settings from `settings` (else the config's defaults). `negate`: the reference's
    per-token loss with its sign flipped (what a flipped sign in the loss gives)."""
    from grpo.testing.references import reference_objective

    mask = x["mask"]
    lp = torch.where(mask, logprobs, 0.0)
    old = torch.where(mask, x["old_logprobs"].double(), 0.0)
    cfg = LossSettings(
        **{
            k: v
            for k, v in (settings or {}).items()
            if k in ("epsilon_low", "epsilon_high", "dual_clip")
        }
    )
    inputs = {
        "logprobs": lp,
        "old_logprobs": old,
        "log_ratio": lp - old,
        "advantages": torch.where(mask, x["advantages"].double(), 0.0),
        "mask": mask,
        "epsilon_low": cfg.epsilon_low,
        "epsilon_high": cfg.epsilon_high,
        "dual_clip": cfg.dual_clip,
        "entropy": torch.where(mask, x["entropy"].double(), 0.0),
        "behaviour_logprobs": old,
        "extras": {},
        "step": 1,
        **(kwargs or {}),
    }
    out = POLICY_LOSSES.call(reference, inputs)
    pg = out[0] if isinstance(out, tuple) else out
    pg = -pg if negate else pg
    return reference_objective(pg, logprobs, x["ref_logprobs"].double(), mask, aggregation, BETA)


# ----------------------------------------------------------------------------- KL estimators


def kl_checks(spec: str | Callable | None = None, reference: Callable | None = None) -> list[str]:
    """The checks of a KL estimator (`reference` only with a reference)."""
    return ["zero_on_policy_and_clamped"] + (["reference"] if reference is not None else [])


def check_kl(
    spec: str | Callable, *, reference: Callable | None = None, checks: Iterable[str] | None = None
) -> None:
    """Check a KL estimator ``fn(logprobs, ref_logprobs) -> (B, T_c)``: zero on-policy, finite
    and within the clamps far from it; with a float64 `reference` (same signature, or its
    ``package.module:function`` path), values and gradient within 1e-5. Raises
    ConformanceError naming the failed check."""
    reference = resolve(reference)

    def zero_on_policy_and_clamped():
        lp = make_inputs(6)["logprobs"]
        expect(bool((kl_penalty(lp, lp, spec).abs() < 1e-7).all()), "non-zero on-policy")
        far = kl_penalty(lp, lp + 1e4, spec, log_ratio_clamp=20.0, kl_clamp=10.0)
        expect(
            bool(torch.isfinite(far).all()) and bool((far.abs() <= 10).all()),
            "non-finite or outside the clamp far from the reference",
        )

    def reference_check():
        expect(reference is not None, "no float64 reference was given")
        x = make_inputs(8)
        lp = x["logprobs"].clone().requires_grad_(True)
        lp64 = x["logprobs"].double().requires_grad_(True)
        got = KL_ESTIMATORS.call(spec, {"logprobs": lp, "ref_logprobs": x["ref_logprobs"]})
        ref64 = x["ref_logprobs"].double()
        want = KL_ESTIMATORS.call(reference, {"logprobs": lp64, "ref_logprobs": ref64})
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
        (g,) = torch.autograd.grad(got.sum(), lp)
        (g64,) = torch.autograd.grad(want.sum(), lp64)
        torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-5)

    table = {"zero_on_policy_and_clamped": zero_on_policy_and_clamped, "reference": reference_check}
    run_checks(
        "KL estimator", spec, table, kl_checks(spec, reference) if checks is None else checks
    )
