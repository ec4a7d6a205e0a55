"""Turn {question, answer} datasets into the SFT and RL formats, and name datasets for configs.

SFT rows: ``prompt`` (the question rendered with the chat template, ending with the assistant
header) and ``completion`` (the worked solution as ``Step 1: ...`` lines and ``Final Answer: X``,
calculator marks ``<<...>>`` removed, ending with the tokenizer's eos token).

SFT rows of multi-turn traces (a ``messages`` column, e.g. ``gsm8k-tools-sft``): one
``prompt`` / ``completion`` pair per assistant turn (`trace_pairs`).

RL rows: ``question``, ``prompt``, ``ground_truth`` (the ``####`` value, thousands commas removed)
and ``full_answer`` (the original solution).

Other columns (``steps``, ``difficulty``, ...) pass through unchanged. ``get_dataset(name)``
resolves a config's ``data.dataset``: a name given to `register_dataset`, the built-ins
``gsm8k``, ``gsm8k-tools-sft`` (GSM8K as code-interpreter traces, `grpo.data.gsm8k_tools`;
both read ``data.source``) and ``minimath``, or else a `load_gsm8k` source (hub id or local
path).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict

from grpo.data.gsm8k import check_max_samples, check_rows, load_gsm8k, parse_split, select_rows
from grpo.data.minimath import minimath
from grpo.errors import GrpoError
from grpo.io import hub_unreachable
from grpo.tokenizer import render_prompt

FORMAT_TYPES = ("sft", "rl")
# what the trainer hands reward functions besides the dataset's own columns
# (grpo.experience.collect.score_rollout): a dataset column may not take these names
RESERVED_COLUMNS = (
    "completions",
    "completion_lengths",
    "completion_ids",
    "prompt_ids",
    "num_turns",
    "env_info",
)
SOURCE_DATASETS = ("gsm8k", "gsm8k-tools-sft")  # names that read GSM8K from data.source
MATH_SYSTEM_PROMPT = (
    "Solve the math problem step by step. Write each step on its own line as 'Step k: ...' "
    "and finish with 'Final Answer: <number>'."
)
MINIMATH_SIZES = {"train": 2000, "test": 500}
_CALC_MARK_RE = re.compile(r"<<[^<>]*>>")

DatasetLike = Dataset | DatasetDict | list[dict[str, Any]]
# Datasets registered by users: name -> a dataset or a factory(split=..., **kwargs).
_REGISTERED: dict[str, DatasetLike | Callable[..., DatasetLike]] = {}


def format_math_dataset(
    dataset: Dataset | list[dict[str, Any]],
    format_type: str = "sft",
    tokenizer: Any = None,
    system_prompt: str | None = None,
    enable_thinking: bool | None = None,
) -> Dataset:
    """Rewrite {question, answer} rows in the SFT or RL format (see the module docstring).

    Args:
        dataset: rows with ``question`` and ``answer`` (a GSM8K solution ending ``#### N``, or
            a bare one-line final answer).
        format_type: ``"sft"`` or ``"rl"``.
        tokenizer: a `transformers` tokenizer with a chat template (and, for SFT, an eos token).
        system_prompt: optional system message, e.g. `MATH_SYSTEM_PROMPT`.
        enable_thinking: passed to the chat template when not None (Qwen3).

    Returns:
        a new Dataset in the requested format. SFT rows that already hold rendered
        ``prompt`` and ``completion`` texts are returned as they are.

    Raises:
        GrpoError: unknown format, missing tokenizer / chat template / eos, or a bad row.
    """
    if format_type not in FORMAT_TYPES:
        raise GrpoError(
            f"format_type must be one of {', '.join(FORMAT_TYPES)}, got {format_type!r}"
        )
    if tokenizer is None:
        raise GrpoError("format_math_dataset needs a tokenizer to render prompts")
    if isinstance(dataset, list):
        dataset = Dataset.from_list(dataset) if dataset else Dataset.from_dict({})
    if format_type == "sft" and {"prompt", "completion"} <= set(dataset.column_names):
        return dataset  # already rendered (e.g. one pair per turn of a tool-use trace)
    check_rows(dataset, "dataset")
    if format_type == "sft" and "messages" in dataset.column_names:
        return trace_pairs(dataset, tokenizer, system_prompt, enable_thinking)
    eos = getattr(tokenizer, "eos_token", None)
    if format_type == "sft" and not eos:
        raise GrpoError("tokenizer has no eos_token to end SFT completions with")
    # a trace (`messages`) is SFT's; RL rows and evaluation read question and answer
    extra = [c for c in dataset.column_names if c not in ("question", "answer", "messages")]
    if format_type == "rl":
        taken = [c for c in extra if c in RESERVED_COLUMNS]
        if taken:
            raise GrpoError(
                f"dataset: column {taken[0]!r} is a name the trainer itself passes to reward "
                f"functions (reserved: {', '.join(RESERVED_COLUMNS)}); rename the column"
            )
    rows = []
    for i, row in enumerate(dataset):
        prompt = render_prompt(tokenizer, row["question"], system_prompt, enable_thinking)
        steps, final = split_solution(row["answer"], row=i)
        out = {k: row[k] for k in extra}
        if format_type == "sft":
            out.update(prompt=prompt, completion=sft_solution(steps, final) + eos)
        else:
            out.update(
                question=row["question"],
                prompt=prompt,
                ground_truth=final,
                full_answer=row["answer"],
            )
        rows.append(out)
    return Dataset.from_list(rows)


def trace_pairs(
    dataset: Dataset,
    tokenizer: Any,
    system_prompt: str | None = None,
    enable_thinking: bool | None = None,
) -> Dataset:
    """SFT rows of multi-turn traces: one (prompt, completion) pair per assistant turn.

    Args:
        dataset: rows with ``messages`` ([user, assistant, tool | user, assistant, ...], e.g.
            `grpo.data.gsm8k_tools.trace_rows`); other columns are copied to each pair.
        tokenizer, system_prompt, enable_thinking: as `format_math_dataset`.

    Returns:
        rows with ``prompt``, ``completion`` (ending with eos) and ``turn`` (0, 1, ...). Each
        prompt is what the multi-turn sampler builds (`grpo.data.toolmath.sft_pairs`): the
        first user turn rendered like an RL prompt, then every earlier assistant turn and the
        template's delta for the message that answered it, so SFT trains every turn.
    """
    from grpo.data.toolmath import sft_pairs

    extra = [c for c in dataset.column_names if c != "messages"]
    rows = []
    for i, row in enumerate(dataset):
        messages = row["messages"]
        if not messages or messages[0].get("role") != "user":
            raise GrpoError(f"row {i}: 'messages' must start with the user's question")
        pairs = sft_pairs(tokenizer, messages, system_prompt)
        if enable_thinking is not None:  # the first prompt as an RL row renders it
            user = messages[0]["content"]
            plain = render_prompt(tokenizer, user, system_prompt)
            first = render_prompt(tokenizer, user, system_prompt, enable_thinking)
            pairs = [{**p, "prompt": first + p["prompt"][len(plain) :]} for p in pairs]
        for turn, pair in enumerate(pairs):
            rows.append({**{k: row[k] for k in extra}, **pair, "turn": turn})
    return Dataset.from_list(rows)


def split_solution(answer: str, row: int | None = None) -> tuple[list[str], str]:
    """The reasoning lines (calculator marks removed) and final answer of a GSM8K solution.

    A solution without ``####`` must be a single line, which is then the final answer.
    Thousands commas are removed from the final answer (``1,200`` -> ``1200``).

    Raises:
        GrpoError: no ``####`` in a multi-line solution, or nothing after it (naming `row`).
    """
    where = "" if row is None else f"row {row}: "
    body, marker, final = answer.rpartition("####")
    if not marker:
        body, final = "", answer
        if "\n" in answer.strip():
            raise GrpoError(f"{where}answer has no '#### <final answer>' line")
    final = re.sub(r"(?<=\d),(?=\d{3})", "", final.strip())
    if not final:
        raise GrpoError(f"{where}answer has nothing after '####'")
    steps = [_CALC_MARK_RE.sub("", line).strip() for line in body.splitlines()]
    return [s for s in steps if s], final


def sft_solution(steps: list[str], final: str) -> str:
    """``Step 1: ...\\nStep 2: ...\\nFinal Answer: X`` (no eos)."""
    lines = [f"Step {k}: {step}" for k, step in enumerate(steps, start=1)]
    return "\n".join([*lines, f"Final Answer: {final}"])


def register_dataset(
    name: str, dataset: DatasetLike | Callable[..., DatasetLike], *, overwrite: bool = False
) -> None:
    """Make a dataset available to configs as ``data.dataset: <name>``.

    Args:
        name: the config name (may shadow ``gsm8k`` / ``minimath`` only with `overwrite`).
        dataset: rows with ``question`` and ``answer``: a Dataset, a DatasetDict (split by
            name), a list of dicts, or a factory ``fn(split=..., **kwargs)`` returning one.
        overwrite: allow replacing an existing name (logged and recorded in the run's
            metadata: `grpo.plugins.note_replacement`).
    """
    from grpo.plugins import note_replacement

    if not isinstance(name, str) or not name:
        raise GrpoError(f"dataset name must be a non-empty string, got {name!r}")
    if not overwrite and (name in _REGISTERED or name in _builtins()):
        raise GrpoError(
            f"dataset {name!r} is already registered; pass overwrite=True to replace it"
        )
    if not callable(dataset) and not isinstance(dataset, (Dataset, DatasetDict, list)):
        raise GrpoError(
            f"dataset {name!r}: expected a Dataset, DatasetDict, list of dicts or factory, "
            f"got {type(dataset).__name__}"
        )
    old = _REGISTERED.get(name, _builtins().get(name))
    if old is not None and old is not dataset:
        note_replacement("dataset", name, old, dataset)
    _REGISTERED[name] = dataset


def available_datasets() -> list[str]:
    """Registered and built-in dataset names (any other name is tried as a GSM8K source)."""
    return sorted(set(_builtins()) | set(_REGISTERED))


def get_dataset(
    name: str, split: str = "train", max_samples: int | None = None, **kwargs: Any
) -> Dataset:
    """Resolve a config's dataset name to {question, answer} rows.

    Args:
        name: a registered name, ``gsm8k`` (hub), ``minimath``, or a `load_gsm8k` source.
        split: split name with optional slice, e.g. ``"test[:200]"``.
        max_samples: keep at most this many rows.
        **kwargs: passed to a factory, e.g. ``seed``, ``difficulty``, ``n`` for minimath. A
            factory with a ``max_samples`` parameter also receives `max_samples`.

    Returns:
        a Dataset with non-empty ``question`` and ``answer`` columns.
    """
    check_max_samples(max_samples)
    entry = _REGISTERED.get(name, _builtins().get(name))
    if entry is None:
        if kwargs:
            raise GrpoError(f"dataset {name!r}: unexpected options {sorted(kwargs)}")
        offline = None if Path(name).expanduser().exists() else hub_unreachable()
        if offline:  # a misspelt name would be tried as a hub id for half a minute
            raise GrpoError(
                f"dataset {name!r} is not a registered name ({', '.join(available_datasets())}) "
                f"nor a local file or directory, and the hub cannot be reached to load it as a "
                f"hub id ({offline}); pass a local .jsonl/.parquet file or directory"
            )
        return load_gsm8k(split, source=name, max_samples=max_samples)
    split_name, start, stop = parse_split(split)
    if callable(entry):
        if "max_samples" in _parameters(entry):
            kwargs["max_samples"] = max_samples  # lets a generator make only what is kept
        try:
            entry = entry(split=split_name, **kwargs)
        except TypeError as e:
            raise GrpoError(f"dataset {name!r}: {e}") from None
    elif kwargs:
        raise GrpoError(f"dataset {name!r} is fixed data and takes no options {sorted(kwargs)}")
    if isinstance(entry, DatasetDict):
        if split_name not in entry:
            raise GrpoError(f"dataset {name!r} has no split {split_name!r} ({', '.join(entry)})")
        entry = entry[split_name]
    if isinstance(entry, list):
        entry = Dataset.from_list(entry) if entry else Dataset.from_dict({})
    if not isinstance(entry, Dataset):
        raise GrpoError(f"dataset {name!r} gave a {type(entry).__name__}, expected a Dataset")
    return select_rows(entry, f"dataset {name!r}", start, stop, max_samples)


def _minimath_dataset(
    split: str = "train",
    n: int | None = None,
    seed: int = 0,
    max_samples: int | None = None,
    **kwargs: Any,
) -> Dataset:
    """The built-in ``minimath`` entry: `n` problems, by default `MINIMATH_SIZES` or
    `max_samples` if larger."""
    if split not in MINIMATH_SIZES:
        raise GrpoError(f"dataset 'minimath' has splits train and test, not {split!r}")
    if n is None:
        n = max(MINIMATH_SIZES[split], max_samples or 0)
    return minimath(n, seed, split=split, **kwargs)


def _gsm8k_dataset(split: str = "train", source: str | None = None) -> Dataset:
    """The built-in ``gsm8k`` entry: the hub dataset ``openai/gsm8k``, or `source`."""
    return load_gsm8k(split, source=source or "openai/gsm8k")


def _parameters(fn: Callable[..., Any]) -> set[str]:
    """The parameter names of `fn` (empty when Python cannot tell)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _builtins() -> Mapping[str, Callable[..., Dataset]]:
    """Built-in dataset factories by name (``gsm8k-tools-sft`` is registered by grpo.data)."""
    return {"gsm8k": _gsm8k_dataset, "minimath": _minimath_dataset}
