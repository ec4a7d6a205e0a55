"""Checkpoint I/O in Hugging Face format: the only file that knows HF tensor names.

HF names are ours with a `model.` prefix (`model.layers.0.self_attn.q_proj.weight`), except
`lm_head.weight`, which is absent from checkpoints with tied embeddings, and a sequence
classifier's `score.weight` (`*ForSequenceClassification`, a reward model).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from grpo.errors import GrpoError
from grpo.io import read_json, safetensors_file, save_safetensors, write_text
from grpo.models.config import ModelConfig
from grpo.models.decoder import Decoder, meta_decoder, rope_inv_freq

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise GrpoError(f"unknown dtype {dtype!r}; valid: {sorted(_DTYPES)}")
    return _DTYPES[dtype]


_HEADS = ("lm_head.", "score.")  # top-level names in HF checkpoints


def hf_name(name: str) -> str:
    """Our parameter name -> the HF checkpoint name."""
    return name if name.startswith(_HEADS) else "model." + name


def our_name(name: str) -> str:
    """HF checkpoint name -> our parameter name."""
    return name[len("model.") :] if name.startswith("model.") else name


def resolve_model_dir(path_or_id: str | Path) -> Path:
    """A local directory as is; otherwise a hub id downloaded (config, weights, tokenizer)."""
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists() or str(path_or_id).startswith((".", "/")) or str(path_or_id).count("/") != 1:
        raise GrpoError(f"model path {str(path_or_id)!r} is not a directory or a hub id")
    from grpo.io import hub_unreachable

    offline = hub_unreachable()  # then only the local cache can serve it, at once
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
        return Path(
            snapshot_download(
                str(path_or_id), allow_patterns=patterns, local_files_only=offline is not None
            )
        )
    except Exception as e:  # offline, unknown repo, auth...
        if offline:
            raise GrpoError(
                f"model {str(path_or_id)!r}: not a local directory, not in the hub "
                f"cache, and the hub cannot be reached ({offline}); pass a local "
                "checkpoint directory"
            ) from None
        raise GrpoError(f"could not fetch model {str(path_or_id)!r} from the hub: {e}") from None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index, "a safetensors index with a weight_map")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise GrpoError(f"{index}: no 'weight_map' object; expected a safetensors index")
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GrpoError(
            f"no safetensors weights in {model_dir} (pickle .bin checkpoints are not loaded)"
        )
    return files


def load_model(
    path_or_id: str | Path,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_labels: int | None = None,
    pad_token_id: int | None = None,
) -> Decoder:
    """Load a HF-format Llama / Qwen2 / Qwen3 checkpoint (single or sharded safetensors): a
    causal LM, or a sequence classifier (`*ForSequenceClassification`) as it is stored.

    Args:
        path_or_id: a local directory with config.json + *.safetensors, or a hub id.
        dtype: parameter dtype (weights are cast on load).
        device: where the parameters live.
        num_labels: a sequence classifier with this many outputs: a causal LM's decoder with a
            new zero `score` head (its lm_head dropped), or a classifier's own (which must
            have as many).
        pad_token_id: a new classifier's pad id (`ModelConfig.pad_token_id`; default: the
            checkpoint's).

    Returns:
        a `Decoder` in eval mode.
    """
    model_dir = resolve_model_dir(path_or_id)
    cfg = ModelConfig.from_hf(model_dir)
    new_head = bool(num_labels) and not cfg.num_labels
    if num_labels and cfg.num_labels and cfg.num_labels != num_labels:
        raise GrpoError(
            f"{model_dir} is a classifier with {cfg.num_labels} outputs, not {num_labels}"
        )
    if new_head:
        pad = cfg.pad_token_id if pad_token_id is None else pad_token_id
        cfg = dataclasses.replace(cfg, num_labels=num_labels, pad_token_id=pad)
    dtype = parse_dtype(dtype)
    model = meta_decoder(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and not cfg.num_labels:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)

    params = dict(model.named_parameters())  # tied weights appear once, as embed_tokens
    loaded: set[str] = set()
    for file in _weight_files(model_dir):
        with safetensors_file(file) as f:
            for key in f.keys():
                name = our_name(key)
                if name == "lm_head.weight" and (cfg.tie_word_embeddings or new_head):
                    continue
                if name not in params:
                    raise GrpoError(f"{file}: unexpected tensor {key!r} for a {cfg.family}")
                t = f.get_tensor(key)
                if t.shape != params[name].shape:
                    raise GrpoError(
                        f"{file}: {key} has shape {tuple(t.shape)}, expected "
                        f"{tuple(params[name].shape)} (from {model_dir / 'config.json'})"
                    )
                with torch.no_grad():
                    params[name].copy_(t)
                loaded.add(name)
    if new_head:  # a reward model starts neutral: every score 0
        with torch.no_grad():
            model.score.weight.zero_()
        loaded.add("score.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise GrpoError(f"checkpoint {model_dir} is missing tensors: {missing[:5]}...")
    return model.eval()


def save_pretrained(model: Decoder, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors that `transformers.AutoModelForCausalLM` loads
    (a classifier's: `AutoModelForSequenceClassification`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf()
    tensors = {}
    for name, p in model.named_parameters():  # tied lm_head is skipped (same Parameter)
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):  # merged in (`merge_lora`) first
            continue
        t = p.detach()
        if dtype is not None:
            t = t.to(dtype)
        tensors[hf_name(name)] = t.contiguous().cpu()
        cfg["torch_dtype"] = str(t.dtype).removeprefix("torch.")
    save_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_text(out / "config.json", json.dumps(cfg, indent=2) + "\n")
    return out
