"""oneDNN-packed copies of a model's large linear weights, for decoding on a CPU.

A decode step multiplies a few dozen rows by every weight matrix. At those shapes a CPU matmul
over a weight in its plain (out, in) layout runs far below the machine's rate; the same weight
reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what
inductor's CPU backend does for frozen inference graphs) multiplies faster. Measured on the
2-core dev VM (float32, rows x in -> out): the Qwen3-0.6B head 1024 -> 151,936 takes 55.5 ms
packed vs 82.2 ms plain at 32 rows (1.48x) and 32.6 vs 72.9 ms at 8 rows (2.24x); the body's
matrices 1.15-1.33x; a 512-row prefill the same (0.97-1.09x). Packing a matrix costs about two
plain matmuls at 32 rows; docs/sampler.md has the profile.

`PackedLinears` keeps the packed copies and repacks a weight only when it changed (a new
tensor or an in-place write, such as an optimizer step or a LoRA merge, bumps
`Tensor._version`): with LoRA the frozen base is packed once for the run, with full fine-tuning
once per rollout. While `installed()`, the model's large `nn.Linear` / `LoRALinear` layers
compute with the packed copies (a LoRA layer adds its adapters as before); `head` gives the
float32 logits of a packed head, packed in the head's operand dtype (`Precision.head_dtype`:
bfloat16 for `model.head_precision: bf16`, where this CPU can pack it, else the head stays
plain). Packed copies cost memory: one more copy of the packed weights, in the compute dtype
(bfloat16 under autocast).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from grpo.lora import LoRALinear
from grpo.precision import Precision, cpu_packing_missing

# Weights smaller than this many elements stay plain: at 1024 x 1024 and 8 rows the packed
# matmul was slower (0.55 vs 0.48 ms); from 1024 x 2048 on it was faster at 8 and 32 rows.
MIN_NUMEL = 2**21
ROWS_HINT = 32  # the row count oneDNN picks its blocking for


def packing_supported(model: nn.Module, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the model lives on the CPU in plain (not sharded) tensors and this torch and CPU
    can pack weights in `dtype` (`grpo.precision.cpu_packing_missing`: bfloat16 needs AVX-512
    or avx_ne_convert; where it is missing, decoding takes the plain path)."""
    if cpu_packing_missing(dtype) is not None or cpu_packing_missing(torch.float32):
        return False
    p = next(model.parameters())
    return p.device.type == "cpu" and type(p.data) is torch.Tensor


def _pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), ROWS_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "")


class PackedLinears:
    """The packed weights of one model, refreshed as its weights change.

    Args:
        model: a `Decoder` on the CPU.
        precision: the run's precision policy: layers compute in its `compute_dtype` (as
            autocast would), the head in its `head_dtype` (unpacked where this CPU cannot
            pack that dtype: `grpo.precision.cpu_packing_missing`).
    """

    def __init__(self, model: nn.Module, precision: Precision):
        self.model = model
        self.dtype = precision.compute_dtype
        self.head_dtype = precision.head_dtype
        self._packs: dict[str, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]] = {}
        self._head: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self.active = False  # inside `installed()`

    @property
    def packed_bytes(self) -> int:
        """Memory held by the packed copies."""
        ts = [p[2] for p in self._packs.values()] + ([self._head[2]] if self._head else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def _layers(self):
        head = getattr(self.model, "lm_head", None)
        for name, m in self.model.named_modules():
            if m is head or not isinstance(m, (nn.Linear, LoRALinear)):
                continue
            if m.weight.numel() >= MIN_NUMEL:
                yield name, m

    def _fresh(self, entry, weight: torch.Tensor) -> bool:
        return entry is not None and entry[0] is weight and entry[1] == weight._version

    def refresh(self) -> None:
        """Repack the weights that changed since they were packed."""
        for name, m in self._layers():
            w = m.weight
            if not self._fresh(self._packs.get(name), w):
                self._packs.pop(name, None)  # free the stale copy first
                bias = None if m.bias is None else m.bias.detach().to(self.dtype)
                self._packs[name] = (w, w._version, _pack(w, self.dtype), bias)
        head = getattr(self.model, "lm_head", None)
        plain_head = isinstance(head, nn.Linear) or (
            isinstance(head, LoRALinear) and (head.merged or head.disabled)
        )
        if (
            head is None
            or not plain_head
            or head.weight.numel() < MIN_NUMEL
            or cpu_packing_missing(self.head_dtype) is not None
        ):
            self._head = None
        elif not self._fresh(self._head, head.weight):
            self._head = None
            w = head.weight
            self._head = (w, w._version, _pack(w, self.head_dtype))

    def head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(..., C) hidden -> (..., V) float32 logits through the packed head (operands in the
        head's dtype, float32 accumulation; a bf16 head's product is rounded to bf16 as torch's
        CPU matmul rounds it); None outside `installed()` or when the head is not packed (a live
        LoRA head, a small one, or a dtype this CPU cannot pack)."""
        if not self.active or self._head is None:
            return None
        return _packed_linear(hidden, self._head[2], None).float()

    @contextlib.contextmanager
    def installed(self):
        """Refresh, then let the large layers compute with their packed copies until exit
        (entered again inside, it changes nothing). A layer whose `forward` is already
        overridden on the instance (a user's patch, a wrapper's hook) is left as it is."""
        if self.active:
            yield self
            return
        self.refresh()
        layers = dict(self._layers())
        # a LoRA layer's base matmul reads `_packed_base` (grpo.lora.layers)
        items = (
            (
                layers[name],
                "_packed_base" if isinstance(layers[name], LoRALinear) else "forward",
                _bind(packed, bias),
            )
            for name, (_, _, packed, bias) in self._packs.items()
        )
        with instance_attributes(self, items):
            yield self


@contextlib.contextmanager
def instance_attributes(holder, items):
    """Set each (module, attribute, value) of `items` on the instance for the block (one the
    instance already has, a user's patch, is left as it is), with `holder.active` True; all
    removed after, also on an error. `items` may be lazy (a generator runs inside)."""
    patched = []
    try:
        for m, attr, value in items:
            if attr not in m.__dict__:
                setattr(m, attr, value)
                patched.append((m, attr))
        holder.active = True
        yield holder
    finally:
        holder.active = False
        for m, attr in patched:
            m.__dict__.pop(attr, None)


def _bind(packed: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, packed, bias)

    return forward
