"""Our decoder for the Llama / Qwen2 / Qwen3 families and its HF-format checkpoint I/O."""

from grpo.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from grpo.models.decoder import Decoder
from grpo.models.hf_checkpoint import load_model, parse_dtype, save_pretrained
from grpo.models.kv_cache import KVCache, RowKVCache

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "RowKVCache",
    "load_model",
    "parse_dtype",
    "save_pretrained",
]
