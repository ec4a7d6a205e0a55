"""PEFT-format adapter files: `save_adapter`, `read_adapter_config`, `load_adapter`, and
`grpo merge` (base + adapter -> one HF checkpoint).

Layout, as PEFT writes and reads it: `adapter_model.safetensors` with keys
`base_model.model.<hf module path>.lora_{A,B}.weight`, and `adapter_config.json`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from grpo.errors import GrpoError
from grpo.io import load_safetensors, read_json, save_safetensors, write_text, writing
from grpo.lora.layers import (
    LoRALinear,
    _hf_path,
    _matches,
    apply_lora,
    lora_modules,
    unwrap_lora,
)
from grpo.models.config import classifier_architecture
from grpo.models.hf_checkpoint import (
    load_model,
    our_name,
    parse_dtype,
    resolve_model_dir,
    save_pretrained,
)

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
    save_safetensors(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    write_text(out / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return out


def read_adapter_config(adapter_dir: str | Path) -> dict:
    """Parse and validate `adapter_config.json`; refuses what `LoRALinear` cannot represent."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise GrpoError(f"no {ADAPTER_CONFIG} in adapter directory {adapter_dir}")
    cfg = read_json(path, "a PEFT adapter_config.json")
    if not isinstance(cfg, dict):
        raise GrpoError(f"{path}: holds a {type(cfg).__name__}; expected an object")
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
    tensors = load_safetensors(weights)
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


def check_merge_output(out_dir: str | Path, inputs: dict[str, Path], overwrite: bool) -> Path:
    """Refuse an output that would damage an input or an earlier result, before any work.

    The output may not be an input directory, lie inside one, or contain one (replacing it
    would delete that input, --overwrite or not). An existing non-empty output directory needs
    `overwrite`; an existing file is never replaced.

    Args:
        out_dir: the output directory.
        inputs: flag -> input directory, e.g. {"--model": ..., "--adapter": ...}.
        overwrite: replace a non-empty output directory's contents.

    Returns:
        `out_dir` as a Path.
    """
    out = Path(out_dir)
    target = out.resolve()
    for flag, path in inputs.items():
        src = Path(path).resolve()
        if target == src:
            relation = "is"
        elif src in target.parents:
            relation = "is inside"
        elif target in src.parents:
            relation = "contains"
        else:
            continue
        raise GrpoError(f"--out {out} {relation} the {flag} directory {path}; write elsewhere")
    if out.exists() and not out.is_dir():
        raise GrpoError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        n = sum(1 for _ in out.iterdir())
        raise GrpoError(
            f"--out {out} is not empty ({n} entries); pass --overwrite to replace its contents"
        )
    return out


def check_merge_base(
    model_path: str | Path, model_dir: Path, adapter_dir: str | Path, any_base: bool = False
) -> None:
    """Refuse a merge that would write a model nobody trained: into a reward model (a
    `*ForSequenceClassification` checkpoint: a policy adapter's deltas would land on its
    decoder and the result score, not generate), an adapter of another task than a causal
    LM's, or (unless `any_base`) an adapter whose `adapter_config.json` names another base
    than `model_path` (its `base_model_name_or_path`, as `grpo train` and PEFT record it; the
    same directory by another path, or the same name, is the same base). Raises GrpoError."""
    cfg = read_adapter_config(adapter_dir)
    recorded = cfg.get("base_model_name_or_path")
    arch = classifier_architecture(model_dir)
    if arch is not None:
        raise GrpoError(
            f"--model {model_path} is a reward model ({arch}: a scalar score head), not a "
            f"causal LM; grpo merge folds a policy's adapter into the base it was trained on "
            f"(this one's adapter_config.json names {recorded!r})"
        )
    task = cfg.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise GrpoError(
            f"--adapter {adapter_dir}: task_type {task!r} in its adapter_config.json; grpo "
            "merge folds CAUSAL_LM adapters (a policy's) into a causal LM"
        )
    if any_base or not recorded or str(recorded) == str(model_path):
        return
    named = Path(str(recorded))
    if named.is_dir() and named.resolve() == Path(model_dir).resolve():
        return
    raise GrpoError(
        f"--adapter {adapter_dir} was trained on {recorded!r} (its adapter_config.json's "
        f"base_model_name_or_path), not --model {model_path}; merge it into that base, or "
        "pass --any-base if this is the same model moved or renamed"
    )


def merge_command(
    model_path: str | Path,
    adapter_dir: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    overwrite: bool = False,
    any_base: bool = False,
) -> Path:
    """`grpo merge`: base checkpoint + adapter -> a plain HF checkpoint `transformers` loads.

    Merges in float32 and saves in `dtype` (default: the base checkpoint's dtype). Tokenizer
    and generation-config files of the model directory are copied along. The checkpoint is
    written beside `out_dir` first and moved into place when complete, so a failure (a full
    disk) leaves an existing `out_dir` as it was.

    Args:
        model_path: base model directory or hub id.
        adapter_dir: PEFT-format adapter directory.
        out_dir: output directory; see `check_merge_output` for what is refused.
        dtype: "float32" / "bfloat16" / "float16" or None.
        overwrite: replace the contents of a non-empty `out_dir`.
        any_base: merge even when the adapter's config names another base (see
            `check_merge_base`).

    Returns:
        `out_dir` as a Path.
    """
    model_dir = resolve_model_dir(model_path)
    out = check_merge_output(
        out_dir, {"--model": model_dir, "--adapter": Path(adapter_dir)}, overwrite
    )
    check_merge_base(model_path, model_dir, adapter_dir, any_base)
    model = load_model(model_dir, dtype=torch.float32)  # checks config.json and the weights
    if dtype is None:
        hf_cfg = read_json(model_dir / "config.json", "a Hugging Face config.json")
        dtype = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32"
    save_dtype = parse_dtype(dtype)
    load_adapter(model, adapter_dir)
    unwrap_lora(model)
    tmp = out.parent / f".{out.name}.merge-tmp-{os.getpid()}"
    try:
        save_pretrained(model, tmp, dtype=save_dtype)
        for name in _TOKENIZER_FILES:
            if (model_dir / name).is_file():
                with writing(tmp / name):
                    shutil.copy2(model_dir / name, tmp / name)
        if out.exists():
            shutil.rmtree(out)  # checked above: empty, or --overwrite
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
