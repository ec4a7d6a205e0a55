"""Tests for grpo.data: GSM8K loading (local files, hub path), SFT/RL formats, the registry."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

import grpo.io
from grpo.data import (
    MATH_SYSTEM_PROMPT,
    format_math_dataset,
    get_dataset,
    load_gsm8k,
    parse_split,
    register_dataset,
    split_solution,
)
from grpo.data import formats as data_formats
from grpo.errors import GrpoError
from grpo.rewards import extract_answer

GSM8K_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"  # GSM8K test split, vendored

ROWS = [
    {
        "question": "Natalia sold clips to 48 friends in April and half as many in May. Total?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72",
    },
    {
        "question": "A farm has 1,000 hens and buys 200 more. How many hens?",
        "answer": "1000+200 = <<1000+200=1200>>1200\n#### 1,200",
    },
    {"question": "Q3?", "answer": "3 - 5 = <<3-5=-2>>-2\n#### -2"},
    {"question": "Q4?", "answer": "#### 4"},
]


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    """Each test registers datasets into its own empty registry."""
    monkeypatch.setattr(data_formats, "_REGISTERED", {})


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "split, expected",
    [
        ("train", ("train", None, None)),
        ("train[:1000]", ("train", None, "1000")),
        ("test[100:200]", ("test", "100", "200")),
        ("train[10%:]", ("train", "10%", None)),
        ("train[-5:]", ("train", "-5", None)),
    ],
)
def test_parse_split(split, expected):
    assert parse_split(split) == expected


@pytest.mark.parametrize("split", ["train[:", "train[1]", "", "tr ain[x:y]"])
def test_parse_split_errors(split):
    with pytest.raises(GrpoError, match="bad split"):
        parse_split(split)


def test_load_jsonl_slices_and_max_samples(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", ROWS)
    ds = load_gsm8k("train", source=str(path))
    assert isinstance(ds, Dataset) and len(ds) == 4 and ds[0] == ROWS[0]
    assert load_gsm8k("train[1:3]", source=path)["question"] == [ROWS[1]["question"], "Q3?"]
    assert load_gsm8k("train[:50%]", source=path)["question"] == [r["question"] for r in ROWS[:2]]
    assert load_gsm8k("train[-1:]", source=path)["question"] == ["Q4?"]
    assert len(load_gsm8k("train", source=path, max_samples=3)) == 3
    assert len(load_gsm8k("train[1:]", source=path, max_samples=10)) == 3


def test_load_directory_layouts(tmp_path):
    jsonl_dir = tmp_path / "jsonl"
    jsonl_dir.mkdir()
    _write_jsonl(jsonl_dir / "train.jsonl", ROWS)
    _write_jsonl(jsonl_dir / "test.jsonl", ROWS[:1])
    assert len(load_gsm8k("train", source=jsonl_dir)) == 4
    assert len(load_gsm8k("test", source=jsonl_dir)) == 1

    # the hub's layout: main/train-0000x-of-00002.parquet shards, concatenated in order
    shards = tmp_path / "hub" / "main"
    shards.mkdir(parents=True)
    Dataset.from_list(ROWS[:2]).to_parquet(shards / "train-00000-of-00002.parquet")
    Dataset.from_list(ROWS[2:]).to_parquet(shards / "train-00001-of-00002.parquet")
    ds = load_gsm8k("train[1:]", source=tmp_path / "hub")
    assert ds["question"] == [r["question"] for r in ROWS[1:]]
    # a .jsonl next to the shards: which one is meant is not guessed
    _write_jsonl(shards / "train.jsonl", ROWS[:1])
    with pytest.raises(
        GrpoError,
        match=r"main: several files for split 'train' \(train.jsonl, "
        r"train-00000-of-00002.parquet, train-00001-of-00002.parquet\); keep "
        r"one, or point data.source at the file to use$",
    ):
        load_gsm8k("train", source=tmp_path / "hub")
    assert len(load_gsm8k("train", source=shards / "train.jsonl")) == 1

    single = tmp_path / "one.parquet"
    Dataset.from_list(ROWS).to_parquet(single)
    assert load_gsm8k("test", source=single)["answer"] == [r["answer"] for r in ROWS]


def test_a_column_of_mixed_types_is_one_line_naming_it(tmp_path):
    rows = [{**ROWS[0], "id": 1}, {**ROWS[1], "id": 2.5}, {**ROWS[2], "id": "x"}]
    with pytest.raises(
        GrpoError,
        match=r"^\S*mixed.jsonl: column 'id' holds a number at row 0 "
        r"and a str at row 2; give every row the same type in each column$",
    ):
        load_gsm8k("train", source=_write_jsonl(tmp_path / "mixed.jsonl", rows))
    ok = [{**ROWS[0], "id": 1}, {**ROWS[1], "id": 2.5}, {**ROWS[2], "id": None}]
    assert load_gsm8k("train", source=_write_jsonl(tmp_path / "ok.jsonl", ok))["id"] == [
        1,
        2.5,
        None,
    ]


def test_load_errors_name_file_and_row(tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], {"question": "no answer"}])
    with pytest.raises(GrpoError, match=r"bad.jsonl: row 2 has no 'answer'"):
        load_gsm8k("train", source=bad)
    empty = _write_jsonl(tmp_path / "empty_q.jsonl", [ROWS[0], {"question": " ", "answer": "1"}])
    with pytest.raises(GrpoError, match=r"row 1 has no 'question'"):
        load_gsm8k("train", source=empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(GrpoError, match=r"broken.jsonl: line 2 is not valid JSON"):
        load_gsm8k("train", source=broken)
    no_col = tmp_path / "no_col.parquet"
    Dataset.from_list([{"question": "q", "solution": "s"}]).to_parquet(no_col)
    with pytest.raises(GrpoError, match=r"no_col.parquet: no 'answer' column \(columns: question"):
        load_gsm8k("train", source=no_col)
    with pytest.raises(GrpoError, match="dataset file not found: './missing.jsonl'"):
        load_gsm8k("train", source="./missing.jsonl")
    with pytest.raises(GrpoError, match="no file for split 'validation'"):
        load_gsm8k("validation", source=tmp_path)
    with pytest.raises(GrpoError, match="max_samples must be a positive integer"):
        load_gsm8k("train", source=bad, max_samples=0)


def test_load_hub_id_goes_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setitem(grpo.io._HUB_PROBES, ("huggingface.co", 443), None)  # "reachable"
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    ds = load_gsm8k("train[:2]")
    assert calls == [("openai/gsm8k", "main", "train")] and len(ds) == 2

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(GrpoError, match="cannot load dataset 'openai/gsm8k' split 'test'.*offline"):
        load_gsm8k("test")


def test_an_unreachable_hub_fails_in_seconds_naming_the_source(monkeypatch):
    """No network: a hub id or a misspelt dataset name is one line at once, not half a
    minute of the libraries' retries. The probe is a real connect to a closed local port."""
    import socket

    import grpo.data.formats as formats
    from grpo.models.hf_checkpoint import resolve_model_dir

    with socket.socket() as s:  # a port nothing listens on: the connect is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(grpo.io, "_HUB_PROBES", {})
    start = time.monotonic()
    with pytest.raises(
        GrpoError,
        match=r"^dataset 'gsm8kk' is not a registered name \(gsm8k, "
        r".*minimath\) nor a local file or directory, and the hub cannot be "
        rf"reached to load it as a hub id \(127.0.0.1:{port}: ",
    ):
        formats.get_dataset("gsm8kk")
    with pytest.raises(
        GrpoError,
        match=r"^dataset 'openai/gsm8k' is on the hub, which cannot "
        r"be reached .*; pass a local copy as data.source",
    ):
        load_gsm8k("test")
    with pytest.raises(
        GrpoError,
        match=r"^model 'Org/nowhere-0.6B': not a local directory, not "
        r"in the hub cache, and the hub cannot be reached",
    ):
        resolve_model_dir("Org/nowhere-0.6B")
    assert time.monotonic() - start < 10


def test_load_real_gsm8k():
    full = load_gsm8k("test", source=GSM8K_DIR)  # a directory: the split's file inside it
    assert len(full) == 1319 and set(full.column_names) >= {"question", "answer"}
    test = load_gsm8k("test[:100]", source=GSM8K_DIR / "test.jsonl")
    assert len(test) == 100 and test[0]["answer"].rstrip().endswith("#### 18")
    assert test[:100]["question"] == full[:100]["question"]


# ---------------------------------------------------------------- formats


def test_split_solution():
    steps, final = split_solution(ROWS[0]["answer"])
    assert steps == [
        "Natalia sold 48/2 = 24 clips in May.",
        "Natalia sold 48+24 = 72 clips altogether.",
    ]
    assert final == "72"
    assert split_solution(ROWS[1]["answer"])[1] == "1200"  # thousands comma dropped
    assert split_solution("42") == ([], "42")  # a bare final answer
    with pytest.raises(GrpoError, match="row 7: answer has no '#### <final answer>' line"):
        split_solution("line one\nline two", row=7)
    with pytest.raises(GrpoError, match="row 3: answer has nothing after '####'"):
        split_solution("work\n####  ", row=3)


def test_sft_format(tiny_tokenizer):
    ds = format_math_dataset(Dataset.from_list(ROWS), "sft", tokenizer=tiny_tokenizer)
    assert ds.column_names == ["prompt", "completion"]
    row = ds[0]
    messages = [{"role": "user", "content": ROWS[0]["question"]}]
    assert row["prompt"] == tiny_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert row["prompt"].endswith("<|im_start|>assistant\n")
    assert row["completion"] == (
        "Step 1: Natalia sold 48/2 = 24 clips in May.\n"
        "Step 2: Natalia sold 48+24 = 72 clips altogether.\n"
        "Final Answer: 72<|im_end|>"
    )
    assert ds[3]["completion"] == "Final Answer: 4<|im_end|>"
    assert [extract_answer(c) for c in ds["completion"]] == ["72", "1200", "-2", "4"]


def test_rl_format_with_system_prompt_and_extra_columns(tiny_tokenizer):
    rows = [dict(r, steps=i) for i, r in enumerate(ROWS)]
    ds = format_math_dataset(
        rows,
        "rl",
        tokenizer=tiny_tokenizer,
        system_prompt=MATH_SYSTEM_PROMPT,
        enable_thinking=False,
    )
    assert set(ds.column_names) == {"question", "prompt", "ground_truth", "full_answer", "steps"}
    assert ds["ground_truth"] == ["72", "1200", "-2", "4"]
    assert ds["full_answer"] == [r["answer"] for r in ROWS] and ds["steps"] == [0, 1, 2, 3]
    prompt = ds[0]["prompt"]
    assert prompt.startswith(f"<|im_start|>system\n{MATH_SYSTEM_PROMPT}<|im_end|>\n")
    assert ROWS[0]["question"] in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking


def test_format_errors(tiny_tokenizer):
    class NoTemplate:
        chat_template = None
        eos_token = "</s>"
        name_or_path = "plain-tokenizer"

    with pytest.raises(GrpoError, match="'plain-tokenizer' has no chat template"):
        format_math_dataset(ROWS, "rl", tokenizer=NoTemplate())
    with pytest.raises(GrpoError, match="format_type must be one of sft, rl"):
        format_math_dataset(ROWS, "dpo", tokenizer=tiny_tokenizer)
    with pytest.raises(GrpoError, match="needs a tokenizer"):
        format_math_dataset(ROWS, "sft")
    bad = [*ROWS, {"question": "Q?", "answer": "two\nlines"}]
    with pytest.raises(GrpoError, match="row 4: answer has no '####"):
        format_math_dataset(bad, "sft", tokenizer=tiny_tokenizer)
    with pytest.raises(GrpoError, match="no 'answer' column"):
        format_math_dataset([{"question": "Q?"}], "sft", tokenizer=tiny_tokenizer)
    # a column the trainer passes reward functions itself: named, not blamed on a reward
    for name in ("completions", "completion_ids", "num_turns"):
        rows = [{**r, name: "x"} for r in ROWS]
        with pytest.raises(
            GrpoError,
            match=f"^dataset: column '{name}' is a name the trainer "
            "itself passes to reward functions",
        ):
            format_math_dataset(rows, "rl", tokenizer=tiny_tokenizer)


# ---------------------------------------------------------------- registry


def test_register_and_get_dataset(tmp_path):
    register_dataset("mine", Dataset.from_list(ROWS))
    assert len(get_dataset("mine")) == 4
    assert get_dataset("mine", split="train[2:]", max_samples=1)["question"] == ["Q3?"]
    register_dataset("as_list", ROWS[:2])
    assert len(get_dataset("as_list")) == 2
    register_dataset("splits", DatasetDict(test=Dataset.from_list(ROWS[:1])))
    assert len(get_dataset("splits", split="test")) == 1
    with pytest.raises(GrpoError, match="no split 'train'"):
        get_dataset("splits")

    def factory(split="train", size=2):
        return [{"question": f"{split} {i}?", "answer": f"#### {i}"} for i in range(size)]

    register_dataset("made", factory)
    assert get_dataset("made", split="test", size=3)["question"] == [
        "test 0?",
        "test 1?",
        "test 2?",
    ]
    with pytest.raises(GrpoError, match="dataset 'made'.*unexpected keyword argument 'colour'"):
        get_dataset("made", colour="red")
    with pytest.raises(GrpoError, match="already registered"):
        register_dataset("mine", ROWS)
    with pytest.raises(GrpoError, match="already registered"):
        register_dataset("minimath", ROWS)
    register_dataset("bad", [{"question": "q", "answer": ""}])
    with pytest.raises(GrpoError, match="dataset 'bad': row 0 has no 'answer'"):
        get_dataset("bad")
    # any other name is a load_gsm8k source
    path = _write_jsonl(tmp_path / "custom.jsonl", ROWS)
    assert len(get_dataset(str(path), split="train[:3]")) == 3


def test_get_dataset_minimath():
    train = get_dataset("minimath", split="train[:5]", seed=3)
    assert len(train) == 5 and {"question", "answer", "steps"} <= set(train.column_names)
    assert train["question"] == get_dataset("minimath", max_samples=5, seed=3)["question"]
    assert len(get_dataset("minimath", max_samples=2500)) == 2500  # more than the default 2000
    test = get_dataset("minimath", split="test", n=20, difficulty=1)
    assert len(test) == 20 and set(test["difficulty"]) == {1}
    with pytest.raises(GrpoError, match="splits train and test, not 'validation'"):
        get_dataset("minimath", split="validation")
