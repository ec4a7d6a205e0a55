"""The one benchmark harness: timing, peak memory, environment stamp, Markdown table + JSON file.

Every benchmark (`grpo bench logprobs`, and those under the repository's `benchmarks/`, which
import it as `benchmarks.harness`) uses it the same way:

    from benchmarks.harness import measure, write_results
    t = measure(lambda: step(batch), warmup=2, repeats=10, device="cuda")  # or measure_interleaved
    rows.append({"impl": "ours", "median_ms": t.median_ms, "peak_mem_mib": t.peak_mem_mib})
    write_results("bench_x", rows, columns=["impl", "median_ms", "peak_mem_mib"])

How peak memory is measured (the memory a call adds at its worst moment, outputs included):
- CUDA: `torch.cuda.reset_peak_memory_stats()` before each repeat, then
  `max_memory_allocated() - memory_allocated()` taken before the call (caching allocator bytes).
- CPU (Linux): resident set size. Before each repeat the harness runs `gc.collect()` and glibc's
  `malloc_trim(0)` (so memory freed earlier is really returned and cannot be silently reused),
  resets the kernel's RSS high-water mark by writing "5" to /proc/self/clear_refs, and reads
  VmRSS; after the call, peak = VmHWM - that VmRSS. This is exact (the kernel tracks the high-water
  mark on every page fault) and costs nothing during the call. Where clear_refs cannot be written,
  a background thread samples VmRSS every 0.5 ms instead (misses peaks shorter than that).
  RSS counts touched pages: `torch.empty` that is never written costs nothing, as in reality.
The reported peak is the largest over the timed repeats.
"""

import ctypes
import ctypes.util
import gc
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

# a source checkout's benchmarks/results; installed elsewhere: bench_results/ under the
# working directory
_CHECKOUT = Path(__file__).resolve().parents[3]
RESULTS_DIR = (
    _CHECKOUT / "benchmarks" / "results"
    if (_CHECKOUT / "benchmarks").is_dir() and (_CHECKOUT / "grpo").is_dir()
    else Path("bench_results")
)
_MIB = 2**20


@dataclass(frozen=True)
class Timing:
    """Result of `measure`: wall time per call in ms (median and spread) and peak memory in MiB."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    peak_mem_mib: float
    times_ms: tuple[float, ...]


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _read_status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _malloc_trim() -> None:
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        try:
            ctypes.CDLL(libc_name).malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc


class _CpuPeak:
    """Context manager measuring the RSS the block adds at its peak, in bytes (see module doc)."""

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        self.peak_bytes = float("nan")
        self._thread = None
        if not os.path.exists("/proc/self/status"):
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self._hwm = True
        except OSError:
            self._hwm = False
        self._base = _read_status_kib("VmRSS")
        if not self._hwm:
            self._max = self._base
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._max = max(self._max, _read_status_kib("VmRSS"))
            time.sleep(0.0005)

    def __exit__(self, *exc):
        if not os.path.exists("/proc/self/status"):
            return False
        if self._hwm:
            peak = _read_status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._max, _read_status_kib("VmRSS"))
        self.peak_bytes = max(0, peak - self._base) * 1024
        return False


def _timed_call(fn: Callable[[], object], is_cuda: bool, device) -> tuple[float, float]:
    """One call of `fn`: (milliseconds, MiB it added at its peak, outputs included)."""
    if is_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize(device)
        peak_mib = (torch.cuda.max_memory_allocated(device) - base) / _MIB
        del out
        return start.elapsed_time(end), peak_mib
    with _CpuPeak() as mem:
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
    del out
    return ms, mem.peak_bytes / _MIB


def _timing(times: list[float], peaks: list[float]) -> Timing:
    return Timing(
        median_ms=statistics.median(times),
        p20_ms=_percentile(times, 20),
        p80_ms=_percentile(times, 80),
        peak_mem_mib=max(peaks),
        times_ms=tuple(times),
    )


def measure(
    fn: Callable[[], object],
    *,
    warmup: int = 2,
    repeats: int = 10,
    device: str | torch.device = "cpu",
) -> Timing:
    """Time `fn()` and record the memory it adds at its peak.

    Args:
        fn: the call to time; its return value is kept alive until the call's memory is read, so
            outputs count toward the peak, and dropped before the next repeat.
        warmup: untimed calls first (compilation, autotuning, allocator warm-up).
        repeats: timed calls; median and p20/p80 are over these.
        device: where `fn` runs: CUDA is timed with CUDA events (device time of the queued work),
            anything else with time.perf_counter.

    Returns:
        Timing(median_ms, p20_ms, p80_ms, peak_mem_mib, times_ms).
    """
    return measure_interleaved({"fn": fn}, warmup=warmup, repeats=repeats, device=device)["fn"]


def measure_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    warmup: int = 2,
    repeats: int = 10,
    device: str | torch.device = "cpu",
) -> dict[str, Timing]:
    """`measure` for several calls side by side, round-robin: repeat r runs each once.

    On a shared machine whose load drifts over minutes, timing A's repeats and then B's lets the
    drift land in the A/B ratio; interleaving (with the order rotated every repeat) makes every
    call see the same conditions, so ratios stay meaningful.

    Args:
        fns: name -> call, as for `measure`.
        warmup, repeats, device: as for `measure` (warm-up calls are interleaved too).

    Returns:
        name -> Timing.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    is_cuda = torch.device(device).type == "cuda"
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    peaks = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ms, peak = _timed_call(fns[name], is_cuda, device)
            times[name].append(ms)
            peaks[name].append(peak)
    return {name: _timing(times[name], peaks[name]) for name in names}


def matmul_ceiling_tflops(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, size: int | None = None
) -> float:
    """Measured dense matmul rate (TFLOP/s) of a square `size`^3 product: the roofline ceiling.

    Args:
        device: where to measure.
        dtype: operand dtype (bf16 for the GPU roofline; float32 on CPU).
        size: matrix side; default 8192 on CUDA, 2048 elsewhere.

    Returns:
        2 * size**3 / median time, in TFLOP/s.
    """
    is_cuda = torch.device(device).type == "cuda"
    size = size or (8192 if is_cuda else 2048)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    t = measure(lambda: a @ b, warmup=3, repeats=10 if is_cuda else 3, device=device)
    return 2 * size**3 / (t.median_ms * 1e-3) / 1e12


def copy_bandwidth_gbps(device: str | torch.device = "cpu", mib: int = 256) -> float:
    """Measured memory bandwidth (GB/s) of a `mib` MiB tensor copy (read + write counted): the
    roofline's bandwidth ceiling."""
    is_cuda = torch.device(device).type == "cuda"
    n = mib * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=2, repeats=10 if is_cuda else 5, device=device)
    return 2 * n * 4 / (t.median_ms * 1e-3) / 1e9


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(
            ["git", *args], cwd=RESULTS_DIR.parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)  # no import: importing triton here would be a side effect
    except metadata.PackageNotFoundError:
        return None


def env_stamp() -> dict:
    """Where and with what a result was measured: machine, CPU/GPU, versions, git SHA, time.

    `loadavg_1m` flags CPU numbers taken on a busy (shared) machine.

    Returns:
        A JSON-serializable dict.
    """
    cuda = torch.cuda.is_available()
    status = _git("status", "--porcelain")
    return {
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "git_sha": _git("rev-parse", "HEAD") or "unknown",
        "git_dirty": bool(status) if status is not None else None,
    }


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """Rows as a Markdown table over `columns` (missing or None values print as "-")."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def add_output_args(parser, name: str | None) -> None:
    """`--name` (the results file stem, default `name`) and `--out-dir` (default
    `RESULTS_DIR`: benchmarks/results/ in a source checkout, else ./bench_results/): what
    `write_results` takes."""
    default = name or "from the settings"
    parser.add_argument("--name", default=name, help=f"results file stem (default: {default})")
    parser.add_argument("--out-dir", default=None, help=f"results folder (default {RESULTS_DIR})")


def comma_list(parser, flag: str, text: str, valid) -> list[str]:
    """The items of a comma list; one that is not in `valid` is a parser error naming `flag`."""
    items = [s for s in text.split(",") if s]
    for item in items:
        if item not in valid:
            parser.error(f"{flag}: unknown {item!r}; valid: {list(valid)}")
    return items


# Called as hook(name, rows) each time `write_results` writes a table (the whole table so far:
# benchmarks write after every case, so a hook sees each row as soon as it is measured).
RESULT_HOOKS: list = []


def write_results(
    name: str,
    rows: Sequence[dict],
    columns: Sequence[str],
    *,
    out_dir: str | Path | None = None,
    meta: dict | None = None,
) -> Path:
    """Print the Markdown table and write `<out_dir>/<name>.json` and `<name>.md`.

    Args:
        name: file stem, e.g. "logprobs_cpu".
        rows: one dict per measurement (JSON-serializable values).
        columns: which keys the table shows, in order (the JSON keeps every key).
        out_dir: target folder, default `RESULTS_DIR`.
        meta: free-form run description (command line, shapes, notes) stored in both files.

    Returns:
        Path of the JSON file.
    """
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    env = env_stamp()
    table = markdown_table(rows, columns)
    print(table, flush=True)
    payload = {"name": name, "env": env, "meta": meta or {}, "columns": list(columns)}
    payload["rows"] = list(rows)
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    for hook in RESULT_HOOKS:  # e.g. the GPU check appending each new row as a JSON line
        hook(name, payload["rows"])
    env_line = ", ".join(f"{k}={v}" for k, v in env.items() if v is not None)
    meta_lines = [f"- {k}: {v}" for k, v in (meta or {}).items()]
    md = "\n".join([f"# {name}", "", f"Environment: {env_line}", "", *meta_lines, "", table, ""])
    (out / f"{name}.md").write_text(md)
    return json_path
