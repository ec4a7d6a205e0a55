"""torchrun integration: the only reader of the distributed environment variables.

`init_distributed()` turns RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun) into a `Dist`:
gloo on CPU, NCCL on CUDA with one device per local rank, and a process-group timeout so a
dead peer fails the job instead of hanging it. Without torchrun it is a single process and
every collective below is a no-op.

One rule makes every collective valid under every backend: its tensor lives where its group
moves tensors, and the helpers below build their tensors themselves and take no device
argument, so a call site cannot get it wrong. The model's tensors (`all_gather_cat`, DDP,
FSDP) go over `Dist.group` on the rank's device, `Dist.device` (NCCL only moves CUDA tensors,
gloo CPU ones); `all_gather_cat` checks the tensor it is given. The scalar reductions, the
agreements (`rank_local`, `barrier`) and the object gathers go over `Dist.cpu_group` with CPU
tensors where the job has one (CUDA ranks: a gloo side group), so a rank waiting there for a
peer that failed learns of it from gloo as soon as the peer's process is gone, instead of
sitting in an NCCL collective until NCCL's watchdog kills it without a word.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as td

from grpo.errors import GrpoError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the job; `device` is where its collectives' tensors live.

    `group` is the process group the collectives below run over: None for the whole job, or a
    subgroup (the trainer ranks when others generate rollouts, `rollout.ranks`); `rank` and
    `world_size` are then this process's place in that subgroup. `cpu_group` is a gloo group
    over the same ranks for the scalar reductions, agreements and object gathers (CPU
    tensors): set on CUDA ranks, whose `group` is NCCL (a failed peer leaves NCCL collectives
    waiting for the watchdog, a gloo one fails at once); None where `group` is gloo already."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: object = None
    joined: bool = False  # a process group exists (a launcher's job, one rank included)
    cpu_group: object = None

    @property
    def enabled(self) -> bool:
        """Collectives, DDP and FSDP run: a job of several ranks, or a launcher's job of one
        (`torchrun --nproc_per_node=1` runs NCCL, DDP and FSDP as a larger job would)."""
        return self.world_size > 1 or self.joined

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = Dist()


def backend_for(device_type: str, cpu_collectives: bool = False) -> str:
    """The process-group backend for ranks on `device_type`: NCCL for CUDA, gloo for CPU;
    both (`cpu:gloo,cuda:nccl`) for CUDA ranks that also reduce CPU tensors (FSDP with CPU
    offload: gradients and their norm live in CPU memory, which NCCL cannot move)."""
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


def init_distributed(
    device_type: str = "cpu", timeout_s: float = 600.0, cpu_collectives: bool = False
) -> Dist:
    """Join the torchrun job described by the environment (or return SINGLE).

    A launcher's job (RANK and MASTER_ADDR set, as torchrun sets them) joins a process group
    even with one rank, so `torchrun --nproc_per_node=1` exercises the backend, DDP and FSDP
    that a larger job runs; a plain `python -m grpo` is a single process without one.

    Args:
        device_type: "cuda" (NCCL, device = LOCAL_RANK, and a gloo side group,
            `Dist.cpu_group`) or "cpu" (gloo).
        timeout_s: collectives that wait longer than this fail the job (`train.dist_timeout_s`),
            on every group made here.
        cpu_collectives: CUDA ranks also reduce CPU tensors (`backend_for`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "RANK" in os.environ and "MASTER_ADDR" in os.environ
    if world <= 1 and not launched:
        return SINGLE
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = cuda_device(local_rank) if device_type == "cuda" else torch.device("cpu")
    dist = Dist(rank, world, local_rank, device, joined=True)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not td.is_initialized():
        backend = backend_for(device_type, cpu_collectives)
        kwargs = {}
        if device_type == "cuda":
            torch.cuda.set_device(device)
            kwargs["device_id"] = device  # NCCL binds the rank's device up front (no guessing)
        store = attempt_store(world, timeout)
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world)
        td.init_process_group(backend, timeout=timeout, **kwargs)
        log.debug("rank %d/%d joined (%s)", dist.rank, world, backend)
    if device_type != "cuda":
        return dist  # the group is gloo already: the scalars go over it
    return replace(dist, cpu_group=td.new_group(backend="gloo", timeout=timeout))


def attempt_store(world: int, timeout: datetime.timedelta):
    """Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE): a client of it whose keys
    carry this restart attempt (TORCHELASTIC_RESTART_COUNT); None otherwise. torchrun keeps
    one store through the restarts of a job (--max-restarts), so without the prefix a rank of
    the next attempt can read a key of the attempt before (a dead rank's address: gloo then
    fails with "connection refused" when that rank starts more slowly than its peer).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = td.TCPStore(host, port, world, is_master=False, timeout=timeout)
    return td.PrefixStore(
        f"grpo/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    )


def describe_parallel(dist: Dist, sharded: bool) -> str:
    """How the job trains, for the run's header: "single process", or e.g. "fsdp over 1 rank
    (nccl)"."""
    if not dist.enabled:
        return "single process"
    backend = td.get_backend(dist.group) if td.is_initialized() else "no group"
    ranks = f"{dist.world_size} rank" + "s" * (dist.world_size != 1)
    return f"{'fsdp' if sharded else 'ddp'} over {ranks} ({backend})"


def teardown() -> None:
    """Leave the process group when the job ends together (safe to call when none was joined):
    a clean end, or an end every rank reached at the same point (an exception carrying `rank`:
    `JobError`, TrainingInterrupted, NothingToDo, StallError).

    On any other error the group is left to the process's exit, never destroyed: a peer may
    still sit in a collective waiting for this rank, and destroying an NCCL group under it can
    block this rank (its communicator flushes the collectives in flight) while the peer waits
    for the watchdog; a broken group (`CollectiveError`) can hang too. The peers learn of the
    exit from the closed connections of the gloo groups (`Dist.cpu_group`).

    Unreachable DDP wrappers are collected first: a DDP reducer still alive when the group is
    destroyed can abort the process at interpreter exit ("terminate called without an active
    exception", SIGABRT after the work is done; seen with gloo in about 1 run of 3)."""
    error = sys.exc_info()[1]
    if error is not None and getattr(error, "rank", None) is None:
        return
    if td.is_available() and td.is_initialized():
        gc.collect()
        td.destroy_process_group()


def exit_if_joined(code: int) -> None:
    """Leave the process now, with `code`, if its process group is still joined (`teardown`
    leaves it on an error a peer may not share): interpreter shutdown would run the group's
    destructors while a peer may still use it, which can abort the process (SIGABRT instead of
    `code`) or hang. Output is flushed first. Returns when no group is joined."""
    if td.is_available() and td.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class CollectiveError(GrpoError):
    """A collective failed or timed out: a peer died, hung or the network broke. The CLI prints
    the one line and leaves at once (the process group is unusable)."""


class JobError(GrpoError):
    """The same error on every rank, decided once (rank 0's verdict on the run directory, a
    checkpoint saved by fewer ranks): rank 0 prints it, the others exit non-zero without a
    line of their own (`rank`, as for TrainingInterrupted)."""

    def __init__(self, message: str, rank: int = 0):
        super().__init__(message)
        self.rank = rank


@dataclass
class Where:
    """What this rank is doing (set by the training loop), for the report of a failure."""

    phase: str = "start-up"
    step: int = 0

    @property
    def label(self) -> str:
        """The phase and step ("rollout, step 3"); the phase alone before step 1."""
        return f"{self.phase}, step {self.step}" if self.step else self.phase


_PEER_FAILURE = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "nccl",
    "gloo",
    "processgroup",
)


def collective_failure(e: BaseException) -> str | None:
    """How a collective failed: "timeout" (it waited too long for a peer), "lost" (a peer
    closed its connection: it died or left), "failed" (another backend or network error);
    None when `e` is no collective's failure. DistError derives from RuntimeError."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e).lower()
    if not (isinstance(e, getattr(td, "DistError", ())) or any(s in text for s in _PEER_FAILURE)):
        return None
    if "timed out" in text or "timeout" in text:
        return "timeout"
    lost = ("connection closed", "connection reset", "broken pipe")
    return "lost" if any(s in text for s in lost) else "failed"


def job_store():
    """The key-value store the default process group was built on (torchrun's agent store, or
    rank 0's TCPStore without torchrun); None without one."""
    if not (td.is_available() and td.is_initialized()):
        return None
    try:
        return td.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def hosts_store(dist: Dist) -> bool:
    """Whether this process serves the job's store: rank 0 without torchrun (under torchrun
    the agent serves it, TORCHELASTIC_USE_AGENT_STORE). When it exits, the store goes too."""
    return dist.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def elastic_error_file() -> str | None:
    """Where torchrun reads this worker's error (TORCHELASTIC_ERROR_FILE); None without."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


class RankFailed(GrpoError):
    """Another rank failed in work it did alone (`rank_local`); its own line says more."""

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()):
        super().__init__(message)  # args == (message,): pickles like any exception
        self.failed_ranks = failed_ranks


def _error_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line: a GrpoError's message, else "Type: first line"."""
    text = str(e).strip()
    if isinstance(e, GrpoError):
        line = " ".join(text.split())
    else:
        first = text.splitlines()[0] if text else ""
        line = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


@contextlib.contextmanager
def rank_local(dist: Dist, where: Where):
    """Around work that some ranks do alone (rank 0's evaluation, logging, `on_step` callback,
    checkpoint writes): every rank enters, and on leaving all agree, in one small all-reduce,
    whether the block failed on any rank. Without it a failure on rank 0 alone leaves the
    others waiting in their next collective for `train.dist_timeout_s`.

    A rank whose block raised re-raises its own error (after telling the others); the others
    raise `RankFailed`: one line naming the failed rank, the phase, the step and that rank's
    error. The block must hold no collective: a rank that raised before it would leave the
    others waiting there. A `CollectiveError` (the group is broken) and BaseExceptions (a
    second Ctrl-C) pass through at once.
    """
    if not dist.enabled:
        yield
        return
    try:
        yield
    except CollectiveError:
        raise
    except Exception as e:
        try:
            _agree(dist, where, e)
        except Exception:  # the group broke too: the others learn of it from the timeout
            pass
        raise
    _agree(dist, where, None)


def _agree(dist: Dist, where: Where, error: BaseException | None) -> None:
    """Every rank's failure flag in one all-reduce (slot r = rank r failed); on a failure,
    the failed ranks' error lines in one gather, and `RankFailed` on the ranks that did not
    fail (a failed rank returns: its caller re-raises its own error)."""
    flags = [0.0] * dist.world_size
    flags[dist.rank] = float(error is not None)
    failed = tuple(r for r, f in enumerate(_reduce(flags, dist, td.ReduceOp.SUM)) if f)
    if not failed:
        return
    lines = gather_objects(None if error is None else _error_line(error), dist)
    if error is not None:
        return
    first = failed[0]
    others = f" (ranks {', '.join(map(str, failed))} failed)" if len(failed) > 1 else ""
    raise RankFailed(
        f"rank {dist.rank}: stopped: rank {first} failed ({where.label}){others}: {lines[first]}",
        failed,
    )


@dataclass(frozen=True)
class Roles:
    """A torchrun job split into trainer ranks [0, T) and rollout producer ranks [T, W).

    Attributes:
        rank: this process's global rank.
        n_trainers: T.
        producers: the producer ranks' global ranks.
        trainers: on a trainer, its place among the trainers (collectives over their group).
        lockstep: on a producer, its place among the producers (their gloo group).
        link: a gloo group of every rank: batches, point to point.
        weights: a gloo group of trainer 0 and the producers: weight broadcasts.
    """

    rank: int
    n_trainers: int
    producers: tuple[int, ...]
    trainers: Dist | None
    lockstep: Dist | None
    link: object
    weights: object

    @property
    def is_producer(self) -> bool:
        return self.rank >= self.n_trainers

    def producer_of(self, trainer: int) -> int:
        """The producer rank that serves trainer rank `trainer`."""
        return self.producers[trainer % len(self.producers)]

    def served_by(self, producer: int) -> list[int]:
        """The trainer ranks producer rank `producer` samples for."""
        return [t for t in range(self.n_trainers) if self.producer_of(t) == producer]


def split_roles(dist: Dist, n_producers: int, timeout_s: float) -> Roles:
    """Make the groups of a job whose last `n_producers` ranks generate (collective: every
    rank calls it, in the same order). `timeout_s`: the new groups' timeout (the job's)."""
    W = dist.world_size
    T = W - n_producers
    if n_producers >= W or n_producers > T:
        raise GrpoError(
            f"rollout.ranks={n_producers} in a job of {W} rank(s): at least as many trainer "
            f"ranks as producer ranks are needed (rollout.ranks at most {W // 2}); launch "
            "with torchrun --nproc_per_node=N, or set rollout.ranks: 0 (colocated)"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    producers = tuple(range(T, W))
    trainer_group = td.new_group(list(range(T)), timeout=timeout)
    # NCCL trainers: their scalars and agreements over gloo too (`Dist.cpu_group`)
    trainer_cpu = None
    if dist.cpu_group is not None:
        trainer_cpu = td.new_group(list(range(T)), backend="gloo", timeout=timeout)
    producer_group = td.new_group(list(producers), backend="gloo", timeout=timeout)
    link = td.new_group(list(range(W)), backend="gloo", timeout=timeout)
    weights = td.new_group([0, *producers], backend="gloo", timeout=timeout)
    cpu = torch.device("cpu")
    if dist.rank < T:
        trainers = Dist(
            dist.rank, T, dist.local_rank, dist.device, trainer_group, cpu_group=trainer_cpu
        )
        return Roles(dist.rank, T, producers, trainers, None, link, weights)
    lockstep = Dist(dist.rank - T, n_producers, dist.local_rank, cpu, producer_group)
    return Roles(dist.rank, T, producers, None, lockstep, link, weights)


def cuda_device(local_rank: int) -> torch.device:
    """The CUDA device of a node's `local_rank`-th process: one device each where the process
    sees as many as the node runs ranks, and the visible ones in turn where it sees fewer (a
    scheduler that exposes one GPU per process: cuda:0 for every rank)."""
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank % count if count else local_rank)


def device_for(dist: Dist, device: torch.device) -> torch.device:
    """The rank's compute device: its local rank's CUDA device (`cuda_device`), whatever the
    device of the group `dist` runs collectives on (a producer's lockstep group is gloo, on
    the CPU); CPU stays CPU."""
    if device.type == "cuda" and dist.enabled:
        return cuda_device(dist.local_rank)
    return device


def _scalar_group(dist: Dist) -> tuple[torch.device, object]:
    """Where the scalar reductions, agreements and object gathers run: (cpu, the gloo side
    group) on ranks that have one, else (the rank's device, its group)."""
    if dist.cpu_group is None:
        return dist.device, dist.group
    return torch.device("cpu"), dist.cpu_group


def _reduce(values: list[float], dist: Dist, op) -> list[float]:
    """All-reduce float64 values through a tensor where `_scalar_group` says (valid on every
    backend); at most one device-to-host copy back."""
    device, group = _scalar_group(dist)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    td.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_sum(value: float, dist: Dist) -> float:
    """The sum of a float over all ranks."""
    if not dist.enabled:
        return float(value)
    return _reduce([float(value)], dist, td.ReduceOp.SUM)[0]


def all_reduce_max(value: float, dist: Dist) -> float:
    """The max of a float over all ranks."""
    if not dist.enabled:
        return float(value)
    return _reduce([float(value)], dist, td.ReduceOp.MAX)[0]


def all_reduce_mean_dict(values: dict[str, float], dist: Dist) -> dict[str, float]:
    """Each float averaged over ranks (for logging; every rank must pass the same keys)."""
    if not dist.enabled or not values:
        return values
    keys = sorted(values)
    sums = _reduce([float(values[k]) for k in keys], dist, td.ReduceOp.SUM)
    return {k: v / dist.world_size for k, v in zip(keys, sums)}


def all_reduce_sum_dict(values: dict[str, float], dist: Dist) -> dict[str, float]:
    """Each float summed over ranks (every rank must pass the same keys)."""
    if not dist.enabled or not values:
        return dict(values)
    keys = sorted(values)
    return dict(zip(keys, _reduce([float(values[k]) for k in keys], dist, td.ReduceOp.SUM)))


def all_reduce_max_dict(values: dict[str, float], dist: Dist) -> dict[str, float]:
    """Each float's max over ranks (every rank must pass the same keys)."""
    if not dist.enabled or not values:
        return dict(values)
    keys = sorted(values)
    return dict(zip(keys, _reduce([float(values[k]) for k in keys], dist, td.ReduceOp.MAX)))


def all_gather_cat(x: torch.Tensor, dist: Dist) -> torch.Tensor:
    """Concatenate an equally-shaped tensor from every rank along dim 0 (rank order).

    Raises:
        ValueError: `x` is not on the rank's device (NCCL would reject a CPU tensor).
    """
    if not dist.enabled:
        return x
    if x.device != dist.device:
        raise ValueError(
            f"all_gather_cat: tensor on {x.device}, the rank's device is {dist.device}"
        )
    parts = [torch.empty_like(x) for _ in range(dist.world_size)]
    td.all_gather(parts, x.contiguous(), group=dist.group)
    return torch.cat(parts)


def gather_objects(obj, dist: Dist) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable objects; over the gloo side
    group where there is one, as the scalars)."""
    if not dist.enabled:
        return [obj]
    out = [None] * dist.world_size
    td.all_gather_object(out, obj, group=_scalar_group(dist)[1])
    return out


def barrier(dist: Dist) -> None:
    """Wait for every rank (a one-value all-reduce, as `_reduce`: valid on every backend)."""
    if dist.enabled:
        _reduce([0.0], dist, td.ReduceOp.SUM)


def wrap_ddp(module: torch.nn.Module, dist: Dist, device: torch.device) -> torch.nn.Module:
    """DDP over the module's trainable parameters (identity for a single process, and for a
    module holding an FSDP-sharded model, whose gradients FSDP reduces itself)."""
    if not dist.enabled or fsdp_units(module):
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(module, device_ids=ids, process_group=dist.group)


def no_sync(module: torch.nn.Module, skip: bool):
    """DDP's no_sync while accumulating (skip=True), else a null context."""
    if skip and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- FSDP2


def fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `shard_model` made FSDP units (blocks, then the root), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def shard_model(
    model: torch.nn.Module,
    dist: Dist,
    compute_dtype: torch.dtype = torch.bfloat16,
    offload: bool = False,
) -> torch.nn.Module:
    """Shard a `Decoder` over every rank with FSDP2 (`fully_shard`), in place: each block is a
    unit (its weights gathered for its forward and backward, then freed), the root holds the
    embeddings, final norm and head. Frozen weights (a LoRA base) are sharded too; only the
    trainable ones get gradients, reduce-scattered in float32.

    Args:
        model: the decoder, its precision already applied (`Precision.prepare`).
        dist: the job (world_size > 1).
        compute_dtype: the dtype all weights are gathered in when the model mixes dtypes
            (bf16 frozen base + float32 adapters: FSDP gathers one dtype per unit); a model of
            one dtype is gathered as it is (the forward's autocast does the rest).
        offload: keep shards, gradients and optimizer states in CPU memory (`CPUOffloadPolicy`).

    Returns:
        the model (now an FSDP module; parameters are DTensor shards).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    mixed = len({p.dtype for p in model.parameters()}) > 1
    mp = MixedPrecisionPolicy(
        param_dtype=compute_dtype if mixed else None, reduce_dtype=torch.float32
    )
    # pinned host memory needs an accelerator: without one, CPUOffloadPolicy() fails
    off = CPUOffloadPolicy(pin_memory=dist.device.type == "cuda") if offload else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)
    return model


@contextlib.contextmanager
def full_weights(model: torch.nn.Module, enabled: bool = True):
    """Every weight of an FSDP-sharded model gathered for the duration (the sampler, an
    evaluation, a final save read whole weights), then sharded again; a no-op for a model
    that is not sharded. Collective: every rank enters it together.

    Inside, forwards run without FSDP's per-block gather and free (the blocks are told not to
    reshard after forward), so a decode loop costs one gather per weight, not one per step.
    """
    units = fsdp_units(model) if enabled else []
    if not units:
        yield model
        return
    blocks = [u for u in units if u is not model]
    for u in blocks:
        u.set_reshard_after_forward(False, recurse=False)
    for u in units:
        u.unshard()
    try:
        yield model
    finally:
        for u in units:
            u.reshard()
        for u in blocks:
            u.set_reshard_after_forward(True, recurse=False)


def reshard(model: torch.nn.Module) -> None:
    """Shard again whatever a forward left gathered (the root keeps its weights after a forward
    for the backward to come): state dicts and optimizers address the shards."""
    for u in fsdp_units(model):
        u.reshard()


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_`, returning the total norm as a plain tensor (FSDP's gradients are
    DTensor shards: the norm is reduced over ranks, as DDP's synced gradients give it)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
