"""The decode step's weights: cast once per rollout, not per token; q/k/v and gate/up fused.

A decode step is a few dozen rows through every weight matrix, so on a GPU its cost is the
launches and the bytes it moves, not the FLOPs. Two things cost both every token and change
nothing within a rollout:

- **casts**: under autocast (float32 master weights computing in bfloat16, the tutorial's
  LoRA config) every `F.linear` re-casts its weight: frozen weights never enter autocast's cast
  cache, and the cache is emptied when each forward's `autocast` exits. At the Qwen3-0.6B shape
  that was 982 cast launches per decode step and a read of the float32 weights plus a write of
  their bf16 copies, three times the bytes of the matmuls themselves. Here each weight (the
  LoRA adapters too) is cast once, when it changed (`Tensor._version`, as
  `grpo.rollout.onednn_weights` tracks it: with LoRA the frozen base once per run, the adapters
  once per rollout).
- **separate projections**: q, k and v (and gate and up) read the same input; one matmul over
  their weights stacked does the work of three (two) launches. LoRA adapters of stacked layers
  stack too: their A matrices side by side, their B matrices (scale folded in) block-diagonal,
  so a stacked layer is three launches (base, x A^T, + t B^T) whatever number of adapters.

The adapter is never merged into a 16-bit base: bf16(W + s B A) rounds a small update away and
the sampler would draw from the base model; the base and the adapter stay apart, as in the
trainer. `DecodeWeights.installed()` puts the cast and stacked copies in place for the length
of a rollout (`Sampler.packing`), through per-instance attributes the layers read
(`_fused_qkv` of `Attention`, `_fused_gate_up` of `MLP`, `forward` of any other linear layer,
a LoRA one included), and takes them out after; the trainer's
forwards never see them. Refreshed copies are written into the same tensors, so a compiled
step keeps its graph. Memory: one copy of the stacked weights (and of the rest under autocast)
in the compute dtype.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from grpo.lora import LoRALinear
from grpo.precision import Precision
from grpo.rollout.onednn_weights import instance_attributes


def _plain_tensors(model: nn.Module) -> bool:
    return all(type(p.data) is torch.Tensor for p in model.parameters())


def _free(m) -> bool:
    """A linear layer in eval mode that no one else computes for (packed weights, a patch)."""
    return (
        isinstance(m, (nn.Linear, LoRALinear))
        and not m.training
        and not {"forward", "_packed_base"} & m.__dict__.keys()
    )


def _stamp(tensors) -> tuple:
    return tuple((id(t), t._version) for t in tensors if t is not None)


def _adapter(m: nn.Module):
    """A LoRA layer's live adapter (A (r, in), B (out, r), scale), or None."""
    if isinstance(m, LoRALinear) and not (m.merged or m.disabled):
        return m.lora_a, m.lora_b, m.scale
    return None


class _Stacked:
    """Several linear layers over one input as one matmul (+ one stacked LoRA update)."""

    def __init__(self, layers: list[nn.Module], dtype: torch.dtype):
        self.layers, self.dtype = layers, dtype
        self.sizes = [m.weight.shape[0] for m in layers]
        self.stamp = None
        self.weight = self.bias = self.a_t = self.b_t = None
        # a single layer's forward: the same callable every rollout, so a compiled step that
        # traced it keeps its graph (a new function object fails its guards: a recompile)
        self.first = functools.partial(_first, self)

    def sources(self):
        for m in self.layers:
            yield m.weight
            yield m.bias
            a = _adapter(m)
            if a is not None:
                yield from a[:2]

    def refresh(self) -> None:
        """Rebuild the copies from the layers if any source changed (version or identity)."""
        stamp = _stamp(self.sources())
        if stamp == self.stamp:
            return
        # ordinary tensors (not inference ones, whatever the caller's mode): updated in place
        # by later refreshes inside or outside inference mode
        with torch.inference_mode(False), torch.no_grad():
            self._rebuild()
        self.stamp = stamp

    def _rebuild(self) -> None:
        dt, layers = self.dtype, self.layers
        w = torch.cat([m.weight.detach() for m in layers]).to(dt)  # (sum out, in)
        has_bias = any(m.bias is not None for m in layers)
        b = (
            torch.cat(
                [
                    m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                    for m in layers
                ]
            ).to(dt)
            if has_bias
            else None
        )
        adapters = [_adapter(m) for m in layers]
        a_t = b_t = None
        if any(a is not None for a in adapters):
            ranks = [a[0].shape[0] if a is not None else 0 for a in adapters]
            C = layers[0].weight.shape[1]
            A = torch.zeros(sum(ranks), C, dtype=torch.float32, device=w.device)
            B = torch.zeros(w.shape[0], sum(ranks), dtype=torch.float32, device=w.device)
            r0 = o0 = 0
            for a, r, n in zip(adapters, ranks, self.sizes):
                if a is not None:
                    A[r0 : r0 + r] = a[0].detach().float()
                    B[o0 : o0 + n, r0 : r0 + r] = a[1].detach().float() * a[2]
                r0, o0 = r0 + r, o0 + n
            a_t, b_t = A.t().to(dt), B.t().to(dt)  # (in, R), (R, sum out)
        new = (w, b, a_t, b_t)
        old = (self.weight, self.bias, self.a_t, self.b_t)
        if all(
            (x is None and y is None) or (x is not None and y is not None and x.shape == y.shape)
            for x, y in zip(new, old)
        ):
            for x, y in zip(new, old):  # in place: a compiled step keeps its graph
                if y is not None:
                    y.copy_(x)
        else:
            self.weight, self.bias, self.a_t, self.b_t = new

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x (..., in) -> one (..., out_i) view per layer."""
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1]).to(self.dtype)  # (N, in)
        out = F.linear(x2d, self.weight, self.bias)  # (N, sum out)
        if self.a_t is not None:
            out.addmm_(x2d @ self.a_t, self.b_t)  # + scale * x A^T B^T, all adapters at once
        return list(out.view(*lead, out.shape[-1]).split(self.sizes, dim=-1))


class DecodeWeights:
    """The cast and stacked copies of one model's weights for its decode steps.

    Args:
        model: a `Decoder` in plain (not sharded) tensors.
        precision: the run's policy: copies are held in its `compute_dtype`.
        fuse: stack q/k/v and gate/up (eager decoding: fewer launches); False keeps the
            layers apart and only casts (a compiled step, whose graph replays anyway).
    """

    def __init__(self, model: nn.Module, precision: Precision, fuse: bool = True):
        self.model, self.dtype, self.fuse = model, precision.compute_dtype, fuse
        self._copies: dict[str, _Stacked] = {}  # module path (+ stack) -> its copies
        self.active = False

    @staticmethod
    def supported(model: nn.Module) -> bool:
        return _plain_tensors(model)

    @property
    def copied_bytes(self) -> int:
        """Memory held by the copies."""
        ts = [
            t
            for s in self._copies.values()
            for t in (s.weight, s.bias, s.a_t, s.b_t)
            if t is not None
        ]
        return sum(t.numel() * t.element_size() for t in ts)

    def _plan(self):
        """(name, owner, attribute, layers) of every copy to install."""
        head = getattr(self.model, "lm_head", None)
        stacked = set()
        if self.fuse:
            for name, m in self.model.named_modules():
                groups = {
                    "_fused_qkv": ("q_proj", "k_proj", "v_proj"),
                    "_fused_gate_up": ("gate_proj", "up_proj"),
                }
                for attr, parts in groups.items():
                    layers = [getattr(m, p, None) for p in parts]
                    if all(_free(x) for x in layers):
                        stacked.update(id(x) for x in layers)
                        yield f"{name}.{attr}", m, attr, layers
        if all(p.dtype == self.dtype for p in self.model.parameters()):
            return  # nothing to cast (asked at each install: trainability may change dtypes)
        for name, m in self.model.named_modules():
            if m is head or id(m) in stacked or not _free(m):
                continue
            yield name, m, "forward", [m]  # a LoRA layer: base and adapter, each cast

    @contextlib.contextmanager
    def installed(self):
        """Refresh the copies that changed, install them until exit (entered again inside, it
        changes nothing). A layer whose attribute is already set on the instance (a user's
        patch, packed weights) is left as it is."""
        if self.active:
            yield self
            return
        with instance_attributes(self, self._installs()):
            yield self

    def _installs(self):
        """(module, attribute, value) to install, each copy refreshed as it is reached."""
        for name, owner, attr, layers in self._plan():
            if attr in owner.__dict__:
                continue
            s = self._copies.get(name)
            if s is None or s.layers != layers:
                s = self._copies[name] = _Stacked(layers, self.dtype)
            s.refresh()
            yield owner, attr, s if attr != "forward" else s.first


def _first(s: _Stacked, x: torch.Tensor) -> torch.Tensor:
    return s(x)[0]
