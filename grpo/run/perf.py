"""Seconds and peak memory per phase of a training step (`perf/*` metrics: `StepClock`), and
the progress bars of its long phases."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

# A phase's bar appears once the phase has run this long (tqdm's `delay`): a step of seconds
# prints nothing beyond the run's own bar, one of minutes shows where it is.
PHASE_BAR_DELAY_S = 5.0


def phase_bar(show: bool, desc: str, total: int | None, unit: str) -> tqdm:
    """A progress bar of one phase of a step (the rollout's decode steps, the reference pass's
    micro-batches, ...), under the run's bar: shown when `show` (train.progress, on rank 0)
    once the phase has run `PHASE_BAR_DELAY_S` seconds, and removed when it closes."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not show,
        leave=False,
        delay=PHASE_BAR_DELAY_S,
        position=1,
        dynamic_ncols=True,
    )


def peak_mem_mib(device: torch.device) -> float:
    """Peak memory: on CUDA the allocator's peak since the last `reset_peak_mem` (tensors only:
    the caching allocator's reserve and the CUDA context are not counted); elsewhere the
    process's peak resident set so far (it cannot be reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak_mem(device: torch.device) -> None:
    """Start a new peak (CUDA; a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def kept_mem_mib(device: torch.device) -> float:
    """Memory held now: on CUDA the allocator's live tensors; elsewhere the process's resident
    set (Linux; 0 where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    import resource

    return pages * resource.getpagesize() / 2**20


class PhasePeaks:
    """Peak memory of each phase of a step, as `perf/peak_mem_<phase>_mib` (and the step's
    maximum as `perf/peak_mem_mib`): the counter restarts at every phase on CUDA. What each
    phase leaves held at its end: `perf/kept_mem_<phase>_mib`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: dict[str, float] = {}
        self.kept: dict[str, float] = {}

    def start(self) -> None:
        self.peaks, self.kept = {}, {}
        reset_peak_mem(self.device)

    def end(self, phase: str) -> None:
        self.peaks[phase] = peak_mem_mib(self.device)
        self.kept[phase] = kept_mem_mib(self.device)
        reset_peak_mem(self.device)

    def metrics(self) -> dict[str, float]:
        out = {f"perf/peak_mem_{k}_mib": v for k, v in self.peaks.items()}
        out.update({f"perf/kept_mem_{k}_mib": v for k, v in self.kept.items()})
        out["perf/peak_mem_mib"] = max(self.peaks.values(), default=peak_mem_mib(self.device))
        return out


class StepClock:
    """A step's seconds and memory per phase: `start()`, then `lap(phase)` at the end of each
    phase; `metrics(tokens)` -> perf/step_s, perf/<phase>_s, perf/tokens_per_s and the
    phases' peak and kept memory (`PhasePeaks`)."""

    def __init__(self, device: torch.device):
        self.peaks = PhasePeaks(device)
        self.seconds: dict[str, float] = {}
        self.t0 = self.t = 0.0

    def start(self) -> None:
        self.peaks.start()
        self.seconds = {}
        self.t0 = self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self.t = now - self.t, now
        self.peaks.end(phase)

    def metrics(self, tokens: float) -> dict[str, float]:
        step_s = self.t - self.t0
        return {
            "perf/step_s": step_s,
            **{f"perf/{phase}_s": s for phase, s in self.seconds.items()},
            "perf/tokens_per_s": tokens / max(step_s, 1e-9),
            **self.peaks.metrics(),
        }
