"""Fused log-prob kernels: `fused_logprobs` dispatches to Triton (CUDA) or the chunked torch twin.

Triton is imported lazily, on the first impl="triton" call, so importing `kernels` is cheap and
leaves TRITON_INTERPRET to whoever imports triton first.
"""

import importlib.util
import os

import torch

from kernels.reference import (
    check_operands,
    chunked_logprobs,
    default_blocks,
    matmul_fp32,
    naive_logprobs,
    tf32_matmuls,
)

IMPLS = ("auto", "naive", "chunked", "triton")

__all__ = [
    "IMPLS",
    "check_operands",
    "chunked_logprobs",
    "default_blocks",
    "fused_logprobs",
    "matmul_fp32",
    "naive_logprobs",
    "resolve_impl",
    "tf32_matmuls",
]


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
        impl: "auto" (Triton on CUDA, chunked torch elsewhere), "naive", "chunked" or "triton".
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
    impl = resolve_impl(impl, hidden.device)
    if ids.numel() > 0:
        lo, hi = torch.aminmax(ids)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"ids must lie in [0, V={weight.shape[0]}), got min {lo}, max {hi}")
    if impl in ("naive", "chunked"):
        fn = naive_logprobs if impl == "naive" else chunked_logprobs
        with tf32_matmuls(hidden.device, tf32):
            return fn(hidden, weight, ids, temperature, return_entropy, entropy_grad=entropy_grad)
    from kernels.logprobs import _triton_logprobs  # operands checked above, once

    return _triton_logprobs(
        hidden.contiguous(),
        weight.contiguous(),
        ids.contiguous(),
        temperature,
        return_entropy,
        entropy_grad,
        {"tf32": True} if tf32 else {},
    )
