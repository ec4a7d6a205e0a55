"""ModelConfig: the decoder's architecture, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo.errors import GrpoError
from grpo.io import read_json

# HF `architectures[0]` / `model_type` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Sequence classifiers (reward models): the same decoder with a `score` head (num_labels
# outputs, no bias) in place of the lm_head, read at each row's last non-pad token.
CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def classifier_architecture(model_dir: str | Path) -> str | None:
    """The `*ForSequenceClassification` architecture that `model_dir`/config.json names (a
    reward model: a scalar score head, no lm_head), None for anything else, a hub id or a
    directory without a readable config.json (the loader says what is wrong with those)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    archs = config.get("architectures") if isinstance(config, dict) else None
    archs = archs if isinstance(archs, list) else []
    found = [a for a in archs if isinstance(a, str) and a.endswith("ForSequenceClassification")]
    return found[0] if found else None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one `Decoder`. Families differ only by flags:

    llama: no bias, no qk-norm; qwen2: q/k/v bias; qwen3: per-head RMSNorm on q and k.
    """

    family: str = "qwen3"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # A sequence classifier (`*ForSequenceClassification`, a reward model): its head's outputs
    # (None: a causal LM) and the pad id that marks the token it scores (the last one that is
    # not pad_token_id, as `transformers` reads it)
    num_labels: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.family not in _MODEL_TYPES:
            raise GrpoError(
                f"model family {self.family!r} is not supported; supported: {sorted(_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise GrpoError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise GrpoError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")

    @classmethod
    def from_hf(cls, config: str | Path | dict) -> ModelConfig:
        """Build from a HF `config.json` (path, directory, or parsed dict)."""
        where = "config"
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise GrpoError(f"no config.json at {path}")
            where = str(path)
            config = read_json(path, "a Hugging Face config.json")
            if not isinstance(config, dict):
                raise GrpoError(f"{path}: holds a {type(config).__name__}; expected an object")
        archs = config.get("architectures") or []
        family, classifier = None, False
        for arch in archs:
            family = SUPPORTED_ARCHITECTURES.get(arch)
            if family is None and arch in CLASSIFIER_ARCHITECTURES:
                family, classifier = CLASSIFIER_ARCHITECTURES[arch], True
            if family:
                break
        if family is None and not archs:
            family = _MODEL_TYPES.get(config.get("model_type", ""))
        if family is None:
            name = archs[0] if archs else config.get("model_type")
            known = sorted(SUPPORTED_ARCHITECTURES) + sorted(CLASSIFIER_ARCHITECTURES)
            raise GrpoError(f"unsupported architecture {name!r}; supported: {known}")
        for key in _REQUIRED_FIELDS:
            value = config.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GrpoError(
                    f"{where}: field {key!r} must be a positive integer, got {value!r} "
                    "(a Hugging Face config.json)"
                )
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters` (theta + scaling); older files have
        # `rope_theta` and `rope_scaling` at the top level.
        rope_params = dict(config.get("rope_parameters") or {})
        rope_theta = config.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        rope_scaling = config.get("rope_scaling") or rope_params or None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        num_labels = None
        if classifier:  # transformers writes id2label; num_labels only when given explicitly
            num_labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
        return cls(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", family != "llama"),
            # qwen2 always has q/k/v bias; llama may opt in with attention_bias.
            attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            num_labels=num_labels,
            pad_token_id=config.get("pad_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `transformers.AutoConfig` reads back."""
        names = CLASSIFIER_ARCHITECTURES if self.num_labels else SUPPORTED_ARCHITECTURES
        arch = {v: k for k, v in names.items()}[self.family]
        out = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings and not self.num_labels,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.family in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if self.family == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        if self.pad_token_id is not None:
            out["pad_token_id"] = self.pad_token_id
        if self.num_labels:
            out["num_labels"] = self.num_labels
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d
