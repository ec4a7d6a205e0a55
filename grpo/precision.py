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
- lm_head (logits, log-softmax, sampling, log-probs): float32 operands and accumulation, in
  the sampler and the trainer alike (`head_operands`).

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
from grpo.models.loading import parse_dtype


@dataclass(frozen=True)
class Precision:
    """Which dtype holds and computes what (see the module docstring's table).

    Attributes:
        param_dtype: storage of frozen weights.
        compute_dtype: dtype of forward matmuls and attention; autocast runs when it differs
            from float32, so float32 master weights compute in 16 bits.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32

    trainable_dtype = torch.float32  # master weights, gradients, optimizer states
    head_dtype = torch.float32  # lm_head operands: logits and log-probs in float32

    @classmethod
    def from_config(cls, model_cfg, training: bool = True) -> Precision:
        """The policy of `cfg.model` (its `dtype` and `autocast_bf16`).

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
        return cls(param, torch.bfloat16 if bf16 else param)

    @classmethod
    def of_model(cls, model: torch.nn.Module, autocast_bf16: bool = False) -> Precision:
        """Inference with a loaded model: compute in its weights' dtype (bf16 with
        `autocast_bf16`)."""
        param = next(model.parameters()).dtype
        return cls(param, torch.bfloat16 if autocast_bf16 else param)

    @property
    def autocast_enabled(self) -> bool:
        return self.compute_dtype != torch.float32

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
        """One line naming every dtype; on a CPU `device`, also how eager decoding multiplies
        (oneDNN-packed weights, or plain matmuls where this CPU cannot pack the compute dtype)."""
        line = (
            f"weights {_name(self.param_dtype)} (trainable float32), compute "
            f"{_name(self.compute_dtype)}, KV cache {_name(self.kv_dtype)}, head float32"
        )
        if device is not None and torch.device(device).type == "cpu":
            missing = cpu_packing_missing(self.compute_dtype)
            line += (", CPU decode: plain matmuls (" + missing + ")" if missing
                     else ", CPU decode: oneDNN-packed weights")  # fmt: skip
        return line


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# What oneDNN needs to pack (and multiply) weights in a 16-bit dtype on an x86 CPU; float32
# packs wherever oneDNN is built in. torch asks oneDNN, which honours ONEDNN_MAX_CPU_ISA, so
# `ONEDNN_MAX_CPU_ISA=AVX2` makes an AVX-512 machine answer as an AVX2-only one.
_ONEDNN_DTYPES = {
    torch.bfloat16: (
        "_is_mkldnn_bf16_supported",
        "avx512bw, avx512vl and avx512dq, or avx_ne_convert",
    ),  # fmt: skip
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


def head_operands(lm_head: torch.nn.Module, hidden: torch.Tensor):
    """The head as one float32 linear map: (hidden' (N, C'), weight' (V, C')) with
    hidden' @ weight'^T = lm_head(hidden), computed in float32.

    A live LoRA head is folded in, [h, s * dropout(h) A^T] @ [W, B]^T = h W^T + s * dropout(h)
    A^T B^T (C' = C + r), so the sampler (`head_logits`) and the trainer's fused log-probs see
    the same operands. Runs outside autocast; differentiable in hidden and the trainable head
    weights.
    """
    with no_autocast(hidden.device.type):
        h = hidden.to(Precision.head_dtype)
        w = lm_head.weight.to(Precision.head_dtype)  # (V, C)
        if isinstance(lm_head, LoRALinear) and not (lm_head.merged or lm_head.disabled):
            low = lm_head.scale * (lm_head.dropout(h) @ lm_head.lora_a.float().t())  # (N, r)
            return torch.cat([h, low], dim=-1), torch.cat([w, lm_head.lora_b.float()], dim=-1)
        return h, w


def head_logits(lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(..., C) hidden states -> (..., V) float32 logits, as the trainer's log-probs see them."""
    h, w = head_operands(lm_head, hidden)
    with no_autocast(hidden.device.type):
        return F.linear(h, w)


def no_autocast(device_type: str):
    """A region without autocast: the disabling context only where one is on (entering it costs
    microseconds, per decode step)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
