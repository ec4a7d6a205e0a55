"""The one precision policy: what dtype each tensor of a run is held and computed in.

Built once from the config (`Precision.from_config(cfg.model)`) or from a loaded model
(`Precision.of_model`, inference), and handed to everything that runs the model: the sampler
(prefill, decode, multi-turn), the trainer's log-probs (GRPO, reference, SFT), evaluation and
the server. Nothing else decides a dtype.

- frozen weights (the base under LoRA, a reference copy): `model.dtype`;
- trainable weights, their gradients, AdamW states: float32 (the parameters are the master
  weights);
- forward matmuls and attention: `compute_dtype` (torch autocast), bfloat16 when
  `model.autocast_bf16` or `model.dtype: bfloat16`, else `model.dtype`; RMSNorm statistics,
  rotary tables and the attention softmax stay float32 inside their ops;
- KV cache: `compute_dtype` (what the attention reads under autocast);
- lm_head (logits, log-softmax, sampling, log-probs): `model.head_precision`, the same in the
  sampler and the trainer (`head_operands`): float32 operands and accumulation (the default),
  tf32 (float32 operands multiplied in TF32 on CUDA, exactly float32 on a CPU) or bf16
  (bfloat16 operands, float32 accumulation, no float32 copy of a bf16 weight); the logits, the
  log-softmax and the log-probs are float32 in every mode.

float16 weights are refused for training (no loss scaler: AdamW's eps and small gradients
underflow); they stay usable for inference. docs/precision.md has the measured budgets.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.errors import GrpoError
from grpo.lora import LoRALinear
from grpo.models.hf_checkpoint import parse_dtype
from grpo_kernels import matmul_fp32, tf32_matmuls

# lm_head precisions (`model.head_precision`) -> the dtype of the head's operands
HEAD_PRECISIONS = {"float32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}


def _head_dtype(head_precision: str) -> torch.dtype:
    if head_precision not in HEAD_PRECISIONS:
        raise ValueError(
            f"head precision must be one of {list(HEAD_PRECISIONS)}, got {head_precision!r}"
        )
    return HEAD_PRECISIONS[head_precision]


@dataclass(frozen=True)
class Precision:
    """Which dtype holds and computes what (see the module docstring's table).

    Attributes:
        param_dtype: storage of frozen weights.
        compute_dtype: dtype of forward matmuls and attention; autocast runs when it differs
            from float32, so float32 master weights compute in 16 bits.
        head: the lm_head's precision in the sampler and the trainer alike, one of
            `HEAD_PRECISIONS`: "float32" (exact), "tf32" (float32 operands, TF32 matmuls on
            CUDA, float32 on a CPU) or "bf16" (bfloat16 operands, float32 accumulation).
        logprob_impl: the fused log-prob kernel of the trainer's passes (`model.logprob_impl`:
            "auto", a built-in, a registered name or ``package.module:function``; `grpo_kernels`).
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    head: str = "float32"
    logprob_impl: str = "auto"

    trainable_dtype = torch.float32  # master weights, gradients, optimizer states

    def __post_init__(self):
        _head_dtype(self.head)

    @property
    def head_dtype(self) -> torch.dtype:
        """The lm_head operands' dtype (logits and log-probs are float32 whatever it is)."""
        return HEAD_PRECISIONS[self.head]

    @classmethod
    def from_config(cls, model_cfg, training: bool = True) -> Precision:
        """The policy of `cfg.model` (its `dtype`, `autocast_bf16` and `head_precision`).

        Raises:
            GrpoError: float16 for training (one line, before anything loads).
        """
        param = parse_dtype(model_cfg.dtype)
        if training and param == torch.float16:
            raise GrpoError(
                "model.dtype: float16 cannot train here (no loss scaler: gradients and AdamW's "
                "eps underflow); use bfloat16, or float32 with model.autocast_bf16: true"
            )
        bf16 = model_cfg.autocast_bf16 or param == torch.bfloat16
        return cls(
            param,
            torch.bfloat16 if bf16 else param,
            model_cfg.head_precision,
            getattr(model_cfg, "logprob_impl", "auto"),
        )

    @classmethod
    def of_model(cls, model: torch.nn.Module, autocast_bf16: bool = False) -> Precision:
        """Inference with a loaded model: compute in its weights' dtype (bf16 with
        `autocast_bf16`)."""
        param = next(model.parameters()).dtype
        return cls(param, torch.bfloat16 if autocast_bf16 else param)

    @property
    def autocast_enabled(self) -> bool:
        """Autocast runs for a 16-bit compute dtype (float64 weights compute as they are)."""
        return self.compute_dtype in (torch.bfloat16, torch.float16)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache holds keys and values as the attention reads them."""
        return self.compute_dtype

    def autocast(self, device: torch.device | str):
        """The forward-pass context: autocast to `compute_dtype`, or explicitly none (an outer
        autocast does not leak into a float32 policy)."""
        device_type = torch.device(device).type
        if not self.autocast_enabled:
            return no_autocast(device_type)
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Trainable parameters to float32 (the master weights the optimizer steps); frozen
        ones keep `param_dtype`. Call after LoRA is applied and trainability is set."""
        for p in model.parameters():
            if p.requires_grad and p.dtype != self.trainable_dtype:
                p.data = p.data.to(self.trainable_dtype)
        return model

    def describe(self, device: torch.device | str | None = None) -> str:
        """One line naming every dtype; with a `device`, also that the sampler casts weights
        once per rollout (when they compute in another dtype) and, on a CPU, how eager
        decoding multiplies (oneDNN-packed weights, or plain matmuls where this CPU cannot pack
        the compute dtype)."""
        line = (
            f"weights {_name(self.param_dtype)} (trainable float32), compute "
            f"{_name(self.compute_dtype)}, KV cache {_name(self.kv_dtype)}, head "
            + _HEAD_LINES[self.head]
        )
        if self.logprob_impl != "auto":
            line += f", log-probs {self.logprob_impl}"
        if device is not None and self.param_dtype != self.compute_dtype:
            # grpo.rollout.decode_weights: never per decode step
            line += f", decode weights cast to {_name(self.compute_dtype)} once per rollout"
        if device is not None and torch.device(device).type == "cpu":
            missing = cpu_packing_missing(self.compute_dtype)
            line += (
                ", CPU decode: plain matmuls (" + missing + ")"
                if missing
                else ", CPU decode: oneDNN-packed weights"
            )
        return line


_HEAD_LINES = {
    "float32": "float32",
    "tf32": "float32 (TF32 matmuls on CUDA)",
    "bf16": "bfloat16 (fp32 accumulation)",
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# What oneDNN needs to pack (and multiply) weights in a 16-bit dtype on an x86 CPU; float32
# packs wherever oneDNN is built in. torch asks oneDNN, which honours ONEDNN_MAX_CPU_ISA, so
# `ONEDNN_MAX_CPU_ISA=AVX2` makes an AVX-512 machine answer as an AVX2-only one.
_ONEDNN_DTYPES = {
    torch.bfloat16: (
        "_is_mkldnn_bf16_supported",
        "avx512bw, avx512vl and avx512dq, or avx_ne_convert",
    ),
    torch.float16: ("_is_mkldnn_fp16_supported", "avx512_fp16, amx_fp16 or avx_ne_convert"),
}


@functools.cache
def cpu_packing_missing(dtype: torch.dtype) -> str | None:
    """Why this process's CPU cannot multiply oneDNN-packed weights in `dtype` (one clause for
    the run's precision line), or None where it can. Asked once per dtype and process."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return "this torch has no oneDNN linear packing"
    if dtype not in _ONEDNN_DTYPES:
        return None if dtype == torch.float32 else f"oneDNN packs no {_name(dtype)}"
    check, needs = _ONEDNN_DTYPES[dtype]
    fn = getattr(torch.ops.mkldnn, check, None)
    if fn is not None and fn():
        return None
    return f"this CPU has no oneDNN {_name(dtype)}: it needs {needs}"


def head_operands(
    lm_head: torch.nn.Module, hidden: torch.Tensor, head_precision: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head as one linear map: (hidden' (N, C'), weight' (V, C')) with
    hidden' @ weight'^T = lm_head(hidden), in the operand dtype of `head_precision` (float32
    for "float32" and "tf32", bfloat16 for "bf16": a bf16 weight is used as it is, never copied
    to float32; a float32 one is cast to bf16).

    A live LoRA head is folded in, [h, s * dropout(h) A^T] @ [W, B]^T = h W^T + s * dropout(h)
    A^T B^T (C' = C + r; A and B cast to the operand dtype), so the sampler (`head_logits`) and
    the trainer's fused log-probs see the same operands. Runs outside autocast; differentiable
    in hidden and the trainable head weights (their gradients come back in their own dtype).
    """
    dtype = _head_dtype(head_precision)
    with no_autocast(hidden.device.type):
        h = hidden.to(dtype)  # (N, C)
        w = lm_head.weight.to(dtype)  # (V, C)
        if isinstance(lm_head, LoRALinear) and not (lm_head.merged or lm_head.disabled):
            low = lm_head.scale * (lm_head.dropout(h) @ lm_head.lora_a.to(dtype).t())  # (N, r)
            return torch.cat([h, low], dim=-1), torch.cat([w, lm_head.lora_b.to(dtype)], dim=-1)
        return h, w


def head_logits(
    lm_head: torch.nn.Module, hidden: torch.Tensor, head_precision: str = "float32"
) -> torch.Tensor:
    """(..., C) hidden states -> (..., V) float32 logits, as the trainer's log-probs see them:
    the operands of `head_operands`, multiplied with float32 accumulation (TF32 on CUDA for
    "tf32"; for "bf16" the product is kept in float32 where torch can, CUDA, and rounded to
    bf16 on a CPU, as the trainer's chunked tiles round it: `grpo_kernels.matmul_fp32`)."""
    h, w = head_operands(lm_head, hidden, head_precision)
    with no_autocast(hidden.device.type), tf32_matmuls(hidden.device, head_precision == "tf32"):
        if h.dtype == torch.float32:
            return F.linear(h, w)
        logits = matmul_fp32(h.reshape(-1, h.shape[-1]), w.t())  # (N, V) float32
        return logits.view(*h.shape[:-1], w.shape[0])


def no_autocast(device_type: str):
    """A region without autocast: the disabling context only where one is on (entering it costs
    microseconds, per decode step)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
