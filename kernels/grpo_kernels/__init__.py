"""Fused log-prob kernels: `fused_logprobs` dispatches to Triton (CUDA) or the chunked torch twin.

Triton is imported lazily, on the first impl="triton" call, so importing `grpo_kernels` is cheap and
leaves TRITON_INTERPRET to whoever imports triton first.
"""

import importlib
import importlib.util
import logging
import os
import sys

import torch

from grpo_kernels.reference import (
    check_operands,
    chunked_logprobs,
    default_blocks,
    matmul_fp32,
    naive_logprobs,
    round_to_tf32,
    tf32_matmuls,
)

IMPLS = ("auto", "naive", "chunked", "triton")  # the built-ins ("auto": triton on CUDA)

# Implementations registered by name (`register_logprob_impl`); a kernel of your own is
#   fn(hidden, weight, ids, temperature=1.0, return_entropy=False, *, entropy_grad=False,
#      tf32=False) -> logprobs (N,) float32, or (logprobs, entropy) with return_entropy
# and is selected as `model.logprob_impl: name` (or `package.module:function`, no registration)
_REGISTERED: dict = {}
# what a replaced built-in name ran before (the dispatcher for "auto" and "triton")
_BUILTINS = {"naive": naive_logprobs, "chunked": chunked_logprobs}
log = logging.getLogger(__name__)

__all__ = [
    "IMPLS",
    "available_impls",
    "get_logprob_impl",
    "register_logprob_impl",
    "check_operands",
    "chunked_logprobs",
    "default_blocks",
    "fused_logprobs",
    "matmul_fp32",
    "naive_logprobs",
    "resolve_impl",
    "round_to_tf32",
    "tf32_matmuls",
]


def register_logprob_impl(name: str, fn=None, *, overwrite: bool = False):
    """Make a log-prob implementation available by `name` (``model.logprob_impl: name``,
    ``bench_logprobs --impls name``); as a decorator without `fn`. Its signature is that of
    `chunked_logprobs` (inputs checked by `fused_logprobs` before it is called: 2-d
    contiguous operands of one dtype and device, ids in range, temperature > 0)."""

    def add(f):
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a log-prob impl name has no ':' and is not empty: {name!r}")
        if not callable(f):
            raise TypeError(f"log-prob impl {name!r}: expected a function, not {type(f)}")
        taken = name in IMPLS or name in _REGISTERED
        old = _REGISTERED.get(name, _BUILTINS.get(name, fused_logprobs if taken else None))
        if taken and not overwrite and old is not f:
            raise ValueError(f"log-prob impl {name!r} exists; pass overwrite=True to replace it")
        if taken and old is not f:
            _note_replacement(name, old, f)
        _REGISTERED[name] = f
        return f

    return add if fn is None else add(fn)


def _note_replacement(name: str, old, new) -> None:
    """`name` now runs `new` instead of `old`: recorded and logged by grpo as its own registries'
    replacements are (`grpo.plugins.note_replacement`: one line, and the run's `run/replaced`)
    when grpo is running; grpo_kernels never imports grpo, so without it one warning here."""
    plugins = sys.modules.get("grpo.plugins")
    if plugins is not None:
        plugins.note_replacement("logprob impl", name, old, new)
        return
    new_name = getattr(new, "__module__", "?") + ":" + getattr(new, "__qualname__", repr(new))
    log.warning("replaced logprob impl %r by %s", name, new_name)


def available_impls() -> list[str]:
    """The names `fused_logprobs(impl=)` takes (besides ``package.module:function``)."""
    return list(IMPLS) + sorted(set(_REGISTERED) - set(IMPLS))


def get_logprob_impl(spec):
    """The function of a registered name, a ``package.module:function`` path or a callable;
    None for a built-in name (dispatched by `fused_logprobs` itself)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"impl must be a name or a function, got {spec!r}")
    if spec in _REGISTERED:
        return _REGISTERED[spec]
    if spec in IMPLS:
        return None
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"log-prob impl {spec!r}: {e}") from None
        if not callable(fn):
            raise ValueError(f"log-prob impl {spec!r} is a {type(fn).__name__}, not a function")
        return fn
    raise ValueError(
        f"unknown log-prob impl {spec!r}; known: {', '.join(available_impls())} "
        "(or a 'package.module:function' path)"
    )


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map impl="auto" to "triton" on CUDA (when triton is installed), else "chunked"; validate.

    Args:
        impl: one of IMPLS.
        device: device of the operands.

    Returns:
        "naive", "chunked" or "triton".
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if impl == "auto":
        return "triton" if device.type == "cuda" and has_triton else "chunked"
    if impl == "triton":
        if not has_triton:
            raise RuntimeError("impl='triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"impl='triton' needs CUDA tensors (got {device}); on CPU use impl='chunked', "
                "or set TRITON_INTERPRET=1 before importing triton to run the kernels interpreted"
            )
    return impl


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    impl: str = "auto",
    return_entropy: bool = False,
    *,
    entropy_grad: bool = False,
    tf32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax((hidden @ weight.T) / temperature)[n, ids[n]] for every token, fused.

    Differentiable in `hidden` and `weight`; whichever does not require grad gets no gradient
    work (a frozen lm_head costs no d_weight GEMM). The (N, V) logits are never materialized
    except by impl="naive".

    Args:
        hidden: (N, C) final hidden states (flatten (B, T, C) first); made contiguous if needed.
        weight: (V, C) lm_head weight, same dtype and device.
        ids: (N,) int32/int64 target ids in [0, V).
        temperature: sampling temperature; logits are divided by it.
        impl: "auto" (Triton on CUDA, chunked torch elsewhere), "naive", "chunked", "triton",
            a name given to `register_logprob_impl`, a ``package.module:function`` path or a
            function with `chunked_logprobs`' signature (plus ``tf32=``).
        return_entropy: also return the per-token entropy of the tempered distribution (no grad),
            for metrics.
        entropy_grad: return the entropy (implies `return_entropy`) differentiable in `hidden`
            and `weight`, for an entropy bonus trained through the same fused pass. On the
            chunked path a frozen weight then loses its no-recompute backward.
        tf32: float32 operands on CUDA multiply in TF32 (float32 accumulation): the Triton dots
            and GEMMs, or the torch paths' forward matmuls (`tf32_matmuls`; their backward
            multiplies as torch is set globally). No effect on CPU or on 16-bit operands.

    Returns:
        logprobs (N,) float32 (float64 only for float64 inputs); with `return_entropy` or
        `entropy_grad`, a tuple (logprobs, entropy), both (N,).

    Raises:
        ValueError / TypeError: malformed operands, ids out of range, unknown impl.
    """
    # the one full check of the operands on every path (the Triton launchers only assert
    # shape, dtype and contiguity); the id range costs one host sync
    check_operands(hidden, weight, ids, temperature)
    custom = get_logprob_impl(impl)
    if custom is None:
        impl = resolve_impl(impl, hidden.device)
    if ids.numel() > 0:
        lo, hi = torch.aminmax(ids)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"ids must lie in [0, V={weight.shape[0]}), got min {lo}, max {hi}")
    if custom is not None:  # a registered or module-path kernel, on checked operands
        return custom(
            hidden.contiguous(),
            weight.contiguous(),
            ids.contiguous(),
            temperature,
            return_entropy or entropy_grad,
            entropy_grad=entropy_grad,
            tf32=tf32,
        )
    if impl in ("naive", "chunked"):
        fn = naive_logprobs if impl == "naive" else chunked_logprobs
        with tf32_matmuls(hidden.device, tf32):
            return fn(hidden, weight, ids, temperature, return_entropy, entropy_grad=entropy_grad)
    from grpo_kernels.logprobs import _triton_logprobs  # operands checked above, once

    return _triton_logprobs(
        hidden.contiguous(),
        weight.contiguous(),
        ids.contiguous(),
        temperature,
        return_entropy,
        entropy_grad,
        {"tf32": True} if tf32 else {},
    )
