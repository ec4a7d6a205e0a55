"""LoRA: hand-written low-rank adapters and PEFT-compatible adapter files.

- `grpo.lora.layers`: `LoRALinear`, `apply_lora`, merge / unmerge / disable / unwrap.
- `grpo.lora.adapter`: `save_adapter` / `load_adapter` in PEFT's file layout, `grpo merge`.

See docs/lora.md.
"""

from grpo.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_adapter,
    merge_command,
    read_adapter_config,
    save_adapter,
)
from grpo.lora.layers import (
    DEFAULT_TARGETS,
    LoRALinear,
    apply_lora,
    disabled_lora,
    lora_modules,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    unmerge_lora,
    unwrap_lora,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DEFAULT_TARGETS",
    "LoRALinear",
    "apply_lora",
    "disabled_lora",
    "load_adapter",
    "lora_modules",
    "lora_parameters",
    "lora_state_dict",
    "merge_command",
    "merge_lora",
    "read_adapter_config",
    "save_adapter",
    "unmerge_lora",
    "unwrap_lora",
]
