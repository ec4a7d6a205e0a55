"""What a rollout strategy keeps from one step to the next, saved with each checkpoint.

A strategy that declares a `state` input (grpo/experience/strategies.py) gets this rank's
`StrategyState` on every call: the same object for the whole run (every step, every
dynamic-sampling round), restored on ``--resume`` as it was at the checkpoint, so a resumed run
samples what the uninterrupted one samples, bitwise (a replay buffer survives):

    state.tensors   name -> tensor, saved as safetensors (on the CPU; the strategy moves them)
    state.values    JSON values (numbers, strings, lists, dicts), saved as JSON
    state.put_batch(name, batch) / state.batch(name)
                    a `RolloutBatch` kept as tensors + JSON (a buffer of past groups)

Per rank: under DDP every trainer rank's strategy runs for its own rows and keeps its own
state; a checkpoint holds each rank's, ``strategy/rank_NNNNN.{safetensors,json}``, and each
rank resumes its own (rank 0 writes them all, gathered at the save). Nothing is unpickled on
load. A checkpoint without strategy states (written before the strategy kept any) resumes
with an empty state, said in a warning.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from grpo.distributed import SINGLE, gather_objects
from grpo.errors import GrpoError
from grpo.experience.batch import RolloutBatch
from grpo.experience.wire import batch_from_parts, batch_parts
from grpo.io import load_safetensors, read_json, save_safetensors, write_text

log = logging.getLogger(__name__)

DIRECTORY = "strategy"  # in a checkpoint: strategy/rank_NNNNN.{safetensors,json}


class StrategyState:
    """One rank's rollout-strategy state (module docstring): `tensors` and JSON `values`."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.values: dict = {}

    # -- batches kept as tensors + JSON ----------------------------------------------------

    def put_batch(self, name: str, batch: RolloutBatch | None) -> None:
        """Keep `batch` under `name` (None: drop it): its tensors in `tensors` ("name.*"), the
        rest (rows, texts, per-turn fields) in `values[name]`. The rows must be JSON (dataset
        rows are). Its metrics are not kept (they were logged with the step that made them,
        and timings would make the state differ from run to run)."""
        self._drop(name)
        if batch is None:
            return
        tensors, meta = batch_parts(batch)
        for k, v in tensors.items():
            self.tensors[f"{name}.{k}"] = v.detach().cpu().clone()
        try:  # a copy as JSON now: what this run keeps is what a resumed run reads back
            self.values[name] = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as e:
            raise GrpoError(
                f"StrategyState.put_batch({name!r}): the batch's rows or infos are not JSON ({e})"
            ) from None

    def batch(self, name: str, device: torch.device | str = "cpu") -> RolloutBatch | None:
        """The batch kept under `name` (`put_batch`), its tensors on `device`; None if none."""
        meta = self.values.get(name)
        if meta is None:
            return None
        t = {
            k.removeprefix(f"{name}."): v.to(device)
            for k, v in self.tensors.items()
            if k.startswith(f"{name}.")
        }
        return batch_from_parts(t, meta, meta["rows"])

    def _drop(self, name: str) -> None:
        self.values.pop(name, None)
        for k in [k for k in self.tensors if k.startswith(f"{name}.")]:
            del self.tensors[k]

    # -- checkpoints -------------------------------------------------------------------------

    def packed(self, who: str) -> tuple[str, dict[str, torch.Tensor]]:
        """(values as JSON text, tensors on the CPU): what a checkpoint holds, checked; `who`
        names the strategy in errors."""
        bad = [k for k, v in self.tensors.items() if not isinstance(v, torch.Tensor)]
        if bad or not all(isinstance(k, str) for k in self.tensors):
            raise GrpoError(
                f"{who}: state.tensors[{bad[0] if bad else '?'}] must map names to tensors"
            )
        try:
            text = json.dumps(self.values, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise GrpoError(
                f"{who}: state.values cannot be saved as JSON ({e}); keep tensors in "
                "state.tensors and numbers, strings, lists and dicts in state.values"
            ) from None
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
        return text, tensors

    def restore(self, text: str, tensors: dict[str, torch.Tensor]) -> None:
        self.values = json.loads(text)
        self.tensors = dict(tensors)


def gather_states(state: StrategyState, who: str, dist=SINGLE) -> list:
    """Every rank's `StrategyState.packed` (rank order), on every rank (collective). The
    tensors travel as (name, dtype, shape, raw bytes), and are rebuilt bitwise."""
    text, tensors = state.packed(who)
    mine = (text, [_raw(k, v) for k, v in tensors.items()])
    if not dist.enabled:
        return [(text, tensors)]
    return [(t, dict(_unraw(x) for x in raw)) for t, raw in gather_objects(mine, dist)]


def save_states(directory: Path, states: list) -> None:
    """strategy/rank_NNNNN.{json,safetensors} under `directory` (a checkpoint being written),
    one pair per rank of `gather_states`."""
    d = Path(directory) / DIRECTORY
    d.mkdir(parents=True, exist_ok=True)
    for rank, (text, tensors) in enumerate(states):
        write_text(d / f"rank_{rank:05d}.json", text)
        save_safetensors(tensors, d / f"rank_{rank:05d}.safetensors")


def load_state(
    checkpoint: Path, rank: int, state: StrategyState, who: str, world_size: int = 1
) -> None:
    """This rank's saved strategy state into `state` (module docstring: none saved -> empty,
    with a warning; another rank's only -> refused, naming the checkpoint). Resumed on fewer
    ranks than saved it, the other ranks' states are left behind, said in a warning (rank 0)."""
    d = Path(checkpoint) / DIRECTORY
    if not d.is_dir():
        log.warning("%s: checkpoint %s holds no strategy state; it starts empty", who, checkpoint)
        return
    base = d / f"rank_{rank:05d}"
    saved = len(list(d.glob("rank_*.json")))
    if rank == 0 and saved > world_size:
        log.warning(
            "%s: checkpoint %s holds the states of %d ranks; the %d ranks resuming it take "
            "their own, the others' are not used",
            who,
            checkpoint,
            saved,
            world_size,
        )
    if not base.with_suffix(".json").is_file():
        raise GrpoError(
            f"checkpoint {checkpoint} holds the strategy states of {saved} rank(s), none of "
            f"rank {rank}: resume with the number of ranks that saved it"
        )
    text = json.dumps(read_json(base.with_suffix(".json"), "a rollout strategy's state"))
    state.restore(text, load_safetensors(base.with_suffix(".safetensors")))


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}
_DTYPES |= {str(d): d for d in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)}
_DTYPES[str(torch.bool)] = torch.bool


def _raw(name: str, t: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    if str(t.dtype) not in _DTYPES:
        raise GrpoError(f"strategy state tensor {name!r}: dtype {t.dtype} cannot be saved")
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return name, str(t.dtype), list(t.shape), bytes(flat.numpy().tobytes())


def _unraw(x: tuple[str, str, list[int], bytes]) -> tuple[str, torch.Tensor]:
    name, dtype, shape, data = x
    n = math.prod(shape)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    t = flat.view(_DTYPES[dtype]) if flat is not None else torch.empty(0, dtype=_DTYPES[dtype])
    return name, t[:n].reshape(shape).clone()
