"""Data: GSM8K loading, the SFT / RL formats, the offline mini-math generator, a name registry."""

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
from grpo.data.minimath import is_test_question, minimath

__all__ = [
    "MATH_SYSTEM_PROMPT",
    "available_datasets",
    "format_math_dataset",
    "get_dataset",
    "is_test_question",
    "load_gsm8k",
    "minimath",
    "parse_split",
    "register_dataset",
    "sft_solution",
    "split_solution",
]
