"""What the python environment's sandbox costs per call: `run_python` latency in the sandbox
against the resource limits alone (what a call cost before the sandbox), side by side.

    python -m benchmarks.bench_python_env                   # the recorded run (50 repeats)
    python -m benchmarks.bench_python_env --repeats 5 --out-dir /tmp/bench   # quick

Both modes run the same child program (grpo/envs/_sandbox_child.py) on the same code with the same
limits; `limits only` skips the namespaces, the new root, the privilege drop and Landlock (it
keeps the network namespace the resource boundary already had). Calls are interleaved, the
order rotating every repeat, so that a busy machine slows both alike. Columns: `median_ms`,
`p20_ms`, `p80_ms` of wall time per call (process start to reaped); `ratio` the sandbox's median
over the limits-only median of the same code; `target` the goal (<= 1.5).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness import add_output_args, comma_list, measure_interleaved, write_results
from grpo.envs.sandbox import _run, isolation, run_python  # _run: the limits-only baseline

CODES = {
    "pass": "pass",
    "print": "print(sum(range(10**5)))",
    "numpy": "import numpy\nprint(numpy.arange(10).sum())",
}
COLUMNS = ["code", "mode", "median_ms", "p20_ms", "p80_ms", "ratio", "target"]
TARGET = 1.5
# run_python's default limits, in the child program's units
LIMITS = dict(
    cpu_s=5, as_bytes=512 << 20, file_bytes=1 << 20, nofile=64, nproc=16, dir_bytes=16 << 20
)


def limits_only(code: str) -> None:
    returncode, *_ = _run(code, LIMITS, False, time.monotonic() + 5, 4096)
    assert returncode == 0, f"limits-only run failed: {returncode}"


def sandboxed(code: str) -> None:
    result = run_python(code)
    assert result.ok, result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--codes", default=",".join(CODES), help="comma list of " + str(list(CODES))
    )
    parser.add_argument("--repeats", type=int, default=50)
    add_output_args(parser, "python_env_cpu")
    args = parser.parse_args(argv)
    iso = isolation()
    if not iso.complete:
        parser.error(f"the sandbox is not available here: {iso.error or iso.missing}")
    rows = []
    for name in comma_list(parser, "--codes", args.codes, CODES):
        code = CODES[name]
        timings = measure_interleaved(
            {"sandbox": lambda c=code: sandboxed(c), "limits only": lambda c=code: limits_only(c)},
            warmup=2,
            repeats=args.repeats,
        )
        base = timings["limits only"].median_ms
        for mode, t in timings.items():
            rows.append(
                dict(
                    code=name,
                    mode=mode,
                    median_ms=t.median_ms,
                    p20_ms=t.p20_ms,
                    p80_ms=t.p80_ms,
                    times_ms=list(t.times_ms),
                    ratio=t.median_ms / base,
                    target=TARGET if mode == "sandbox" else None,
                )
            )
    meta = {
        "command": "python -m benchmarks.bench_python_env " + " ".join(argv or []),
        "repeats": args.repeats,
        "isolation": iso.describe(),
    }
    write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)
    return rows


if __name__ == "__main__":
    main()
