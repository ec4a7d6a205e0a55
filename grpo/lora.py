"""LoRA: the `LoRALinear` module, injection, merge / unmerge / disable, PEFT-format adapter files.

Design. `LoRALinear` *replaces* an `nn.Linear` at the same module path and keeps the base
weight as its own `weight` / `bias` parameters (torchtune style, no `.base` submodule), so

- the base tensors keep their names (`layers.0.self_attn.q_proj.weight`): checkpoint code and
  anything that reads `model.lm_head.weight` are unaffected;
- a tied `lm_head` wrapper holds the very same Parameter as `embed_tokens.weight` (no copy);
- `unwrap_lora` merges and puts back a plain `nn.Linear` with the same parameter at the same
  path, which `save_pretrained` writes as an ordinary HF checkpoint.

Adapter files use PEFT's layout: `adapter_model.safetensors` with keys
`base_model.model.<hf module path>.lora_{A,B}.weight` and `adapter_config.json`.

Tied lm_head: merging a LoRA into a tied `lm_head` would also change the input embedding, so a
merge of a wrapper whose weight is shared gives it its own merged copy (V x C more memory) and
unmerge re-ties it exactly; `unwrap_lora` keeps the untied weight and sets the model config's
`tie_word_embeddings` to False so the exported checkpoint stores `lm_head.weight`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from grpo.errors import GrpoError
from grpo.models.loading import (
    hf_name,
    load_model,
    our_name,
    parse_dtype,
    resolve_model_dir,
    save_pretrained,
)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


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
        out = F.linear(x2d, self.weight, self.bias)  # (N, out), a fresh tensor
        if self.merged or self.disabled:
            return out.view(*lead, self.out_features)
        t = self.dropout(x2d) @ self.lora_a.t()  # (N, r)
        # Accumulate into the base output in place: no second (N, out) temporary. Legal for
        # autograd because the base matmul saves its inputs, never its output.
        out.addmm_(t, self.lora_b.t(), alpha=self.scale)
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


def _peft_key(path: str, which: str) -> str:
    return f"{_PEFT_PREFIX}{_hf_path(path)}.lora_{which}.weight"


def _adapter_targets(model: nn.Module, paths: list[str]) -> list[str]:
    """Leaf names if they select exactly `paths` (the usual case), else the full HF paths."""
    leaves = sorted({p.rsplit(".", 1)[-1] for p in paths})
    candidates = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, LoRALinear)) and _matches(n, leaves)
    ]
    return leaves if candidates == paths else [_hf_path(p) for p in paths]


def save_adapter(
    model: nn.Module, out_dir: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """Write `adapter_model.safetensors` + `adapter_config.json` in PEFT's format.

    Args:
        model: a model with LoRA layers (merged or not; the adapter tensors are the same).
        out_dir: created if missing.
        base_model_name_or_path: recorded in the config (PEFT uses it to find the base).

    Returns:
        `out_dir` as a Path.
    """
    mods = lora_modules(model)
    if not mods:
        raise GrpoError("save_adapter: the model has no LoRA layers (call apply_lora first)")
    first = next(iter(mods.values()))
    tensors = {}
    for path, m in mods.items():
        tensors[_peft_key(path, "A")] = m.lora_a.detach().contiguous().cpu()
        tensors[_peft_key(path, "B")] = m.lora_b.detach().contiguous().cpu()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": first.dropout_p,
        "target_modules": _adapter_targets(model, list(mods)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_adapter_config(adapter_dir: str | Path) -> dict:
    """Parse and validate `adapter_config.json`; refuses what `LoRALinear` cannot represent."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise GrpoError(f"no {ADAPTER_CONFIG} in adapter directory {adapter_dir}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise GrpoError(f"{path} is not valid JSON: {e}") from None
    if cfg.get("peft_type") != "LORA":
        raise GrpoError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in cfg:
            raise GrpoError(f"{path}: missing field {key!r}")
    unsupported = {
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    for key, ok in unsupported.items():
        if cfg.get(key, ok) not in (ok, None):
            raise GrpoError(f"{path}: {key}={cfg[key]!r} is not supported (expected {ok!r})")
    if isinstance(cfg["target_modules"], str):
        raise GrpoError(f"{path}: regex target_modules {cfg['target_modules']!r} are not supported")
    return cfg


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> list[str]:
    """Load a PEFT-format LoRA adapter (ours or PEFT's) into `model`, in place.

    A model without LoRA gets `apply_lora` from `adapter_config.json` first. Every tensor must
    fit: unknown modules, wrong shapes or a different rank fail with a GrpoError naming it.

    Args:
        model: the base `Decoder`, or one with (unmerged) LoRA layers of the same rank.
        adapter_dir: directory with `adapter_config.json` + `adapter_model.safetensors`.

    Returns:
        the module paths that received an adapter.
    """
    cfg = read_adapter_config(adapter_dir)
    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise GrpoError(f"no {ADAPTER_WEIGHTS} in adapter directory {adapter_dir}")
    if not lora_modules(model):
        apply_lora(
            model,
            cfg["r"],
            cfg["lora_alpha"],
            cfg.get("lora_dropout") or 0.0,
            cfg["target_modules"],
        )
    mods = lora_modules(model)
    for path, m in mods.items():
        if m.rank != cfg["r"] or m.alpha != cfg["lora_alpha"]:
            raise GrpoError(
                f"adapter {adapter_dir} has r={cfg['r']}, lora_alpha={cfg['lora_alpha']} but "
                f"the model's LoRA at {path} has r={m.rank}, alpha={m.alpha}"
            )
        if m.merged:
            raise GrpoError(f"load_adapter: LoRA at {path} is merged; call unmerge_lora first")
    try:
        tensors = load_file(str(weights))
    except SafetensorError as e:
        raise GrpoError(f"{weights} is not a valid safetensors file: {e}") from None
    todo = {(p, w) for p in mods for w in ("A", "B")}
    for key, t in tensors.items():
        path, which = _parse_peft_key(key)
        if which == "base_layer":  # PEFT stores a targeted tied lm_head's frozen weight too
            m = mods.get(path)
            if m is None or not torch.equal(t.to(m.weight), m.weight):
                raise GrpoError(
                    f"{weights.name}: {key} is a base weight that differs from the model's"
                )
            continue
        if path not in mods or which not in ("A", "B"):
            raise GrpoError(f"{weights.name}: tensor {key} matches no LoRA layer of the model")
        m = mods[path]
        param = m.lora_a if which == "A" else m.lora_b
        if t.shape != param.shape:
            raise GrpoError(
                f"{weights.name}: {key} has shape {tuple(t.shape)}, expected {tuple(param.shape)} "
                f"(r={m.rank}, in={m.in_features}, out={m.out_features})"
            )
        with torch.no_grad():
            param.copy_(t)
        todo.discard((path, which))
    if todo:
        missing = sorted(_peft_key(p, w) for p, w in todo)
        raise GrpoError(f"{weights.name} is missing {len(missing)} tensors, e.g. {missing[0]}")
    return list(mods)


def _parse_peft_key(key: str) -> tuple[str, str]:
    """PEFT key -> (our module path, "A" | "B" | "base_layer" | "?").

    `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight` -> (`layers.0.mlp.up_proj`, "A").
    """
    name = key.removeprefix(_PEFT_PREFIX)
    if not name.endswith(".weight"):
        return name, "?"
    module, _, which = name[: -len(".weight")].rpartition(".")
    which = {"lora_A": "A", "lora_B": "B", "base_layer": "base_layer"}.get(which, "?")
    return our_name(module + ".weight")[: -len(".weight")], which


def merge_command(
    model_path: str | Path, adapter_dir: str | Path, out_dir: str | Path, dtype: str | None = None
) -> Path:
    """`grpo merge`: base checkpoint + adapter -> a plain HF checkpoint `transformers` loads.

    Merges in float32 and saves in `dtype` (default: the base checkpoint's dtype). Tokenizer
    and generation-config files of the model directory are copied along.

    Args:
        model_path: base model directory or hub id.
        adapter_dir: PEFT-format adapter directory.
        out_dir: output directory (created).
        dtype: "float32" / "bfloat16" / "float16" or None.

    Returns:
        `out_dir` as a Path.
    """
    model_dir = resolve_model_dir(model_path)
    if dtype is None:
        hf_cfg = json.loads((model_dir / "config.json").read_text())
        dtype = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32"
    save_dtype = parse_dtype(dtype)
    model = load_model(model_dir, dtype=torch.float32)
    load_adapter(model, adapter_dir)
    unwrap_lora(model)
    out = save_pretrained(model, out_dir, dtype=save_dtype)
    for name in _TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    return out
