"""LoRA layers: `LoRALinear`, injection (`apply_lora`), merge / unmerge / disable / unwrap.

Design. `LoRALinear` *replaces* an `nn.Linear` at the same module path and keeps the base
weight as its own `weight` / `bias` parameters (torchtune style, no `.base` submodule), so

- the base tensors keep their names (`layers.0.self_attn.q_proj.weight`): checkpoint code and
  anything that reads `model.lm_head.weight` are unaffected;
- a tied `lm_head` wrapper holds the very same Parameter as `embed_tokens.weight` (no copy);
- `unwrap_lora` merges and puts back a plain `nn.Linear` with the same parameter at the same
  path, which `save_pretrained` writes as an ordinary HF checkpoint.

Tied lm_head: merging a LoRA into a tied `lm_head` would also change the input embedding, so a
merge of a wrapper whose weight is shared gives it its own merged copy (V x C more memory) and
unmerge re-ties it exactly; `unwrap_lora` keeps the untied weight and sets the model config's
`tie_word_embeddings` to False so the exported checkpoint stores `lm_head.weight`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from grpo.errors import GrpoError
from grpo.models.hf_checkpoint import hf_name

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T, with W and b frozen.

    Args:
        linear: the `nn.Linear` to wrap; its `weight` / `bias` Parameters are reused (not copied).
        rank: r, the inner dimension of the update.
        alpha: the update is scaled by alpha / r.
        dropout: dropout probability on the LoRA branch input only.
        generator: CPU generator for the kaiming init of `lora_a` (None: the global RNG).
    """

    def __init__(
        self,
        linear: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.weight = linear.weight  # (out, in), frozen
        self.bias = linear.bias  # (out,) or None, frozen
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        w = self.weight
        # A: kaiming-uniform(a=sqrt(5)) as nn.Linear and PEFT, drawn on CPU in fp32 so that a
        # seed gives the same adapter on any device. B: zeros, so the wrapper starts as the base.
        lora_a = torch.empty(rank, self.in_features)
        nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
        self.lora_a = nn.Parameter(lora_a.to(device=w.device, dtype=w.dtype))  # (r, in)
        self.lora_b = nn.Parameter(
            torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype)
        )
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.dropout_p = dropout
        self.merged = False
        self.disabled = False
        self._shared_weight: tuple[nn.Parameter, ...] = ()  # the tied weight while merged

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout_p}, merged={self.merged}"
        )

    def delta_weight(self) -> torch.Tensor:
        """scale * B A (out, in), computed in float32."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # (N, in)
        packed = self.__dict__.get("_packed_base")  # CPU decoding (grpo.rollout.onednn_weights)
        out = F.linear(x2d, self.weight, self.bias) if packed is None else packed(x2d)  # (N, out)
        if self.merged or self.disabled:
            return out.view(*lead, self.out_features)
        t = self.dropout(x2d) @ self.lora_a.t()  # (N, r)
        # Accumulate into the base output in place: no second (N, out) temporary. Legal for
        # autograd because the base matmul saves its inputs, never its output. In-place ops are
        # not autocast: under autocast `out` is 16-bit while B is a float32 master weight, so
        # the operands take out's dtype (the cast is differentiable; B's gradient is float32).
        out.addmm_(t.to(out.dtype), self.lora_b.t().to(out.dtype), alpha=self.scale)
        return out.view(*lead, self.out_features)

    @torch.no_grad()
    def merge(self, shared: bool = False) -> None:
        """W += scale * B A. With `shared` (the weight is tied elsewhere) a merged copy is made."""
        if self.merged:
            return
        merged = (self.weight.float() + self.delta_weight()).to(self.weight.dtype)
        if shared:
            self._shared_weight = (self.weight,)
            self.weight = nn.Parameter(merged, requires_grad=False)
        else:
            self.weight.copy_(merged)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo `merge`: exact for a tied weight, within float rounding otherwise."""
        if not self.merged:
            return
        if self._shared_weight:
            self.weight = self._shared_weight[0]
            self._shared_weight = ()
        else:
            self.weight.copy_((self.weight.float() - self.delta_weight()).to(self.weight.dtype))
        self.merged = False


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Module path -> `LoRALinear`, in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _hf_path(path: str) -> str:
    return hf_name(path + ".weight")[: -len(".weight")]


def _matches(path: str, targets: Sequence[str]) -> bool:
    """PEFT's rule on the HF module path: equal to a target or ending with `.target`."""
    hp = _hf_path(path)
    return any(hp == t or hp.endswith("." + t) for t in targets)


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int | None = None,
) -> list[str]:
    """Freeze `model` and wrap each targeted `nn.Linear` in a `LoRALinear`, in place.

    Args:
        model: a `Decoder` (any module with HF-style names works).
        rank: LoRA rank r (> 0).
        alpha: scale numerator; the update is scaled by alpha / r.
        dropout: dropout probability on the LoRA branch, in [0, 1).
        targets: module names (or dotted suffixes), PEFT style: `q_proj` matches every
            `*.q_proj`. `lm_head` may be added; a tied lm_head is wrapped, the embedding is not.
        seed: seed for the `lora_a` init (None: the global RNG).

    Returns:
        the replaced module paths, in model order. Only `lora_a` / `lora_b` are trainable.
    """
    if rank <= 0:
        raise GrpoError(f"lora.rank must be a positive integer, got {rank}")
    if alpha <= 0:
        raise GrpoError(f"lora.alpha must be positive, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise GrpoError(f"lora.dropout must be in [0, 1), got {dropout}")
    if isinstance(targets, str):
        raise GrpoError(f"lora.targets must be a list of module names, got the string {targets!r}")
    if lora_modules(model):
        raise GrpoError("model already has LoRA layers; apply_lora once per model")
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    chosen = [n for n in linears if _matches(n, targets)]
    if not chosen:
        available = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise GrpoError(
            f"lora.targets {list(targets)} match no linear layer; available: {available}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for path in chosen:
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lora = LoRALinear(linears[path], rank, alpha, dropout, generator=gen)
        setattr(owner, leaf, lora.train(linears[path].training))  # eval model: no dropout
    return chosen


def lora_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The trainable LoRA parameters (`lora_a`, `lora_b` of every `LoRALinear`)."""
    for m in lora_modules(model).values():
        yield m.lora_a
        yield m.lora_b


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`<path>.lora_a` (r, in) / `<path>.lora_b` (out, r) -> detached tensors, our names."""
    out = {}
    for path, m in lora_modules(model).items():
        out[f"{path}.lora_a"] = m.lora_a.detach()
        out[f"{path}.lora_b"] = m.lora_b.detach()
    return out


def _shared_ids(model: nn.Module) -> set[int]:
    """ids of Parameters registered on more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (no-op for those already merged)."""
    shared = _shared_ids(model)
    for m in lora_modules(model).values():
        m.merge(shared=id(m.weight) in shared)


def unmerge_lora(model: nn.Module) -> None:
    """Undo `merge_lora` (no-op for unmerged layers)."""
    for m in lora_modules(model).values():
        m.unmerge()


@contextlib.contextmanager
def disabled_lora(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block `model` computes the base model: the reference policy, no second copy.

    Unmerged layers just skip their LoRA branch (exactly the base). Merged layers are unmerged
    on entry and merged again on exit (tied weights exactly, others within float rounding).
    """
    mods = lora_modules(model).values()
    state = [(m, m.disabled, m.merged) for m in mods]
    for m in mods:
        m.unmerge()
        m.disabled = True
    try:
        yield model
    finally:
        shared = _shared_ids(model)
        for m, disabled, merged in state:
            m.disabled = disabled
            if merged:
                m.merge(shared=id(m.weight) in shared)


def unwrap_lora(model: nn.Module) -> list[str]:
    """Merge and replace every `LoRALinear` by a plain `nn.Linear` at the same path (export).

    A tied lm_head ends up untied (its own merged weight) and `model.config` says so.

    Returns:
        the unwrapped module paths.
    """
    merge_lora(model)
    paths = []
    for path, m in lora_modules(model).items():
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        linear.weight = m.weight
        if m.bias is not None:
            linear.bias = m.bias
        linear.train(m.training)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, linear)
        if m._shared_weight and path == "lm_head" and hasattr(model, "config"):
            model.config = dataclasses.replace(model.config, tie_word_embeddings=False)
        paths.append(path)
    return paths
