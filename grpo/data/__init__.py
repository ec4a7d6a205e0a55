"""Data: GSM8K loading, the SFT / RL formats, GSM8K as code-interpreter traces, the offline
mini-math generator, a name registry."""

from grpo.data.formats import (
    MATH_SYSTEM_PROMPT,
    available_datasets,
    format_math_dataset,
    get_dataset,
    register_dataset,
    sft_solution,
    split_solution,
)
from grpo.data.gsm8k import load_gsm8k, parse_split
from grpo.data.gsm8k_tools import gsm8k_tools_sft
from grpo.data.minimath import is_test_question, minimath

# GSM8K as code-interpreter SFT traces (reads data.source like `gsm8k`); registered here, not
# among formats' built-ins, because grpo.data.gsm8k_tools builds on grpo.data.formats
register_dataset("gsm8k-tools-sft", gsm8k_tools_sft)

__all__ = [
    "MATH_SYSTEM_PROMPT",
    "available_datasets",
    "format_math_dataset",
    "get_dataset",
    "gsm8k_tools_sft",
    "is_test_question",
    "load_gsm8k",
    "minimath",
    "parse_split",
    "register_dataset",
    "sft_solution",
    "split_solution",
]
