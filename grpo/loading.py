"""The one way to load what a run reads: a trained model and dataset rows.

    spec = resolve_trained("runs/sft")           # a run / final / adapter dir, or a checkpoint
    model, tokenizer, stops, device = load_trained_model(spec, "float32", "auto")
    rows = load_rows(cfg.data, "test", 64, "rl", tokenizer)

A trained model is a base checkpoint, the LoRA adapters folded into it (in order) and a
tokenizer (`TrainedModel`); training, SFT, evaluation, the pipeline, the tool and the server all
load it through `load_trained_model`. Rows are rendered with the tokenizer of the model that
reads them (its chat template and its token ids), and a prompt longer than
`data.max_prompt_len` fails naming its row. (`grpo.models.hf_checkpoint` is the layer below:
one HF checkpoint's weights.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from grpo.config import Config, DataConfig, load_config
from grpo.errors import GrpoError
from grpo.models.config import classifier_architecture


@dataclass(frozen=True)
class TrainedModel:
    """A model as stored on disk: a base checkpoint plus LoRA adapters to fold in, in order."""

    path: str  # a local HF-format directory or a hub id
    adapters: tuple[str, ...] = ()
    tokenizer: str | None = None  # default: path

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class LoadedModel(NamedTuple):
    """What `load_trained_model` returns (unpacks as model, tokenizer, stop_ids, device)."""

    model: torch.nn.Module  # a `grpo.models.Decoder`, adapters merged, in eval mode
    tokenizer: object
    stop_ids: list[int]
    device: torch.device


def resolve_device(name: str | torch.device) -> torch.device:
    """`model.device` -> a torch device: auto is cuda when available, else cpu."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise GrpoError(
            f"model.device: {name!r} is not a device (auto, cpu, cuda, cuda:N)"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GrpoError(f"model.device is {name!r} but CUDA is not available")
    return dev


def config_model(cfg: Config) -> TrainedModel:
    """The model a config starts from: model.path with model.adapter folded in."""
    m = cfg.model
    return TrainedModel(m.path, (m.adapter,) if m.adapter else (), m.tokenizer)


def trained_model(cfg: Config, final: str | Path) -> TrainedModel:
    """What a finished run of `cfg` (weights in `final`) is: base + adapters, or a checkpoint."""
    if cfg.lora.enabled:
        return TrainedModel(
            cfg.model.path, (*config_model(cfg).adapters, str(final)), cfg.model.tokenizer
        )
    return TrainedModel(str(final), (), str(final))


def resolve_trained(path: str | Path) -> TrainedModel:
    """A run directory, its `final/`, an adapter directory, or a plain checkpoint / hub id.

    A run directory (with config.yaml and final/) resolves through its config, so an adapter
    trained on top of a merged one brings both; a bare adapter directory uses the base named
    in its adapter_config.json.
    """
    p = Path(path)
    for weights in (p / "final", p):
        arch = classifier_architecture(weights)
        if arch is not None:  # `grpo rm`'s output: its config.yaml reads like a LoRA policy's
            raise GrpoError(
                f"{path} is a reward model ({arch}: a scalar score head, as `grpo rm` writes), "
                "not a causal LM: it scores text and cannot generate, so it cannot be served "
                "or evaluated as a chat model; use it as a reward "
                f"(rewards: [{{name: reward_model, kwargs: {{path: {weights}}}}}], docs/rewards.md)"
            )
    if (p / "final").is_dir() and (p / "config.yaml").is_file():
        return trained_model(load_config(p / "config.yaml"), p / "final")
    if p.name == "final" and (p.parent / "config.yaml").is_file():
        return resolve_trained(p.parent)
    if (p / "adapter_config.json").is_file():
        from grpo.lora import read_adapter_config

        base = read_adapter_config(p).get("base_model_name_or_path")
        if not base:
            raise GrpoError(f"{p}: adapter_config.json names no base_model_name_or_path")
        tok = str(p) if (p / "tokenizer_config.json").is_file() else None
        return TrainedModel(str(base), (str(p),), tok)
    return TrainedModel(str(path))


def load_trained_model(
    spec: TrainedModel, dtype: str = "float32", device: str | torch.device = "auto"
) -> LoadedModel:
    """Load `spec`: the base checkpoint, each adapter merged in (so the result is a plain
    `Decoder`), its tokenizer and the ids that end a completion.

    Args:
        spec: what to load (see `resolve_trained`, `trained_model`, `config_model`).
        dtype: parameter dtype (float32 | bfloat16 | float16).
        device: auto, cpu, cuda, cuda:N or a torch.device.

    Returns:
        `LoadedModel(model, tokenizer, stop_ids, device)`, the model in eval mode.
    """
    from grpo.lora import load_adapter, unwrap_lora
    from grpo.models import load_model
    from grpo.tokenizer import load_tokenizer, stop_ids

    dev = resolve_device(device)
    model = load_model(spec.path, dtype=dtype, device=dev)
    if model.config.num_labels:
        raise GrpoError(
            f"{spec.path} is a sequence classifier (a reward model: "
            f"{model.config.to_hf()['architectures'][0]}); a policy is a causal LM. "
            "A reward model is used as a reward (docs/rewards.md)"
        )
    for adapter in spec.adapters:
        load_adapter(model, adapter)
        unwrap_lora(model)
    tok = load_tokenizer(spec.tokenizer_path)
    model_dir = Path(spec.path) if Path(spec.path).is_dir() else None
    return LoadedModel(model.eval(), tok, stop_ids(tok, model_dir), dev)


def dataset_rows(data: DataConfig, split: str, max_samples: int | None):
    """The raw {question, answer, ...} rows of `split` that `load_rows` renders (a Dataset)."""
    from grpo.data import get_dataset
    from grpo.data.formats import SOURCE_DATASETS

    kwargs = {}
    if data.dataset == "minimath":
        kwargs = {"seed": data.seed, "difficulty": data.difficulty}
    elif data.dataset in SOURCE_DATASETS and data.source:
        kwargs = {"source": data.source}
    return get_dataset(data.dataset, split=split, max_samples=max_samples, **kwargs)


def load_rows(
    data: DataConfig,
    split: str,
    max_samples: int | None,
    format_type: str,
    tokenizer,
    *,
    limit_name: str = "data.max_prompt_len",
) -> list[dict]:
    """Dataset rows of `split` in the SFT or RL format for `tokenizer`, with `prompt_ids`.

    Args:
        data: the data settings (dataset, source, system prompt, thinking, max_prompt_len).
        split: split name, optionally sliced (``"test[:200]"``).
        max_samples: keep at most this many rows (None: all).
        format_type: "sft" (prompt + completion) or "rl" (prompt + ground truth).
        tokenizer: renders the chat template and gives `prompt_ids`; rows are only valid for
            models that share it.
        limit_name: how errors name `data.max_prompt_len` (a CLI flag, say).

    Returns:
        the rows as dicts; a prompt longer than `data.max_prompt_len` tokens fails naming its
        row and length, and an empty selection fails naming the dataset and split.
    """
    from grpo.data import format_math_dataset
    from grpo.tokenizer import encode_prompt

    ds = dataset_rows(data, split, max_samples)
    if len(ds) == 0:
        raise GrpoError(f"data: dataset {data.dataset!r} split {split!r} has no rows")
    ds = format_math_dataset(
        ds,
        format_type,
        tokenizer=tokenizer,
        system_prompt=data.system_prompt,
        enable_thinking=data.enable_thinking,
    )
    rows = ds.to_list()
    for i, row in enumerate(rows):
        if format_type == "rl":  # the question as plain text: no special-token text in it forges
            # chat structure (grpo.tokenizer.encode_chat); the ids of the rendered prompt else
            row["prompt_ids"] = encode_prompt(
                tokenizer, row["question"], data.system_prompt, data.enable_thinking
            )
        else:
            row["prompt_ids"] = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        if len(row["prompt_ids"]) > data.max_prompt_len:
            raise GrpoError(
                f"data: prompt of row {i} of {data.dataset!r} ({split}) has "
                f"{len(row['prompt_ids'])} tokens > {limit_name} {data.max_prompt_len}"
            )
    return rows
