"""The asynchronous rollout sources (rollout.async: on; docs/async.md; the synchronous one is
grpo/experience/inline.py, and grpo/experience/sources.py picks):

    ColocatedRollouts  rollout.ranks: 0. A producer thread in the trainer's process samples
                       ahead on its own copy of the policy (of the trainable weights: a LoRA
                       copy shares the frozen base), refreshed after updates.
    RemoteRollouts     rollout.ranks: R. The last R ranks of the torchrun job only sample
                       (`run_producer`); the trainer ranks receive their batches point to
                       point, and trainer rank 0 broadcasts the trainable weights (the adapters
                       alone with LoRA) to the producers after updates.

The schedule (`behaviour_version`): batch j (the batch of step j + 1) is sampled by the policy
of update max(start, j - k), k = rollout.max_staleness, start = the step the run (re)started
at. So its staleness when consumed is exactly min(j - start, k) updates, whatever the timing:
an asynchronous run is a function of its seed, and with k = 0 it is the synchronous run,
bitwise (tests/test_async.py). A producer runs at most k batches ahead; the trainer waits when
the batch it needs is not ready (for at most rollout.async_timeout_s), the producer waits
while the policy version it needs is not published. Every batch is sampled with the seeds and
prompts the synchronous run would use for it (`rollout_batches`); the data position consumed
with a batch travels with it, so a checkpoint records where the consumed batches end.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import datetime
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as td

from grpo.config import Config
from grpo.distributed import SINGLE, Dist, Roles
from grpo.errors import GrpoError
from grpo.experience.batch import RolloutBatch
from grpo.experience.collect import rollout_batches
from grpo.experience.inline import RolloutSource
from grpo.experience.wire import (
    decode_header,
    pack_batch,
    pack_tensors,
    unpack_batch,
    unpack_tensors,
)
from grpo.run.state import TrainState

if TYPE_CHECKING:
    from grpo.policy import Policy

log = logging.getLogger(__name__)


def behaviour_version(j: int, k: int, start: int = 0) -> int:
    """The policy version (updates done) that samples batch j: max(start, j - k)."""
    return max(start, j - k)


def versions_needed(start: int, max_steps: int, k: int) -> range:
    """The versions, published after updates, that some batch j < max_steps is sampled by
    (the starting version needs no publishing)."""
    return range(start + 1, max(start + 1, max_steps - k))


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (what changes in an update: the adapters with LoRA)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def producer_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` for sampling: its own trainable parameters, the frozen ones (a LoRA
    base) and the buffers shared with `model`; no gradients, eval mode."""
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    twin = copy.deepcopy(model, memo)
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin.eval()


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, w in weights.items():
        params[name].copy_(w)


@dataclasses.dataclass(frozen=True)
class Produced:
    """A batch as the producer hands it over: batch j for one trainer rank, the data position
    after drawing its prompts, and the producer's timings."""

    batch: RolloutBatch
    index: int
    data_state: tuple[int, int]  # (epoch, data_index) after batch `index`
    sample_s: float  # sampling and scoring it
    wait_s: float  # waiting for the policy version it needed


def _tensors(obj):
    """Every tensor in a value of dataclasses, dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def used_on(batch, stream) -> None:
    """A batch the producer thread allocated on its own CUDA stream is consumed on `stream`
    (the trainer's): `record_stream` keeps the caching allocator from handing its memory to
    the producer's next allocations while the trainer's kernels that read it are still
    queued, after the trainer drops the batch."""
    for t in _tensors(batch):
        if t.device == stream.device:
            t.record_stream(stream)


def _consume(state: TrainState, p: Produced, step: int, k: int) -> RolloutBatch:
    """Check the bound and move the data position to after the consumed batch."""
    if p.index != step:
        raise GrpoError(f"rollout producer sent batch {p.index} for step {step + 1}")
    staleness = step - p.batch.policy_version
    if not 0 <= staleness <= k:  # the schedule makes this impossible: a bug if it happens
        raise GrpoError(
            f"step {step + 1}: batch sampled by policy {p.batch.policy_version}, "
            f"{staleness} updates old (rollout.max_staleness={k})"
        )
    state.epoch, state.data_index = p.data_state
    return p.batch


class _Asynchronous(RolloutSource):
    """What both asynchronous placements share: the bound, the per-step metrics."""

    asynchronous = True

    def __init__(self, cfg: Config, state: TrainState):
        self.cfg = cfg
        self.k = cfg.rollout.max_staleness
        self.start = state.step
        self.max_steps = cfg.train.max_steps
        self.timeout_s = cfg.rollout.async_timeout_s
        self._last: dict = {}

    def _record(self, p: Produced, step: int, waited_s: float) -> None:
        self._last = {
            "async/staleness": float(step - p.batch.policy_version),
            "async/trainer_wait_s": waited_s,
            "async/producer_wait_s": p.wait_s,
            "async/producer_sample_s": p.sample_s,
        }

    def metrics(self) -> dict:
        """The consumed batch's staleness (updates between its sampling policy and the one it
        trains) and the time each side waited, for the step just taken."""
        return dict(self._last)


class ColocatedRollouts(_Asynchronous):
    """A producer thread sampling ahead on a copy of the policy, in the trainer's process.

    The trainer publishes each needed version after its update (a snapshot of the trainable
    weights, so at most k + 1 snapshots are held); the thread loads version
    `behaviour_version(j)` into its copy before sampling batch j. Under DDP every rank has its
    producer, and the producers keep dynamic sampling's rounds in step over their own gloo
    group (`lockstep`), apart from the trainers' collectives.
    """

    def __init__(
        self,
        cfg: Config,
        policy: Policy,
        make_sampler,
        rows,
        reward_fns,
        make_env,
        state: TrainState,
        dist=SINGLE,
        lockstep: Dist = SINGLE,
    ):
        super().__init__(cfg, state)
        self.model = producer_copy(policy.model)
        self.policy = dataclasses.replace(policy, model=self.model, ref_model=None)
        self.sampler = make_sampler(self.model)
        self.rows, self.reward_fns, self.make_env = rows, reward_fns, make_env
        self.dist, self.lockstep = dist, lockstep
        self.cursor = TrainState(state.step, state.epoch, state.data_index)
        self._cond = threading.Condition()
        self._snapshots: dict[int, tuple[dict[str, torch.Tensor], object]] = {}
        self._ready: dict[int, Produced] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    @property
    def cache_bytes(self) -> int:
        """The producer thread samples while the trainer updates: its sampler keeps its cache."""
        return self.sampler.kept_cache_bytes

    @property
    def compile_s(self) -> float:
        return self.sampler.compile_s

    # ------------------------------------------------------------------ producer thread

    def _run(self) -> None:
        # CUDA: the producer's kernels go to a stream of their own, so they can overlap the
        # trainer's; a snapshot is waited for (its event) before it is read, and a batch is
        # complete (its stream synchronized) before the trainer gets it
        cuda = self.model.device.type == "cuda"
        stream = torch.cuda.Stream(self.model.device) if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            self._produce(stream)

    def _produce(self, stream) -> None:
        loaded = self.start  # the copy holds the trainer's weights at the start
        try:
            for j in range(self.start, self.max_steps):
                v = behaviour_version(j, self.k, self.start)
                t0 = time.perf_counter()
                with self._cond:
                    while v != loaded and v not in self._snapshots and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    weights = self._snapshots.pop(v) if v != loaded else None
                if weights is not None:
                    weights, ready = weights
                    if ready is not None:
                        stream.wait_event(ready)
                    load_weights(self.model, weights)
                    loaded = v
                t1 = time.perf_counter()
                batch = rollout_batches(
                    self.cfg,
                    self.policy,
                    self.sampler,
                    self.rows,
                    self.cursor,
                    self.reward_fns,
                    j,
                    [self.dist.rank],
                    self.dist.world_size,
                    self.lockstep,
                    self.make_env,
                    policy_version=v,
                )[0]
                if stream is not None:
                    stream.synchronize()
                done = Produced(
                    batch,
                    j,
                    (self.cursor.epoch, self.cursor.data_index),
                    time.perf_counter() - t1,
                    t1 - t0,
                )
                with self._cond:
                    self._ready[j] = done
                    self._cond.notify_all()
        except BaseException as e:  # reported by the trainer, at its next wait
            with self._cond:
                self._error = e
                self._cond.notify_all()

    # ------------------------------------------------------------------ trainer side

    def next(self, state: TrainState) -> RolloutBatch:
        """Batch `state.step`, waiting for it (at most rollout.async_timeout_s)."""
        j = state.step
        t0 = time.perf_counter()
        with self._cond:
            while j not in self._ready and self._error is None:
                left = self.timeout_s - (time.perf_counter() - t0)
                if left <= 0 or not self._thread.is_alive():
                    raise GrpoError(
                        f"the rollout producer thread sent no batch for step {j + 1} within "
                        f"rollout.async_timeout_s={self.timeout_s:g} s: it hung (a reward "
                        "function or environment that never returns?) or stopped"
                    )
                self._cond.wait(min(left, 1.0))
            if j not in self._ready:
                e = self._error
                line = str(e).strip().splitlines()[0] if str(e).strip() else ""
                what = line if isinstance(e, GrpoError) else f"{type(e).__name__}: {line}"
                raise GrpoError(
                    f"the rollout producer failed sampling the batch of step {j + 1}: {what}"
                ) from e
            p = self._ready.pop(j)
        if self.model.device.type == "cuda":  # allocated on the producer's stream
            used_on(p.batch, torch.cuda.current_stream(self.model.device))
        self._record(p, j, time.perf_counter() - t0)
        return _consume(state, p, j, self.k)

    def published(self, model, version: int) -> None:
        """After update `version`: snapshot the trainable weights if a batch will need them."""
        if version not in versions_needed(self.start, self.max_steps, self.k):
            return
        snap = {n: p.detach().clone() for n, p in trainable_weights(model).items()}
        ready = None
        if self.model.device.type == "cuda":  # the copies, queued on the trainer's stream
            ready = torch.cuda.Event()
            ready.record()
        with self._cond:
            self._snapshots[version] = (snap, ready)
            self._cond.notify_all()

    def close(self, drain: bool = True) -> None:
        """Stop the producer: it finishes the batch it is sampling (waited for up to
        rollout.async_timeout_s when `drain`) and samples no other."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(self.timeout_s if drain else 0.0)


# --------------------------------------------------------------------------- disaggregated

_STOP, _WEIGHTS, _START = 0, 1, 2


def _wait(work, timeout_s: float) -> None:
    work.wait(datetime.timedelta(seconds=timeout_s))


def _recv(shape_or_tensor, src: int, group, timeout_s: float) -> torch.Tensor:
    t = shape_or_tensor
    _wait(td.irecv(t, src=src, group=group), timeout_s)
    return t


def _send_message(header: torch.Tensor, buffer: torch.Tensor, dst: int, group) -> list:
    """Sizes, header, buffer to `dst`, without waiting (the works and tensors are returned, to
    be kept alive until waited for)."""
    sizes = torch.tensor([header.numel(), buffer.numel()], dtype=torch.int64)
    return [(td.isend(t, dst=dst, group=group), t) for t in (sizes, header, buffer)]


def _recv_message(src: int, group, timeout_s: float) -> tuple[dict, torch.Tensor]:
    sizes = _recv(torch.empty(2, dtype=torch.int64), src, group, timeout_s)
    header = _recv(torch.empty(int(sizes[0]), dtype=torch.uint8), src, group, timeout_s)
    buffer = _recv(torch.empty(int(sizes[1]), dtype=torch.uint8), src, group, timeout_s)
    return decode_header(header), buffer


class RemoteRollouts(_Asynchronous):
    """A trainer rank's side of disaggregated rollouts: it receives its batches from its
    producer rank; trainer rank 0 also broadcasts the weights the producers need."""

    def __init__(self, cfg: Config, policy: Policy, rows, roles: Roles, state: TrainState):
        super().__init__(cfg, state)
        self.policy, self.rows, self.roles = policy, rows, roles
        self.device = policy.model.device
        self.source = roles.producer_of(roles.rank)
        self._pending: list = []  # works of the last broadcast, with their tensors
        self._published = state.step
        self._next = state.step  # the next batch to receive
        self._closed = False
        if roles.rank == 0:
            self._broadcast(_START, state.step, state)

    def _broadcast(self, cmd: int, version: int, state: TrainState | None = None) -> None:
        for work, _ in self._pending:
            _wait(work, self.timeout_s)
        data = (state.epoch, state.data_index) if state is not None else (0, 0)
        head = torch.tensor([cmd, version, *data], dtype=torch.int64)
        self._pending = [(td.broadcast(head, src=0, group=self.roles.weights, async_op=True), head)]
        if cmd != _STOP:
            _, buffer = pack_tensors(trainable_weights(self.policy.model))
            work = td.broadcast(buffer, src=0, group=self.roles.weights, async_op=True)
            self._pending.append((work, buffer))

    def next(self, state: TrainState) -> RolloutBatch:
        j = state.step
        t0 = time.perf_counter()
        try:
            header, buffer = _recv_message(self.source, self.roles.link, self.timeout_s)
        except RuntimeError as e:  # the producer died, hung past the timeout, or the link broke
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrpoError(
                f"rank {self.roles.rank}: rollout producer rank {self.source} sent no batch for "
                f"step {j + 1} (rollout.async_timeout_s={self.timeout_s:g}): {first[:200]}. "
                "It died or hung: its own line says why"
            ) from None
        extra = header["extra"]
        batch = unpack_batch(header, buffer, self.rows, self.device)
        p = Produced(
            batch, extra["index"], tuple(extra["data_state"]), extra["sample_s"], extra["wait_s"]
        )
        self._record(p, j, time.perf_counter() - t0)
        self._next = j + 1
        return _consume(state, p, j, self.k)

    def published(self, model, version: int) -> None:
        """After update `version`: rank 0 broadcasts the weights if a batch will need them."""
        if version not in versions_needed(self.start, self.max_steps, self.k):
            return
        self._published = version  # on every trainer rank: what the producers will have sampled
        if self.roles.rank == 0:
            self._broadcast(_WEIGHTS, version)

    def close(self, drain: bool = True) -> None:
        """Tell the producers to stop and receive the batches they sampled ahead (they wait
        until each one is received); without `drain` (a failure) only stop."""
        if self._closed:
            return
        self._closed = True
        if not drain:  # a failure is on its way out: tell the producers if the link still works
            try:
                if self.roles.rank == 0:
                    head = torch.tensor([_STOP, self._published, 0, 0], dtype=torch.int64)
                    td.broadcast(head, src=0, group=self.roles.weights, async_op=True)
            except Exception as e:  # the failure being raised says more
                log.debug("rollout producers not told to stop: %s", e)
            return
        if self.roles.rank == 0:
            self._broadcast(_STOP, self._published)
        # the producer sampled every batch j < max_steps whose version was published
        last = min(self.max_steps - 1, self._published + self.k)
        for _ in range(self._next, last + 1):
            _recv_message(self.source, self.roles.link, self.timeout_s)
        for work, _ in self._pending:
            _wait(work, self.timeout_s)


def run_producer(
    cfg: Config, policy: Policy, sampler, rows, reward_fns, make_env, roles: Roles, where
) -> dict:
    """A producer rank's loop: sample batch j for each trainer rank it serves with policy
    version `behaviour_version(j)`, send it, and take each published version from trainer
    rank 0, until rank 0 says stop. Returns a summary of what it did.

    SIGTERM and SIGINT are noted and otherwise ignored here: the trainer ranks decide when the
    run stops (they checkpoint, then tell the producers, which hand over what they sampled
    ahead first).
    """
    with _signals_noted():
        return _produce(cfg, policy, sampler, rows, reward_fns, make_env, roles, where)


@contextlib.contextmanager
def _signals_noted():
    """SIGTERM / SIGINT logged once and otherwise ignored for the duration (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def note(signum, frame):
        if not seen:
            log.info(
                "rollout producer: %s noted; the trainer ranks stop the run",
                signal.Signals(signum).name,
            )
        seen.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _produce(cfg: Config, policy: Policy, sampler, rows, reward_fns, make_env, roles: Roles, where):
    # the trainers may be busy for long between two messages (an evaluation on rank 0)
    k = cfg.rollout.max_staleness
    timeout = max(cfg.rollout.async_timeout_s, cfg.train.dist_timeout_s)
    weights = trainable_weights(policy.model)
    layout, packed = pack_tensors(weights)
    size = packed.numel()
    index_of = {id(r): i for i, r in enumerate(rows)}
    serves = roles.served_by(roles.rank)
    sends: collections.deque = collections.deque()

    def receive() -> tuple[int, int, int, int]:
        head = torch.empty(4, dtype=torch.int64)
        _wait(td.broadcast(head, src=0, group=roles.weights, async_op=True), timeout)
        cmd, version, epoch, index = head.tolist()
        if cmd != _STOP:
            buffer = torch.empty(size, dtype=torch.uint8)
            _wait(td.broadcast(buffer, src=0, group=roles.weights, async_op=True), timeout)
            load_weights(policy.model, unpack_tensors(layout, buffer, policy.model.device))
        return cmd, version, epoch, index

    where.phase = "waiting for the trainer's start"
    cmd, start, epoch, index = receive()
    if cmd != _START:
        return _finish(sends, timeout, 0)
    cursor = TrainState(start, epoch, index)
    loaded, produced = start, 0
    for j in range(start, cfg.train.max_steps):
        v = behaviour_version(j, k, start)
        t0 = time.perf_counter()
        where.step, where.phase = j + 1, "waiting for weights"
        while loaded < v:
            cmd, loaded, _, _ = receive()
            if cmd == _STOP:
                return _finish(sends, timeout, produced)
        t1 = time.perf_counter()
        where.phase = "rollout"
        batches = rollout_batches(
            cfg,
            policy,
            sampler,
            rows,
            cursor,
            reward_fns,
            j,
            serves,
            roles.n_trainers,
            roles.lockstep,
            make_env,
            policy_version=v,
        )
        sample_s = time.perf_counter() - t1
        for t, batch in zip(serves, batches):
            extra = {
                "index": j,
                "data_state": [cursor.epoch, cursor.data_index],
                "sample_s": sample_s,
                "wait_s": t1 - t0,
            }
            header, buffer = pack_batch(batch, [index_of[id(r)] for r in batch.rows], extra)
            sends.append(_send_message(header, buffer, t, roles.link))
        produced += 1
        while len(sends) > (k + 1) * len(serves):  # bounded: at most k + 1 batches in flight
            for work, _ in sends.popleft():
                _wait(work, timeout)
    where.phase = "waiting for the trainer's stop"
    while True:
        cmd, *_ = receive()
        if cmd == _STOP:
            return _finish(sends, timeout, produced)


def _finish(sends, timeout: float, produced: int) -> dict:
    for message in sends:
        for work, _ in message:
            _wait(work, timeout)
    return {"role": "producer", "batches": produced}
