"""Rollout batches and weights as flat byte tensors, for the point-to-point messages between
rollout producer ranks and trainer ranks (grpo.experience.producer). No pickle: a message is a JSON
header (UTF-8 bytes) plus one buffer holding every tensor's bytes, each at an 8-byte aligned
offset; the receiver rebuilds bitwise-equal tensors.

    pack_batch(batch, row_index)        -> (header bytes, buffer)
    unpack_batch(header, buffer, rows)  -> RolloutBatch
    pack_tensors / unpack_tensors       named tensors <-> (header, buffer) (the weights)
"""

from __future__ import annotations

import json

import torch

from grpo.errors import GrpoError
from grpo.experience.batch import RolloutBatch
from grpo.metrics import reduction, tagged
from grpo.rollout import Rollout

_ALIGN = 8
_ROLLOUT_TENSORS = (
    "ids",
    "prompt_lens",
    "completion_ids",
    "completion_mask",
    "completion_lens",
    "finished",
    "logprobs",
    "generated_mask",
)
_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[list[dict], torch.Tensor]:
    """(layout, buffer): every tensor's bytes, in order, at aligned offsets of one uint8 CPU
    buffer; layout lists name, dtype, shape and offset of each."""
    layout, total = [], 0
    for name, t in tensors.items():
        if str(t.dtype) not in _DTYPES:
            raise GrpoError(f"cannot send tensor {name!r} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        layout.append(
            {
                "name": name,
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "offset": total,
                "nbytes": nbytes,
            }
        )
        total += -(-nbytes // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8)
    for entry, t in zip(layout, tensors.values()):
        o, n = entry["offset"], entry["nbytes"]
        if n:
            buffer[o : o + n] = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return layout, buffer


def unpack_tensors(
    layout: list[dict], buffer: torch.Tensor, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The tensors `pack_tensors` packed (copies, on `device`)."""
    out = {}
    for e in layout:
        dtype = _DTYPES[e["dtype"]]
        o, n = e["offset"], e["nbytes"]
        flat = buffer[o : o + n].clone().view(dtype) if n else torch.empty(0, dtype=dtype)
        out[e["name"]] = flat.reshape(e["shape"]).to(device)
    return out


def encode_header(header: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)


def decode_header(data: torch.Tensor) -> dict:
    return json.loads(bytes(data.tolist()).decode())


def batch_parts(batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], dict]:
    """A rollout batch as named tensors and a JSON-able description of the rest (its rows,
    texts, per-turn fields, policy version; not its metrics): what `pack_batch` sends and a
    `StrategyState` keeps. `batch_from_parts` is the inverse."""
    r = batch.rollout
    tensors = {f"rollout.{k}": getattr(r, k) for k in _ROLLOUT_TENSORS}
    if r.turn_ids is not None:
        tensors["rollout.turn_ids"] = r.turn_ids
    tensors["rewards"] = batch.rewards
    tensors["token_rewards"] = batch.token_rewards
    tensors.update({f"per_fn.{k}": v for k, v in batch.per_fn.items()})
    tensors.update({f"extras.{k}": v for k, v in batch.extras.items()})
    meta = {
        "per_fn": list(batch.per_fn),
        "rows": batch.rows,
        "texts": batch.texts,
        "prompt_width": r.prompt_width,
        "group_size": r.group_size,
        "turn_rewards": r.turn_rewards,
        "turn_texts": r.turn_texts,
        "infos": r.infos,
        "policy_version": batch.policy_version,
        "frac_zero_std": batch.frac_zero_std,
        "extras": list(batch.extras),
    }
    return tensors, meta


def batch_from_parts(
    t: dict[str, torch.Tensor], meta: dict, rows: list[dict], metrics: dict | None = None
) -> RolloutBatch:
    """The `RolloutBatch` of `batch_parts`' tensors `t` and description `meta`, with `rows`."""
    rollout = Rollout(
        **{k: t[f"rollout.{k}"] for k in _ROLLOUT_TENSORS},
        prompt_width=meta["prompt_width"],
        group_size=meta["group_size"],
        turn_ids=t.get("rollout.turn_ids"),
        turn_rewards=meta["turn_rewards"],
        turn_texts=meta["turn_texts"],
        infos=meta["infos"],
    )
    if rollout.turn_ids is None:  # single turn: generated_mask is completion_mask, as built
        rollout.generated_mask = rollout.completion_mask
    return RolloutBatch(
        rollout=rollout,
        rows=rows,
        texts=meta["texts"],
        rewards=t["rewards"],
        token_rewards=t["token_rewards"],
        per_fn={k: t[f"per_fn.{k}"] for k in meta["per_fn"]},
        policy_version=meta["policy_version"],
        frac_zero_std=meta["frac_zero_std"],
        metrics=metrics or {},
        extras={k: t[f"extras.{k}"] for k in meta["extras"]},
    )


def pack_batch(batch: RolloutBatch, row_index: list[int], extra: dict | None = None):
    """A rollout batch as (header, buffer) uint8 tensors. `row_index`: the dataset index of each
    of its B rows (the receiver holds the same rows); `extra`: JSON values to carry along."""
    tensors, meta = batch_parts(batch)
    layout, buffer = pack_tensors(tensors)
    header = {
        "layout": layout,
        **meta,
        "rows": row_index,
        "metrics": {k: [float(v), reduction(v)] for k, v in batch.metrics.items()},
        "extra": extra or {},
    }
    try:
        return encode_header(header), buffer
    except TypeError as e:  # an environment's info holding something JSON cannot carry
        raise GrpoError(f"a rollout batch cannot be sent to its trainer: {e}") from None


def unpack_batch(
    header: dict, buffer: torch.Tensor, rows: list[dict], device: torch.device | str = "cpu"
) -> RolloutBatch:
    """The `RolloutBatch` that `pack_batch` packed, its tensors on `device`, its rows taken
    from `rows` (the dataset) by index."""
    t = unpack_tensors(header["layout"], buffer, device)
    metrics = {k: tagged(v, op) for k, (v, op) in header["metrics"].items()}
    return batch_from_parts(t, header, [rows[i] for i in header["rows"]], metrics)
