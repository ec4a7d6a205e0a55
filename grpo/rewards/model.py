"""A learned reward: a sequence classifier (a reward model from `grpo rm`, or any Hugging Face
Llama / Qwen2 / Qwen3 `*ForSequenceClassification` checkpoint) scores each completion.

    rewards:
      - name: reward_model
        weight: 1.0
        kwargs:
          path: runs/rm/final          # the classifier checkpoint (with its tokenizer) or hub id
          batch_size: 16               # rows per forward
          max_length: 1024             # tokens per row: a longer prompt keeps its end
          normalize: none              # none | batch: (r - mean) / std over the call's rows
                                       # | global: over the step's whole batch (every rank,
                                       #   every sampling round; grpo.experience.normalize)
          system_prompt: null          # the system message the reward model's pairs had
          reference_column: null       # a column of reference completions: each reward is
                                       # capped at its reference's score (a hacking guard)

Each row is rendered with the reward model's OWN tokenizer and chat template (it may differ
from the policy's): [system?, user: the row's question, assistant: the completion], encoded as
`grpo.data.preferences.encode_prompt_completion` encodes a training pair, so the model scores
what it was trained on; the question and completion are plain text (no special-token text in
them forges a turn). Scoring runs batched, without gradients, on the policy's device under the
run's precision policy (`RewardContext.device` / `precision`). The model is loaded once per
process (shared by every reward entry and the async producer naming the same checkpoint).
Reported metrics: ``rewards/reward_model/score_mean`` (raw scores, before normalization) and
``rows_per_s``.

``normalize: batch`` normalises the rows of one call: one rank's share of one sampling round.
``normalize: global`` returns the raw scores and declares ``global_normalize`` on the function:
the trainer then normalises them over the step's global batch, the rows every trainer rank
trains on gathered from all sampling rounds, in float64, before the advantages
(`grpo.experience.normalize.normalize_globally`); evaluation reports raw scores.

The run header records the checkpoint (``run/rewards``: its path and `checkpoint_hash`, so a
run names the reward model it optimised, bit for bit).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
from typing import Any

import torch

from grpo.errors import GrpoError
from grpo.rewards.functions import RewardContext

NORMALIZE = ("none", "batch", "global")
log = logging.getLogger(__name__)
_SAID_DROPPED: list[bool] = []  # the dropped-prompt warning, once per process
_CACHE: dict[tuple, Any] = {}  # (path, device, dtype) -> (model, tokenizer): one per process
_HASHES: dict[tuple, str] = {}  # checkpoint files' (path, mtime, size) -> checkpoint_hash
_LOCK = threading.Lock()


def load_reward_model(path: str, device, dtype: str = "float32"):
    """(model, tokenizer) of a classifier checkpoint, loaded once per process and device."""
    from grpo.models import load_model
    from grpo.models.hf_checkpoint import resolve_model_dir
    from grpo.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(path)
    # the files' identity too: a checkpoint rewritten in place (a rerun) is loaded again
    stamp = tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size)
        for f in sorted(model_dir.glob("*.safetensors"))
    )
    key = (str(path), str(device), dtype, stamp)
    with _LOCK:
        if key not in _CACHE:
            model = load_model(model_dir, dtype, device)
            if not model.config.num_labels:
                raise GrpoError(
                    f"reward_model: {path} is a causal LM, not a sequence classifier; train one "
                    "with `grpo rm` (or give a *ForSequenceClassification checkpoint)"
                )
            if model.config.num_labels != 1:
                raise GrpoError(
                    f"reward_model: {path} has {model.config.num_labels} outputs; "
                    "a reward model has 1"
                )
            for p in model.parameters():
                p.requires_grad_(False)
            _CACHE[key] = (model.eval(), load_tokenizer(model_dir))
        return _CACHE[key]


def make_reward_model(
    path: str,
    batch_size: int = 16,
    max_length: int = 1024,
    normalize: str = "none",
    system_prompt: str | None = None,
    dtype: str = "float32",
    reference_column: str | None = None,
):
    """The `reward_model` reward (module docstring); nothing is loaded until its first call.

    `reference_column` names a column holding a reference completion per row (a worked
    solution): each reward is capped at that completion's score, min(r(x, y), r(x, y_ref)), so
    writing what the reward model likes better than the reference gains nothing."""
    if not isinstance(path, str) or not path:
        raise GrpoError("reward_model: `path` is required (a classifier checkpoint directory)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise GrpoError(f"reward_model: batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(max_length, int) or max_length < 2:
        raise GrpoError(f"reward_model: max_length must be an integer >= 2, got {max_length!r}")
    if normalize not in NORMALIZE:
        raise GrpoError(
            f"reward_model: normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}"
        )
    if dtype not in ("float32", "bfloat16"):
        raise GrpoError(f"reward_model: dtype must be float32 or bfloat16, got {dtype!r}")
    if reference_column is not None and (
        not isinstance(reference_column, str) or not reference_column
    ):
        raise GrpoError(
            f"reward_model: reference_column must be a column name, got {reference_column!r}"
        )

    def reward_model(
        completions: list[str],
        *,
        context: RewardContext | None = None,
        question: list[str] | None = None,
        **columns,
    ):
        if question is None:
            raise GrpoError(
                "reward_model: the rows have no 'question' column (the prompt the "
                "reward model reads with each completion)"
            )
        context = context or RewardContext()
        device = context.device if context.device is not None else torch.device("cpu")
        refs = None
        if reference_column is not None:
            refs = columns.get(reference_column)
            if refs is None:
                raise GrpoError(
                    f"reward_model: reference_column {reference_column!r} is not a "
                    f"column of the rows ({', '.join(sorted(columns))})"
                )
        model, tok = load_reward_model(path, device, dtype)
        t0 = time.perf_counter()
        cuts: dict[str, int] = {}
        scores = score_completions(
            model,
            tok,
            list(question),
            completions,
            batch_size,
            max_length,
            system_prompt,
            context.precision,
            cuts=cuts,
        )
        reported = {"prompt_cut_frac": cuts.get("prompt_cut", 0) / max(len(completions), 1)}
        dropped = cuts.get("prompt_dropped", 0)
        if dropped and not _SAID_DROPPED:  # a choice of max_length, said once per process
            _SAID_DROPPED.append(True)
            log.warning(
                "reward_model: max_length=%d left %d of %d rows without any of their prompt: "
                "the reward model scores those completions alone (rewards/reward_model/"
                "prompt_cut_frac counts the rows whose prompt was cut)",
                max_length,
                dropped,
                len(completions),
            )
        if refs is not None:  # each distinct (question, reference) scored once
            pairs = sorted(set(zip(question, map(str, refs))))
            bound = score_completions(
                model,
                tok,
                [q for q, _ in pairs],
                [r for _, r in pairs],
                batch_size,
                max_length,
                system_prompt,
                context.precision,
            )
            cap = dict(zip(pairs, bound.tolist()))
            caps = torch.tensor([cap[(q, str(r))] for q, r in zip(question, refs)])
            reported["capped_frac"] = float((scores > caps).float().mean())
            reported["reference_score_mean"] = float(caps.mean())
            scores = torch.minimum(scores, caps)
        dt = time.perf_counter() - t0
        raw = scores.tolist()
        values = raw
        if normalize == "batch" and len(raw) > 1:  # "global": the trainer normalises later
            std = scores.std().item()
            values = ((scores - scores.mean()) / (std if std > 1e-6 else 1.0)).tolist()
        return values, {
            "score_mean": sum(raw) / max(len(raw), 1),
            "rows_per_s": len(raw) / max(dt, 1e-9),
            **reported,
        }

    reward_model.__name__ = "reward_model"
    reward_model.global_normalize = normalize == "global"
    reward_model.run_record = lambda: {"checkpoint": checkpoint_record(path)}
    return reward_model


def checkpoint_record(path: str) -> dict[str, str]:
    """What the run header records of a reward model checkpoint: its path as given, the
    directory it resolved to and `checkpoint_hash` of that directory."""
    from grpo.models.hf_checkpoint import resolve_model_dir

    model_dir = resolve_model_dir(path)
    return {"path": str(path), "dir": str(model_dir), "sha256": checkpoint_hash(model_dir)}


def checkpoint_hash(model_dir) -> str:
    """sha256 (16 hex digits) over a checkpoint directory's weights and config: each
    ``*.safetensors`` file and ``config.json``, by name and bytes, in name order (read once per
    process per file version: a checkpoint rewritten in place is hashed again)."""
    from pathlib import Path

    files = sorted(Path(model_dir).glob("*.safetensors"))
    files += [f for f in [Path(model_dir) / "config.json"] if f.is_file()]
    stamp = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    with _LOCK:
        if stamp not in _HASHES:
            h = hashlib.sha256()
            for f in files:
                h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 22), b""):
                        h.update(block)
            _HASHES[stamp] = h.hexdigest()[:16]
        return _HASHES[stamp]


def encode_rows(
    tokenizer,
    questions: list[str],
    completions: list[str],
    max_length: int,
    system_prompt: str | None,
    cuts: dict[str, int] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """Each row's (prompt ids, completion ids) as the reward model's training pairs were
    encoded (a chat, or plain text for a tokenizer without a chat template), the prompt cut
    from the left to fit `max_length`, the completion cut at its end only when it alone is
    longer. `cuts`, when given, counts the rows whose prompt was cut ("prompt_cut") and those
    left with none of it ("prompt_dropped")."""
    from grpo.data.preferences import encode_prompt_completion

    chat = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for q, c in zip(questions, completions):
        if chat:
            prompt = [{"role": "system", "content": system_prompt}] if system_prompt else []
            prompt = prompt + [{"role": "user", "content": q}]
            p_ids, c_ids = encode_prompt_completion(tokenizer, prompt, c)
        else:
            p_ids, c_ids = encode_prompt_completion(tokenizer, q, c)
        c_ids = c_ids[:max_length]  # a completion alone over the limit: its start is scored
        kept = p_ids[len(p_ids) - (max_length - len(c_ids)) :] if max_length > len(c_ids) else []
        if cuts is not None and len(kept) < len(p_ids):
            cuts["prompt_cut"] = cuts.get("prompt_cut", 0) + 1
            cuts["prompt_dropped"] = cuts.get("prompt_dropped", 0) + (not kept)
        out.append((kept, c_ids))
    return out


def shared_group_size(prompts: list[list[int]]) -> int | None:
    """G when the rows come in runs of G > 1 equal prompts (a GRPO batch), else None."""
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            runs.append(i - start)
            start = i
    return runs[0] if len(set(runs)) == 1 and runs[0] > 1 else None


@torch.no_grad()
def score_completions(
    model,
    tokenizer,
    questions: list[str],
    completions: list[str],
    batch_size: int = 16,
    max_length: int = 1024,
    system_prompt: str | None = None,
    precision=None,
    pack: bool | None = None,
    cuts: dict[str, int] | None = None,
) -> torch.Tensor:
    """(B,) float32 scores on the CPU of a classifier `Decoder`, `batch_size` rows per forward.

    `pack` (None: as `train.pack_sequences: auto`, `grpo.models.varlen.packs_by_default`): the
    rows of a forward run on one token axis without padding
    (`grpo.models.classifier.packed_sequence_scores`), and when they come in groups of one
    prompt (a GRPO batch) each prompt runs once for its group (a forward then holds whole
    groups). Otherwise right-padded rows, sorted by length so a
    forward pads little. Both score alike (tests/test_reward_model_reward.py). `cuts`: as
    `encode_rows` counts them."""
    from grpo.models.classifier import packed_sequence_scores, sequence_scores
    from grpo.models.packed_rows import packed_overhead
    from grpo.models.varlen import packs_by_default

    rows = encode_rows(tokenizer, questions, completions, max_length, system_prompt, cuts)
    pad = model.config.pad_token_id
    pad = pad if pad is not None else (tokenizer.pad_token_id or 0)
    out = torch.empty(len(rows), dtype=torch.float32)
    dev = model.device
    pack = packs_by_default(dev.type) if pack is None else pack
    autocast = precision.autocast(dev) if precision is not None else contextlib.nullcontext()
    # a packed row is scored in its completion: one without a non-pad token runs padded
    packable = pack and all(any(t != pad for t in c) and p for p, c in rows)
    G = shared_group_size([p for p, _ in rows]) if packable else None
    if packable:
        size = max(G or 1, batch_size // (G or 1) * (G or 1))  # whole groups per forward
        batches = [list(range(i, min(i + size, len(rows)))) for i in range(0, len(rows), size)]
    else:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in batches:
        if packable:
            ids, mask, width = _prompt_completion(rows, batch, pad)
            with autocast:
                s = packed_sequence_scores(
                    model, ids.to(dev), mask.to(dev), width, pad, G, packed_overhead(model)
                )[:, 0]
        else:
            T = max(len(rows[i][0]) + len(rows[i][1]) for i in batch)
            ids = torch.full((len(batch), T), pad, dtype=torch.long)
            mask = torch.zeros(len(batch), T, dtype=torch.bool)
            for b, i in enumerate(batch):
                seq = rows[i][0] + rows[i][1]
                ids[b, : len(seq)] = torch.tensor(seq)
                mask[b, : len(seq)] = True
            with autocast:
                s = sequence_scores(model, ids.to(dev), mask.to(dev), pad)[:, 0]
        out[batch] = s.float().cpu()
    if not all(math.isfinite(x) for x in out.tolist()):
        raise GrpoError("reward_model: a score is not finite (the checkpoint's weights?)")
    return out


def _prompt_completion(rows, batch: list[int], pad: int):
    """Left-padded prompts + right-padded completions of `batch`: ids, mask, prompt width."""
    width = max(len(rows[i][0]) for i in batch)
    T_c = max(len(rows[i][1]) for i in batch)
    ids = torch.full((len(batch), width + T_c), pad, dtype=torch.long)
    mask = torch.zeros(len(batch), width + T_c, dtype=torch.bool)
    for b, i in enumerate(batch):
        p, c = rows[i]
        ids[b, width - len(p) : width], mask[b, width - len(p) : width] = torch.tensor(p), True
        ids[b, width : width + len(c)], mask[b, width : width + len(c)] = torch.tensor(c), True
    return ids, mask, width
