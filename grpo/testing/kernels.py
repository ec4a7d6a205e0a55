"""Conformance checks for a fused log-prob kernel (`grpo_kernels.register_logprob_impl`, or a
``package.module:function``): forward and backward against float64 torch, where the error
must be no worse than the same-dtype torch reference's plus a tolerance (the pattern of Cut
Cross-Entropy's tests), in every mode the trainer uses.

    check_logprob_impl("my_kernel")                     # every check, float32 and bfloat16
    check_logprob_impl("my_pkg.k:logprobs", dtypes=(torch.float32,), checks=["forward"])

Checks (each at every dtype; shapes whose N and V are not multiples of any block size, V
below and above the usual 256-4096 blocks):

    forward        log-probs vs float64 (the chunked torch path is the same-dtype reference)
    backward       d hidden and d weight of sum(g * logprobs), g random, vs float64
    entropy        the entropy it returns beside them, vs float64
    entropy_grad   the entropy made differentiable (an entropy bonus), its gradients
    frozen_weight  a weight without grad gets none, d hidden unchanged
    ignored_rows   rows whose upstream gradient is 0 (masked tokens) add nothing: their
                   d hidden is exactly 0, and d weight differs from that of the other rows
                   alone by no more than the same-dtype torch reference's does (its rounding
                   over another row order) plus the dtype's tolerance; and N = 0 works
    temperature    at T = 0.7, the log-probs, the entropy beside them (the trainer's call)
                   and d hidden, d weight of the log-probs

Tolerances are the dtype's (`SLACK`, beyond the same-dtype torch reference's error) in every
check: a bfloat16 kernel is held to bfloat16's budget, a float32 one to float32's. A failure
is one line: the check, the quantity, both errors, the allowance, the dtype and shape.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import grpo_kernels
from grpo.testing.conformance import expect, run_checks

SHAPES = ((37, 64, 1003), (129, 48, 4099))  # (N, C, V): N, V prime-ish
# the error allowed beyond the same-dtype torch reference's (forward log-prob units; gradients
# are compared relative to their largest entry)
SLACK = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
CHECKS = (
    "forward",
    "backward",
    "entropy",
    "entropy_grad",
    "frozen_weight",
    "ignored_rows",
    "temperature",
)


def logprob_impl_checks() -> list[str]:
    return list(CHECKS)


def _operands(n, c, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g) / c**0.25
    weight = torch.randn(v, c, generator=g) / c**0.25
    ids = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    return hidden.to(dtype), weight.to(dtype), ids, upstream


def _run(
    fn,
    hidden,
    weight,
    ids,
    temperature=1.0,
    entropy=False,
    entropy_grad=False,
    upstream=None,
    weight_grad=True,
):
    """(logprobs, entropy or None, d hidden, d weight or None) of one call."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(weight_grad)
    out = grpo_kernels.fused_logprobs(
        h, w, ids, temperature, impl=fn, return_entropy=entropy, entropy_grad=entropy_grad
    )
    lp, ent = out if isinstance(out, tuple) else (out, None)
    if upstream is None:
        return lp.detach(), None if ent is None else ent.detach(), None, None
    total = (lp * upstream.to(lp.dtype)).sum()
    if entropy_grad:
        total = total + (ent * upstream.flip(0).to(ent.dtype)).sum()
    params = [h, w] if weight_grad else [h]
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return (
        lp.detach(),
        None if ent is None else ent.detach(),
        grads[0],
        (grads[1] if weight_grad else w.grad),
    )


def _no_worse(name, got, ref, gold, slack, relative=False):
    """max |got - gold| <= max |ref - gold| + slack (relative to max |gold| if `relative`)."""
    expect(got is not None, f"{name}: none returned")
    expect(
        got.shape == gold.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(gold.shape)}"
    )
    expect(bool(torch.isfinite(got).all()), f"{name}: non-finite values")
    scale = float(gold.abs().max()) if relative and gold.numel() else 1.0
    e_got = float((got.double() - gold).abs().max()) / max(scale, 1e-12) if gold.numel() else 0.0
    e_ref = float((ref.double() - gold).abs().max()) / max(scale, 1e-12) if gold.numel() else 0.0
    expect(
        e_got <= e_ref + slack,
        f"{name}: max error {e_got:.3g} vs float64, the same-dtype "
        f"torch reference's {e_ref:.3g} (+ {slack:g} allowed)",
    )


def _same_rows(got, alone, ref, ref_alone, slack) -> None:
    """d weight with the zero-upstream rows vs without them: max |got - alone| (relative to
    max |alone|) within the same-dtype torch reference's own such difference + `slack`."""
    expect(got is not None and alone is not None, "d weight: none returned")
    scale = max(float(alone.double().abs().max()) if alone.numel() else 0.0, 1e-12)
    d_got = float((got.double() - alone.double()).abs().max()) / scale
    d_ref = float((ref.double() - ref_alone.double()).abs().max()) / scale
    expect(
        d_got <= d_ref + slack,
        f"d weight with the zero-gradient rows differs from the other rows' alone by "
        f"{d_got:.3g} (relative), the same-dtype torch reference's by {d_ref:.3g} "
        f"(+ {slack:g} allowed): the zero rows add to d weight",
    )


def check_logprob_impl(
    spec,
    *,
    dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16),
    checks: Iterable[str] | None = None,
    device="cpu",
) -> None:
    """Run the checks (module doc) on the kernel `spec` (a registered name, a built-in's,
    a ``package.module:function`` path or the function); raises `ConformanceError` naming the
    kernel, the check, the dtype and shape, and the two errors."""
    # a built-in by its name (fused_logprobs dispatches it), anything else by its function
    builtin = isinstance(spec, str) and spec in grpo_kernels.IMPLS
    fn = spec if builtin else grpo_kernels.get_logprob_impl(spec)
    wanted = logprob_impl_checks() if checks is None else list(checks)
    dtypes = tuple(dtypes)

    def compare(
        check: str,
        temperature=1.0,
        entropy=False,
        entropy_grad=False,
        weight_grad=True,
        zero_rows=False,
    ):
        for dtype in dtypes:
            slack = SLACK.get(dtype, 1e-5)
            for n, c, v in SHAPES:
                h, w, ids, up = _operands(n, c, v, dtype)
                h, w, ids = h.to(device), w.to(device), ids.to(device)
                up = up.to(device)
                if zero_rows:
                    up[::3] = 0.0  # every third row masked out
                want_grad = check not in ("forward", "entropy")
                kw = dict(
                    temperature=temperature,
                    entropy=entropy or entropy_grad,
                    entropy_grad=entropy_grad,
                    upstream=up if want_grad else None,
                    weight_grad=weight_grad,
                )
                try:
                    got = _run(fn, h, w, ids, **kw)
                    ref = _run("chunked", h, w, ids, **kw)
                    gold = _run(
                        "naive",
                        h.double(),
                        w.double(),
                        ids,
                        **{**kw, "upstream": None if kw["upstream"] is None else up.double()},
                    )
                    names = ("log-probs", "entropy", "d hidden", "d weight")
                    for i, name in enumerate(names):
                        if gold[i] is None:
                            if i == 3 and not weight_grad:
                                expect(got[3] is None, "a frozen weight got a gradient")
                            continue
                        _no_worse(name, got[i], ref[i], gold[i], slack, relative=i >= 2)
                    if zero_rows:  # the kept rows alone give the same gradients
                        keep = up != 0
                        zero = bool((got[2][~keep] == 0).all())
                        expect(zero, "rows with a zero upstream gradient get a non-zero d hidden")
                        kept = {**kw, "upstream": up[keep]}
                        alone = _run(fn, h[keep], w, ids[keep], **kept)
                        ref_alone = _run("chunked", h[keep], w, ids[keep], **kept)
                        _same_rows(got[3], alone[3], ref[3], ref_alone[3], slack)
                except AssertionError as e:
                    raise AssertionError(
                        f"{e} ({_dtype(dtype)}, N={n} C={c} V={v}"
                        f"{f', T={temperature}' if temperature != 1 else ''})"
                    ) from None
        if zero_rows:  # no token at all
            h, w, ids, _ = _operands(0, 16, 300, dtypes[0])
            lp, _, _, _ = _run(fn, h, w, ids)
            expect(lp.shape == (0,), f"N = 0 returned shape {tuple(lp.shape)}")

    table = {
        "forward": lambda: compare("forward"),
        "backward": lambda: compare("backward"),
        "entropy": lambda: compare("entropy", entropy=True),
        "entropy_grad": lambda: compare("entropy_grad", entropy_grad=True),
        "frozen_weight": lambda: compare("frozen_weight", weight_grad=False),
        "ignored_rows": lambda: compare("ignored_rows", zero_rows=True),
        "temperature": lambda: compare("temperature", temperature=0.7, entropy=True),
    }
    run_checks("log-prob impl", spec, table, wanted)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
