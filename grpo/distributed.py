"""torchrun integration: the only reader of the distributed environment variables.

`init_distributed()` turns RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun) into a `Dist`:
gloo on CPU, NCCL on CUDA with one device per local rank, and a process-group timeout so a
dead peer fails the job instead of hanging it. Without torchrun it is a single process and
every collective below is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as td

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = Dist()


def init_distributed(device_type: str = "cpu", timeout_s: float = 600.0) -> Dist:
    """Join the torchrun job described by the environment (or return SINGLE).

    Args:
        device_type: "cuda" (NCCL, device = LOCAL_RANK) or "cpu" (gloo).
        timeout_s: collectives that wait longer than this fail the job.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    dist = Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if td.is_initialized():
        return dist
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(dist.local_rank)
    td.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    log.debug("rank %d/%d joined (%s)", dist.rank, world, backend)
    return dist


def teardown() -> None:
    """Leave the process group (safe to call when none was joined).

    Unreachable DDP wrappers are collected first: a DDP reducer still alive when the group is
    destroyed can abort the process at interpreter exit ("terminate called without an active
    exception", SIGABRT after the work is done; seen with gloo in about 1 run of 3)."""
    if td.is_available() and td.is_initialized():
        gc.collect()
        td.destroy_process_group()


def device_for(dist: Dist, device: torch.device) -> torch.device:
    """One CUDA device per local rank; CPU stays CPU."""
    if device.type == "cuda" and dist.enabled:
        return torch.device("cuda", dist.local_rank)
    return device


def all_reduce_sum(value: float, dist: Dist, device: torch.device | str = "cpu") -> float:
    """The sum of a float over all ranks."""
    if not dist.enabled:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    td.all_reduce(t)
    return float(t.item())


def all_reduce_max(value: float, dist: Dist, device: torch.device | str = "cpu") -> float:
    """The max of a float over all ranks."""
    if not dist.enabled:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return float(t.item())


def all_reduce_mean_dict(values: dict[str, float], dist: Dist, device="cpu") -> dict[str, float]:
    """Each float averaged over ranks (for logging; every rank must pass the same keys)."""
    if not dist.enabled or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    td.all_reduce(t)
    return {k: float(v) / dist.world_size for k, v in zip(keys, t.tolist())}


def all_reduce_sum_dict(values: dict[str, float], dist: Dist, device="cpu") -> dict[str, float]:
    """Each float summed over ranks (every rank must pass the same keys)."""
    if not dist.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    td.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_reduce_max_dict(values: dict[str, float], dist: Dist, device="cpu") -> dict[str, float]:
    """Each float's max over ranks (every rank must pass the same keys)."""
    if not dist.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def all_gather_cat(x: torch.Tensor, dist: Dist) -> torch.Tensor:
    """Concatenate an equally-shaped tensor from every rank along dim 0 (rank order)."""
    if not dist.enabled:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.world_size)]
    td.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def gather_objects(obj, dist: Dist) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable objects)."""
    if not dist.enabled:
        return [obj]
    out = [None] * dist.world_size
    td.all_gather_object(out, obj)
    return out


def barrier(dist: Dist) -> None:
    if dist.enabled:
        td.barrier()


def wrap_ddp(module: torch.nn.Module, dist: Dist, device: torch.device) -> torch.nn.Module:
    """DDP over the module's trainable parameters (identity for a single process)."""
    if not dist.enabled:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(module, device_ids=ids)


def no_sync(module: torch.nn.Module, skip: bool):
    """DDP's no_sync while accumulating (skip=True), else a null context."""
    if skip and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()
