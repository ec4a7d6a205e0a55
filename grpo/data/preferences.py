"""Preference data for reward-model training (Bradley-Terry): load chosen/rejected rows, encode
them as token ids, and generate mini-math preference pairs offline.

Row formats (TRL's names):

- explicit prompt: ``prompt`` + ``chosen`` + ``rejected``, all three strings (plain text, no
  chat template), or ``prompt`` a message list and ``chosen`` / ``rejected`` the assistant
  turn(s) as message lists or strings (one assistant message each);
- implicit prompt: ``chosen`` + ``rejected`` only, each the whole conversation as a message
  list (the prompt is their longest common leading run of messages, at least one) or as a
  string (the prompt is their longest common character prefix, possibly empty);
- an optional ``margin`` column (a finite number; missing or null is 0).

Other columns pass unread. A bad row is one `GrpoError` naming the source and the row.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict

from grpo.data import formats
from grpo.data.formats import sft_solution, split_solution
from grpo.data.gsm8k import _bound, _load_hub, _split_files, check_max_samples, parse_split
from grpo.errors import GrpoError
from grpo.io import read_text
from grpo.tokenizer import encode_chat, plain_ids

_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class PreferencePair:
    """One encoded preference: a shared prompt and the two completions."""

    prompt_ids: list[int]  # shared by both sides (possibly truncated from the left)
    chosen_ids: list[int]  # completion tokens of the chosen side (never truncated)
    rejected_ids: list[int]  # completion tokens of the rejected side (never truncated)
    margin: float = 0.0  # the row's margin column (0 when absent)
    row: int = 0  # index of the source row (for messages)


# --- Loading rows --------------------------------------------------------------------------


def load_preference_rows(
    source: str, split: str = "train", max_samples: int | None = None
) -> list[dict]:
    """The raw rows of a preference dataset (not checked: `preference_pairs` does that).

    Args:
        source: a name given to `grpo.data.register_dataset` (a list, Dataset, DatasetDict or
            factory, as `get_dataset` takes them); a local ``.jsonl`` / ``.json`` / ``.parquet``
            file, or a directory holding ``{split}.jsonl``, ``{split}.json``,
            ``{split}.parquet`` or shards ``{split}-*.parquet`` (also under ``data/``); or a
            hub id (`datasets.load_dataset`).
        split: split name with an optional slice: ``"train"``, ``"test[:10]"``,
            ``"train[:10%]"``. A single file is used whatever the name; the slice still applies.
        max_samples: keep at most this many rows (after slicing), in order.

    Returns:
        the rows as dicts, in order.

    Raises:
        GrpoError: bad split, missing or unreadable file, a hub id while the hub cannot be
            reached, or a registered entry of the wrong kind.
    """
    check_max_samples(max_samples)
    name, start, stop = parse_split(split)
    source = str(source)
    entry = formats._REGISTERED.get(source)
    path = Path(source).expanduser()
    if entry is not None:
        rows = _registered_rows(source, entry, name, max_samples)
    elif path.exists():
        rows = _read_local(path, name)
    elif source.endswith(_LOCAL_SUFFIXES) or source.startswith((".", "/", "~")):
        raise GrpoError(f"preference data not found: {source!r}")
    else:
        rows = _load_hub(source, name).to_list()
    rows = rows[slice(_bound(start, len(rows)), _bound(stop, len(rows)))]
    return rows if max_samples is None else rows[:max_samples]


def _registered_rows(source: str, entry: Any, split: str, max_samples: int | None) -> list[dict]:
    """The rows of a registered entry's `split` (a factory is called as `get_dataset` does)."""
    if callable(entry):
        kwargs = {"max_samples": max_samples} if "max_samples" in formats._parameters(entry) else {}
        try:
            entry = entry(split=split, **kwargs)
        except TypeError as e:
            raise GrpoError(f"dataset {source!r}: {e}") from None
    if isinstance(entry, DatasetDict):
        if split not in entry:
            raise GrpoError(f"dataset {source!r} has no split {split!r} ({', '.join(entry)})")
        entry = entry[split]
    if isinstance(entry, Dataset):
        return entry.to_list()
    if isinstance(entry, list):
        return list(entry)
    raise GrpoError(f"dataset {source!r} gave a {type(entry).__name__}, expected a Dataset")


def _read_local(path: Path, split: str) -> list[dict]:
    """A local file, or the file(s) of `split` in a directory."""
    files = [path] if path.is_file() else _split_files(path, split)
    return [row for f in files for row in _read_file(f)]


def _read_file(path: Path) -> list[dict]:
    """The rows of a .jsonl / .json (JSON lines or one list of objects) or .parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise GrpoError(f"{path}: cannot read parquet: {e}") from None
    elif suffix in (".jsonl", ".json"):
        rows = _read_json(path)
    else:
        raise GrpoError(
            f"{path}: unsupported file type {suffix!r} for preference data "
            "(expected .jsonl, .json, .parquet)"
        )
    if not rows:
        raise GrpoError(f"{path}: no rows")
    return rows


def _read_json(path: Path) -> list[dict]:
    """JSON lines, or a JSON list of objects."""
    text = read_text(path, "UTF-8 JSON lines of preference rows")
    if text.lstrip().startswith("["):
        try:
            rows, where = json.loads(text), "row"
        except json.JSONDecodeError as e:
            raise GrpoError(f"{path}: invalid JSON: {e}") from None
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
    return rows


# --- Encoding ------------------------------------------------------------------------------


def encode_prompt_completion(
    tokenizer, prompt: str | list[dict], completion: str | list[dict]
) -> tuple[list[int], list[int]]:
    """The (prompt_ids, completion_ids) of one side of a preference.

    Message form (`prompt` a message list, `completion` the assistant turn(s) as messages or a
    string, which becomes one assistant message): the conversation is encoded whole with
    `encode_chat` (contents as plain text), and cut where it stops agreeing with the prompt
    encoded with the generation prompt: a template may render the generation prompt unlike a
    history turn (Qwen3's empty think block), so the cut is their longest common token prefix.

    String form (both strings): each is `plain_ids`, no chat template; special-token strings
    stay plain text.

    Raises:
        GrpoError: a string prompt with a message completion or the reverse, another type, or
            a conversation the chat template cannot encode.
    """
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise GrpoError(f"a string prompt takes a string completion, got a {_kind(completion)}")
        return plain_ids(tokenizer, prompt), plain_ids(tokenizer, completion)
    if not isinstance(prompt, list):
        raise GrpoError(f"prompt must be a string or a message list, got a {_kind(prompt)}")
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    elif not isinstance(completion, list):
        raise GrpoError(
            f"a message-list prompt takes a message list or string completion, "
            f"got a {_kind(completion)}"
        )
    full = encode_chat(tokenizer, [*prompt, *completion], add_generation_prompt=False)
    head = encode_chat(tokenizer, prompt, add_generation_prompt=True)
    k = _common_prefix(full, head)
    return full[:k], full[k:]


def preference_pairs(
    rows: list[dict], tokenizer, max_length: int, source: str = "data"
) -> tuple[list[PreferencePair], int]:
    """Check and encode preference rows (formats in the module docstring).

    A pair longer than `max_length` (prompt + the longer completion) keeps the last
    ``max_length - max(len(chosen), len(rejected))`` prompt tokens: the prompt is cut from the
    left, never a completion. A row whose completion alone is longer than `max_length` is
    skipped and counted.

    Args:
        rows: raw rows, e.g. from `load_preference_rows`.
        tokenizer: a fast `transformers` tokenizer (with a chat template for message rows).
        max_length: most tokens of prompt + one completion.
        source: names the data in error messages.

    Returns:
        (pairs, skipped): the encoded pairs in row order, and how many rows were skipped as
        over-length.

    Raises:
        GrpoError: a bad row, naming `source`, the row index and what is wrong.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise GrpoError(f"max_length must be a positive integer, got {max_length!r}")
    pairs, skipped = [], 0
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        prompt, chosen, rejected = _extract(row, where)
        margin = _margin(row, where)
        try:
            prompt_c, chosen_ids = encode_prompt_completion(tokenizer, prompt, chosen)
            prompt_r, rejected_ids = encode_prompt_completion(tokenizer, prompt, rejected)
        except GrpoError as e:
            raise GrpoError(f"{where}: {e}") from None
        # the cut may differ by a token between the sides: share the common part
        k = _common_prefix(prompt_c, prompt_r)
        prompt_ids, chosen_ids, rejected_ids = (
            prompt_c[:k],
            prompt_c[k:] + chosen_ids,
            prompt_r[k:] + rejected_ids,
        )
        for side, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
            if not ids:
                raise GrpoError(f"{where}: {side} has no completion tokens")
        if chosen_ids == rejected_ids:
            raise GrpoError(f"{where}: chosen and rejected encode to the same tokens")
        longest = max(len(chosen_ids), len(rejected_ids))
        if longest > max_length:
            skipped += 1
            continue
        keep = max_length - longest
        prompt_ids = prompt_ids[max(0, len(prompt_ids) - keep) :]
        pairs.append(PreferencePair(prompt_ids, chosen_ids, rejected_ids, margin, i))
    return pairs, skipped


def _extract(row: Any, where: str) -> tuple[str | list[dict], Any, Any]:
    """(prompt, chosen completion, rejected completion) of a row in any format, checked."""
    if not isinstance(row, dict):
        raise GrpoError(f"{where}: is a {type(row).__name__}, expected an object")
    missing = [c for c in ("chosen", "rejected") if row.get(c) is None]
    if missing:
        have = ", ".join(sorted(row)) or "none"
        raise GrpoError(
            f"{where}: no {' or '.join(map(repr, missing))} column (columns: {have}); "
            "expected prompt + chosen + rejected, or chosen + rejected"
        )
    chosen, rejected = row["chosen"], row["rejected"]
    if row.get("prompt") is not None:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            for side, value in (("chosen", chosen), ("rejected", rejected)):
                if isinstance(value, list):
                    raise GrpoError(
                        f"{where}: prompt is a string but {side} is a message "
                        "list; use strings for all three, or messages"
                    )
                _check_text(value, where, side)
        elif isinstance(prompt, list):
            prompt = _messages(prompt, where, "prompt")
            chosen = _completion(chosen, where, "chosen")
            rejected = _completion(rejected, where, "rejected")
            for side, completion in (("chosen", chosen), ("rejected", rejected)):
                named = [(f"prompt[{j}]", m) for j, m in enumerate(prompt)]
                named += [(f"{side}[{j}]", m) for j, m in enumerate(completion)]
                _check_roles(named, len(prompt), where)
        else:
            raise GrpoError(
                f"{where}: prompt must be a string or a message list, got a {_kind(prompt)}"
            )
    elif isinstance(chosen, list) and isinstance(rejected, list):
        chosen = _messages(chosen, where, "chosen")
        rejected = _messages(rejected, where, "rejected")
        k = _common_prefix(chosen, rejected)
        if k == 0 and chosen != rejected:
            raise GrpoError(
                f"{where}: chosen and rejected share no leading message, so there is "
                "no prompt; give a prompt column or start both with it"
            )
        for side, conversation in (("chosen", chosen), ("rejected", rejected)):
            named = [(f"{side}[{j}]", m) for j, m in enumerate(conversation)]
            _check_roles(named, k, where)
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    elif isinstance(chosen, str) and isinstance(rejected, str):
        k = _common_prefix(chosen, rejected)
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    else:
        for side, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, (str, list)):
                _check_text(value, where, side)
        raise GrpoError(
            f"{where}: chosen is a {_kind(chosen)} but rejected is a "
            f"{_kind(rejected)}; use strings for both, or messages"
        )
    if chosen == rejected:
        raise GrpoError(f"{where}: chosen and rejected are the same (after the prompt)")
    for side, value in (("chosen", chosen), ("rejected", rejected)):
        if not _has_text(value):
            raise GrpoError(f"{where}: {side} is empty (after the prompt)")
    return prompt, chosen, rejected


def _check_text(value: Any, where: str, field: str) -> None:
    """Raise unless `value` is a string."""
    if not isinstance(value, str):
        raise GrpoError(f"{where}: {field} must be a string, got a {_kind(value)}")


def _completion(value: Any, where: str, field: str) -> list[dict]:
    """An explicit completion: a message list, or a string as one assistant message."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list):
        raise GrpoError(
            f"{where}: {field} must be a string or a message list, got a {_kind(value)}"
        )
    return _messages(value, where, field)


def _messages(value: list, where: str, field: str) -> list[dict]:
    """Checked messages, null fields (as Arrow fills them in) dropped; a prompt list must hold
    at least one. A message with `tool_calls` may have a null content (read as "")."""
    if not value and field == "prompt":
        raise GrpoError(f"{where}: prompt is an empty message list")
    out = []
    for j, m in enumerate(value):
        ok = isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]
        content = m.get("content") if ok else None
        if content is None and ok and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise GrpoError(
                f"{where}: {field}[{j}] must be a message with a 'role' and a "
                f"'content' string, got {_short(m)}"
            )
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": content})
    return out


ROLES = ("system", "user", "assistant", "tool")  # what chat templates render


def _check_roles(named: list[tuple[str, dict]], reply: int, where: str) -> None:
    """Raise naming the message (`prompt[j]`, `chosen[j]`, ...) whose role is not a chat role
    or out of order in one side's conversation: `named` is (field, message) in order, the
    reply (the completion scored) from index `reply` on. A system message comes first only;
    a tool result follows an assistant message or another result; the prompt ends with a
    user message or a tool result; the reply is the assistant's (it begins with an assistant
    message and holds no user or system turn)."""
    for j, (field, m) in enumerate(named):
        role = m["role"]
        before = named[j - 1][1]["role"] if j else None
        if role not in ROLES:
            problem = f"{_short(role)} is not a chat role ({', '.join(ROLES)})"
        elif role == "system" and j:
            problem = "'system' comes after another message; a system message comes first"
        elif role == "tool" and before not in ("assistant", "tool"):
            problem = "'tool' (a tool result) must follow an assistant message or another result"
        elif j == reply and role != "assistant":
            problem = f"{role!r} begins the reply; the reply is the assistant's"
        elif j > reply and role not in ("assistant", "tool"):
            problem = f"{role!r} in the reply; the reply holds assistant messages and tool results"
        elif j == reply - 1 < len(named) - 1 and role not in ("user", "tool"):
            problem = f"{role!r} ends the prompt; the reply follows a user message or a tool result"
        else:
            continue
        raise GrpoError(f"{where}: {field}.role {problem}")


def _has_text(completion: str | list[dict]) -> bool:
    """Whether a completion says anything: text, or a tool call."""
    if isinstance(completion, str):
        return bool(completion.strip())
    return any(m["content"].strip() or m.get("tool_calls") for m in completion)


def _margin(row: dict, where: str) -> float:
    """The row's margin: a finite number, 0 when missing or null."""
    value = row.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, Real):
        raise GrpoError(f"{where}: margin must be a number, got {_short(value)}")
    if not math.isfinite(value):
        raise GrpoError(f"{where}: margin must be finite, got {value!r}")
    return float(value)


def _common_prefix(a: list | str, b: list | str) -> int:
    """The length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _kind(value: Any) -> str:
    """A value's kind for messages: "message list", "str", "int"..."""
    return "message list" if isinstance(value, list) else type(value).__name__


def _short(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- Mini-math preference pairs --------------------------------------------------------------

MATH_ERROR_KINDS = ("arithmetic", "operation", "operand", "final_answer", "no_final_answer")
_WORK_RE = re.compile(r"(?<!\d)(\d+)([-+*/])(\d+) = (\d+)(?!\d)")  # "5+3 = 8" in a step line
_WRONG_OPS = {"+": ("-", "*"), "-": ("+",), "*": ("/", "+"), "/": ("*", "-")}
_SLIPS = (-3, -2, -1, 1, 2, 3)

Work = tuple[int, str, int, int]  # one step line's "a op b = c"


def math_prompt_messages(question: str, system_prompt: str | None = None) -> list[dict]:
    """The prompt messages of a math RL row, as `grpo.tokenizer.encode_prompt` builds them: a
    system message when `system_prompt` is given (the demo gives none), then the question."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": question}]


def math_preferences(
    problems: list[dict],
    seed: int,
    pairs_per_problem: int = 2,
    system_prompt: str | None = None,
) -> list[dict]:
    """Preference rows from mini-math problems: the worked solution against wrong ones.

    `chosen` is the solution as SFT trains on it (`sft_solution`, without the eos text);
    `rejected` is the same text with one error, so only checking the arithmetic (or the final
    line) tells them apart. Error kinds (`MATH_ERROR_KINDS`), each leaving the answer wrong:

    - ``arithmetic``: one step's result off by 1-3, carried into later steps and the answer;
    - ``operation``: one step applies another operation (``-`` for ``+``, ``+`` for ``*``...),
      computed correctly and carried on;
    - ``operand``: one number of the problem misread (off by 1-3), computed correctly;
    - ``final_answer``: correct steps, but the final answer is another number;
    - ``no_final_answer``: correct steps, the ``Final Answer:`` line missing or garbled (wrong
      for the strict accuracy reward).

    Args:
        problems: mini-math rows (`grpo.data.minimath`, `grpo.apps.demo.demo_problems`) with
            ``question`` and ``answer``.
        seed: same seed, same rows; each problem's draws depend only on the seed and its
            question.
        pairs_per_problem: rows per problem, each of a different kind (1-5). A problem that
            admits fewer kinds gives fewer rows (``operation`` and ``operand`` can fail to fit
            in whole numbers; the other three always apply).
        system_prompt: the system message of the RL rows (`data.system_prompt`; the demo has
            none), so the prompt is exactly the policy's.

    Returns:
        rows in the explicit conversational format: ``prompt`` (messages), ``chosen``,
        ``rejected``, ``kind``, ``question``, ``ground_truth``.

    Raises:
        GrpoError: `pairs_per_problem` out of range, or a row whose answer is not a mini-math
            chain of ``a op b = c`` steps.
    """
    if isinstance(pairs_per_problem, bool) or pairs_per_problem not in range(
        1, len(MATH_ERROR_KINDS) + 1
    ):
        raise GrpoError(
            f"pairs_per_problem must be 1 to {len(MATH_ERROR_KINDS)}, got {pairs_per_problem!r}"
        )
    out = []
    for i, problem in enumerate(problems):
        question = problem.get("question") if isinstance(problem, dict) else None
        if not isinstance(question, str) or not isinstance(problem.get("answer"), str):
            raise GrpoError(f"problems[{i}]: expected a row with 'question' and 'answer' strings")
        lines, final = split_solution(problem["answer"], row=i)
        works = _parse_works(lines, final, f"problems[{i}]")
        chosen = sft_solution(lines, final)
        options = {kind: _wrong_texts(kind, lines, works) for kind in MATH_ERROR_KINDS}
        kinds = [kind for kind in MATH_ERROR_KINDS if options[kind]]
        rng = random.Random(f"math-preferences|{seed}|{question}")
        for kind in rng.sample(kinds, min(pairs_per_problem, len(kinds))):
            out.append(
                {
                    "prompt": math_prompt_messages(question, system_prompt),
                    "chosen": chosen,
                    "rejected": rng.choice(options[kind]),
                    "kind": kind,
                    "question": question,
                    "ground_truth": final,
                }
            )
    return out


def _parse_works(lines: list[str], final: str, where: str) -> list[Work]:
    """Each step line's ``a op b = c``, checked to be a correct chain ending at `final`."""
    works, value = [], None
    for k, line in enumerate(lines, start=1):
        found = _WORK_RE.findall(line)
        if len(found) != 1:
            raise GrpoError(f"{where}: step {k} is not one 'a op b = c' (not a mini-math row)")
        a, op, b, c = int(found[0][0]), found[0][1], int(found[0][2]), int(found[0][3])
        if (value is not None and a != value) or _exact(op, a, b) != c:
            raise GrpoError(f"{where}: step {k} ({a}{op}{b} = {c}) breaks the chain")
        works.append((a, op, b, c))
        value = c
    if not works or str(value) != final:
        raise GrpoError(f"{where}: the steps do not end at the final answer {final!r}")
    return works


def _exact(op: str, a: int, b: int) -> int | None:
    """a op b when it is a whole number, else None."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b if b and a % b == 0 else None


def _chain(start: int, steps: list[tuple[str, int]], slip: tuple[int, int] = (-1, 0)):
    """The works of `steps` from `start`, step slip[0]'s result off by slip[1] and carried on;
    None when a value would be fractional or negative."""
    works, value = [], start
    for k, (op, b) in enumerate(steps):
        c = _exact(op, value, b)
        if c is None:
            return None
        c += slip[1] if k == slip[0] else 0
        if c < 0:
            return None
        works.append((value, op, b, c))
        value = c
    return works


def _wrong_texts(kind: str, lines: list[str], works: list[Work]) -> list[str]:
    """Every wrong solution of `kind` (see `math_preferences`), in a fixed order; empty when
    the problem admits none (e.g. no misread divisor divides exactly)."""
    start, steps, answer = works[0][0], [(op, b) for _, op, b, _ in works], works[-1][3]
    if kind == "final_answer":
        values = {start, *(c for *_, c in works), *(answer + d for d in _SLIPS)}
        return [sft_solution(lines, str(v)) for v in sorted(values) if v >= 0 and v != answer]
    if kind == "no_final_answer":
        body = [f"Step {k}: {s}" for k, s in enumerate(lines, start=1)]
        endings = [[], [f"Final Answer {answer}"], [f"Answer: {answer}"], ["Final Answer:"]]
        return ["\n".join(body + end) for end in endings]
    n = len(steps)
    if kind == "arithmetic":
        chains = [_chain(start, steps, (k, d)) for k in range(n) for d in _SLIPS]
    elif kind == "operation":
        chains = [
            _chain(start, [*steps[:k], (op2, steps[k][1]), *steps[k + 1 :]])
            for k in range(n)
            for op2 in _WRONG_OPS[steps[k][0]]
        ]
    elif kind == "operand":
        lowest = {"+": 1, "-": 1, "*": 2, "/": 2}
        chains = [
            _chain(start, [*steps[:k], (op, b + d), *steps[k + 1 :]])
            for k, (op, b) in enumerate(steps)
            for d in _SLIPS
            if b + d >= lowest[op]
        ]
        chains += [_chain(start + d, steps) for d in _SLIPS if start + d >= 1]
    else:
        raise GrpoError(f"unknown error kind {kind!r} ({', '.join(MATH_ERROR_KINDS)})")
    texts = [
        sft_solution(_rewrite(lines, c), str(c[-1][3]))
        for c in chains
        if c is not None and c[-1][3] != answer
    ]
    return list(dict.fromkeys(texts))


def _rewrite(lines: list[str], works: list[Work]) -> list[str]:
    """The step lines with their ``a op b = c`` replaced by `works`, the wording unchanged."""
    out = []
    for line, (a, op, b, c) in zip(lines, works):
        m = _WORK_RE.search(line)
        out.append(f"{line[: m.start()]}{a}{op}{b} = {c}{line[m.end() :]}")
    return out
