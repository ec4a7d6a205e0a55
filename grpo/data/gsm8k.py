"""Load GSM8K-style data ({question, answer} rows) from the hub or from local files.

``source`` is a hub id (``openai/gsm8k``, config ``main``, through `datasets.load_dataset`) or a
local path: a ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file, or a directory holding
``{split}.jsonl``, ``{split}.csv``, ``{split}.parquet`` or shards ``{split}-*.parquet`` (also under
``main/`` or ``data/``, the hub's layouts). Local files are read in memory and never touch the
network or the `datasets` cache. Text files are UTF-8; a leading byte-order mark is dropped.
Splits take slices like ``train[:1000]``, ``test[100:200]``, ``train[:10%]``.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset, concatenate_datasets

from grpo.errors import GrpoError
from grpo.io import open_text, read_text

HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}
REQUIRED_COLUMNS = ("question", "answer")
_SPLIT_RE = re.compile(r"^(?P<name>[\w.-]+)(?:\[(?P<start>-?\d*%?):(?P<stop>-?\d*%?)\])?$")
_LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def load_gsm8k(
    split: str = "train", source: str | Path = "openai/gsm8k", max_samples: int | None = None
) -> Dataset:
    """Load a GSM8K-format split as a `datasets.Dataset` with ``question`` and ``answer``.

    Args:
        split: split name with an optional slice: ``"train"``, ``"test[:200]"``, ``"train[:5%]"``.
        source: hub id or local file / directory (see the module docstring). A single file is
            used whatever the split name; the slice still applies.
        max_samples: keep at most this many rows (after slicing), in order.

    Returns:
        the rows, every one with a non-empty ``question`` and ``answer`` (other columns kept).

    Raises:
        GrpoError: bad split, missing file, unreadable row, or a row without question/answer
            (naming the file and row).
    """
    check_max_samples(max_samples)
    name, start, stop = parse_split(split)
    path = Path(source).expanduser()
    if path.exists():
        dataset = _load_local(path, name)
    elif str(source).endswith(_LOCAL_SUFFIXES) or str(source).startswith((".", "/", "~")):
        raise GrpoError(f"dataset file not found: {str(source)!r}")
    else:
        dataset = _load_hub(str(source), name)
    return select_rows(dataset, str(source), start, stop, max_samples)


def parse_split(split: str) -> tuple[str, str | None, str | None]:
    """Split ``"train[10:20%]"`` into ``("train", "10", "20%")``; bounds are None when absent."""
    match = _SPLIT_RE.match(split.replace(" ", "")) if isinstance(split, str) else None
    if match is None:
        raise GrpoError(
            f"bad split {split!r}: expected a name with an optional slice, e.g. 'train', "
            "'train[:1000]', 'test[100:200]', 'train[:10%]'"
        )
    return match["name"], match["start"] or None, match["stop"] or None


def select_rows(
    dataset: Dataset,
    source: str,
    start: str | None = None,
    stop: str | None = None,
    max_samples: int | None = None,
) -> Dataset:
    """Check the question/answer columns, then apply a split slice and `max_samples`.

    Row numbers in errors are positions in `dataset` before slicing.
    """
    check_max_samples(max_samples)
    n = len(dataset)
    rows = range(n)[slice(_bound(start, n), _bound(stop, n))]
    if max_samples is not None:
        rows = rows[:max_samples]
    check_rows(dataset, source, rows)
    if len(rows) == n:
        return dataset
    return dataset.select(rows)


def check_max_samples(max_samples: int | None) -> None:
    """Raise a GrpoError unless `max_samples` is None or a positive integer."""
    ok = max_samples is None or (
        isinstance(max_samples, int) and not isinstance(max_samples, bool) and max_samples >= 1
    )
    if not ok:
        raise GrpoError(f"max_samples must be a positive integer or None, got {max_samples!r}")


def check_rows(dataset: Dataset, source: str, rows: Sequence[int] | None = None) -> None:
    """Raise a GrpoError naming the first row whose ``question`` or ``answer`` is missing."""
    for column in REQUIRED_COLUMNS:
        if column not in dataset.column_names:
            have = ", ".join(dataset.column_names) or "none"
            raise GrpoError(f"{source}: no {column!r} column (columns: {have})")
    rows = range(len(dataset)) if rows is None else rows
    if len(rows) == 0:
        return
    subset = dataset if len(rows) == len(dataset) else dataset.select(rows)
    for column in REQUIRED_COLUMNS:
        for i, value in zip(rows, subset[column]):
            if not isinstance(value, str) or not value.strip():
                raise GrpoError(f"{source}: row {i} has no {column!r} (got {value!r})")


def _bound(text: str | None, n: int) -> int | None:
    """A slice bound: an int, or a percent of n."""
    if text is None:
        return None
    if text.endswith("%"):
        return round(n * int(text[:-1]) / 100)
    return int(text)


def _load_local(path: Path, split: str) -> Dataset:
    """A local file, or the split's file(s) in a directory."""
    if path.is_file():
        return _read_file(path)
    files = _split_files(path, split)
    parts = [_read_file(f) for f in files]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _split_files(directory: Path, split: str) -> list[Path]:
    """The files of `split` in `directory` (or its ``main/`` / ``data/`` subfolder): one file,
    or the shards of one parquet split. Files of several kinds for one split (e.g. a .jsonl
    next to parquet shards) are refused, naming them, rather than one picked silently."""
    patterns = (
        f"{split}.jsonl",
        f"{split}.json",
        f"{split}.csv",
        f"{split}.parquet",
        f"{split}-*.parquet",
    )
    for folder in (directory, directory / "main", directory / "data"):
        kinds = [found for p in patterns if (found := sorted(folder.glob(p)))]
        if len(kinds) > 1:
            names = ", ".join(f.name for kind in kinds for f in kind)
            raise GrpoError(
                f"{folder}: several files for split {split!r} ({names}); keep one, "
                "or point data.source at the file to use"
            )
        if kinds:
            return kinds[0]
    raise GrpoError(
        f"{directory}: no file for split {split!r} (looked for {split}.jsonl, {split}.json, "
        f"{split}.csv, {split}.parquet, {split}-*.parquet, also under main/ and data/)"
    )


def _read_file(path: Path) -> Dataset:
    """A .jsonl/.json, .csv or .parquet file as an in-memory Dataset."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_json(path)
    if suffix == ".csv":
        return _read_csv(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return Dataset(pq.read_table(path))
        except Exception as e:
            raise GrpoError(f"{path}: cannot read parquet: {e}") from None
    raise GrpoError(
        f"{path}: unsupported file type {suffix!r} (expected .jsonl, .json, .csv, .parquet)"
    )


def _read_json(path: Path) -> Dataset:
    """JSON lines (or a JSON list of objects), checking every row has question and answer."""
    text = read_text(path, "UTF-8 JSON lines with question and answer")
    rows: list[Any]
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrpoError(f"{path}: invalid JSON: {e}") from None
        where = "row"
    else:
        rows, where = [], "line"
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise GrpoError(f"{path}: line {line_no} is not valid JSON: {e}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise GrpoError(f"{path}: {where} {i} is a {type(row).__name__}, expected an object")
        for column in REQUIRED_COLUMNS:
            value = row.get(column)
            if not isinstance(value, str) or not value.strip():
                raise GrpoError(f"{path}: row {i} has no {column!r} (got {value!r})")
    if not rows:
        raise GrpoError(f"{path}: no rows")
    return rows_dataset(rows, str(path))


def rows_dataset(rows: list[dict], source: str) -> Dataset:
    """`Dataset.from_list(rows)`; a column whose values Arrow cannot hold in one type (e.g. a
    number in one row, a string in another) is one line naming it and two such rows."""
    import pyarrow as pa

    try:
        return Dataset.from_list(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise GrpoError(
            f"{source}: {_mixed_column(rows) or f'rows Arrow cannot read ({e})'}; "
            "give every row the same type in each column"
        ) from None


def _mixed_column(rows: list[dict]) -> str | None:
    """'column 'x' holds an int at row 0 and a str at row 3' for the first such column."""
    first: dict[str, tuple[str, int]] = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            if value is None:
                continue
            kind = (
                "number"
                if isinstance(value, int | float) and not isinstance(value, bool)
                else type(value).__name__
            )
            seen = first.setdefault(key, (kind, i))
            if seen[0] != kind:
                return f"column {key!r} holds a {seen[0]} at row {seen[1]} and a {kind} at row {i}"
    return None


def _read_csv(path: Path) -> Dataset:
    """A CSV file whose header row names the columns (question and answer among them)."""
    rows = []
    with open_text(path, expected="UTF-8 CSV with a header row") as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                if None in row:  # DictReader's key for fields beyond the header
                    raise GrpoError(
                        f"{path}: line {reader.line_num} has more fields than the header"
                    )
                rows.append(row)
        except csv.Error as e:
            raise GrpoError(f"{path}: line {reader.line_num} is not valid CSV: {e}") from None
    if not rows:
        raise GrpoError(f"{path}: no rows")
    return rows_dataset(rows, str(path))


def _load_hub(source: str, split: str) -> Dataset:
    """A split from the Hugging Face hub (needs network or a filled `datasets` cache)."""
    import datasets

    from grpo.io import hub_unreachable

    offline = hub_unreachable()
    if offline and source in HUB_CONFIGS:  # the library would retry for half a minute
        raise GrpoError(
            f"dataset {source!r} is on the hub, which cannot be reached ({offline}); "
            "pass a local copy as data.source (a .jsonl/.parquet file or "
            "directory)"
        )
    if offline:
        raise GrpoError(
            f"dataset {source!r} is not a local file or directory, and the hub cannot be "
            f"reached to load it as a hub id ({offline}); pass a local .jsonl/.parquet file or "
            "directory"
        )
    try:
        return datasets.load_dataset(source, HUB_CONFIGS.get(source), split=split)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GrpoError(
            f"cannot load dataset {source!r} split {split!r} from the hub ({first_line}); "
            "offline, pass a local .jsonl/.parquet file or directory"
        ) from None
