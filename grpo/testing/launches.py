"""Counting what a decode step asks of the device, on any machine: kernel launches and host syncs.

A GPU decode step of a small model is host-bound when it launches more kernels than the GPU
needs time for (at ~5-10 us of host time per launch, 1,000 launches cost 5-10 ms against ~1 ms
of weight reads at 0.6B). The number of launches is a property of the code, not of the device:
`OpCounter` counts every aten op that would run a kernel (views, metadata reads and the
composite-implicit decompositions that run no kernel of their own are not counted) under a
`TorchDispatchMode`, so the count taken on a CPU with CUDA's code paths forced is the count a
GPU would launch eagerly. `_local_scalar_dense` (`.item()`, `bool(t)`, `int(t)` of a device
tensor) and `tolist` / `numpy` are host syncs: the host waits for the device to catch up.

`per_decode_step` gives the steady-state cost of one decode step of `Sampler.sample`, the
difference of two rollouts of n1 and n2 steps divided by n2 - n1, so prefill and per-rollout
set-up cancel out. `benchmarks/bench_sampler.py` reports it; tests/test_launches.py holds the
budgets.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# ops that run no kernel: shape and stride changes, metadata reads, aliasing
_FREE = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "permute",
    "transpose",
    "t",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "alias",
    "detach",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "narrow",
    "view_as",
    "diagonal",
    "unfold",
    "lift_fresh",
    "empty",
    "empty_strided",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "size",
    "stride",
    "numel",
    "dim",
    "is_same_size",
    "_reshape_alias",
    "resize_",
    "set_",
}
# composite ops that run one fused kernel where it matters (CUDA): counted once, not decomposed
_FUSED = {"rms_norm", "_fused_rms_norm"}
SYNC = "_local_scalar_dense"


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


class OpCounter(TorchDispatchMode):
    """Counts the kernels the ops run inside it would launch, by aten op name.

    `total` is the number of launches; `counts` how many of each op (`counts["_to_copy"]`:
    dtype casts and copies); `syncs` the host syncs (`_local_scalar_dense`).
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name not in _FUSED and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        ):
            with self:  # count the ops it decomposes into (e.g. `to` -> `_to_copy` or nothing)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if name not in _FREE:
            self.counts[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(n for k, n in self.counts.items() if k != SYNC)

    @property
    def syncs(self) -> int:
        return self.counts[SYNC]

    @property
    def casts(self) -> int:
        return self.counts["_to_copy"]


class _HostReads(TorchFunctionMode):
    """Counts reads of a whole tensor into Python (`tolist`, `numpy`): a host sync on a GPU,
    but no aten op on a CPU, so `OpCounter` alone would not see them."""

    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.counter.counts[SYNC] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> OpCounter:
    """Run `fn` under an `OpCounter` (host reads of whole tensors counted as syncs too);
    return the counter."""
    c = OpCounter()
    with _HostReads(c), c:
        fn()
    return c


def per_decode_step(run: Callable[[int], object], n1: int = 4, n2: int = 12) -> dict[str, float]:
    """Launches, casts and host syncs of one steady-state decode step.

    Args:
        run: steps -> runs a rollout of that many decode steps (`Sampler.sample` with
            `max_new_tokens=steps` and stop ids no row draws).
        n1, n2: the two rollout lengths; both a multiple of the sampler's sync period keep
            the syncs' share exact.

    Returns:
        {"launches", "casts", "syncs"} per decode step: (count(n2) - count(n1)) / (n2 - n1).
    """
    run(n1)  # warm: lazily built tables and caches are not a step's cost
    a, b = count_ops(lambda: run(n1)), count_ops(lambda: run(n2))
    d = n2 - n1
    return {
        "launches": (b.total - a.total) / d,
        "casts": (b.casts - a.casts) / d,
        "syncs": (b.syncs - a.syncs) / d,
    }


@contextlib.contextmanager
def cuda_decode_paths():
    """A CUDA decode step's code paths on a CPU, for counting what a GPU step launches:
    attention through SDPA's fused decode call with the query heads of a kv head folded
    (`decode_sdpa`) and grouped heads repeated for T-query calls, the arrangements
    memory-efficient attention needs (`grpo.models.sdpa_choice.forced`; a GPU whose selector
    takes grouped heads with a mask launches fewer), and prompt keys and values copied per row
    rather than held once per group (`share_prompt_kv`); restored after the block.
    (`getattr`: a tree before issue 60 had no `share_prompt_kv`.)"""
    import grpo.rollout.sampler as sampler_mod
    from grpo.models import sdpa_choice

    share = getattr(sampler_mod, "share_prompt_kv", None)
    sampler_mod.share_prompt_kv = lambda device: False
    try:
        with sdpa_choice.forced(queries=sdpa_choice.REPEAT, decode=sdpa_choice.FOLD):
            yield
    finally:
        if share is None:
            del sampler_mod.share_prompt_kv
        else:
            sampler_mod.share_prompt_kv = share
