"""Tests of benchmarks/harness.py (timing, peak memory, results files) and a bench smoke run."""

import json
import time

import pytest
import torch

from benchmarks import bench_logprobs
from benchmarks.harness import (
    Timing,
    add_output_args,
    comma_list,
    env_stamp,
    markdown_table,
    measure,
    measure_interleaved,
    write_results,
)
from grpo.envs import isolation

MIB_200MB = 200e6 / 2**20  # 190.7 MiB


def test_measure_cpu_peak_of_a_transient_200mb_tensor():
    def allocate_and_drop():
        x = torch.ones(50_000_000)  # 200 MB, every page touched, freed before returning
        return float(x[0])

    t = measure(allocate_and_drop, warmup=1, repeats=3)
    assert isinstance(t, Timing) and len(t.times_ms) == 3
    assert 0.95 * MIB_200MB < t.peak_mem_mib < 1.15 * MIB_200MB


def test_measure_counts_returned_outputs_and_ignores_existing_memory():
    keep = torch.ones(25_000_000)  # 100 MB alive before and during: not the call's memory
    t = measure(lambda: torch.ones(50_000_000), warmup=0, repeats=2)
    assert 0.95 * MIB_200MB < t.peak_mem_mib < 1.15 * MIB_200MB
    assert measure(lambda: None, warmup=0, repeats=2).peak_mem_mib < 16
    del keep


def test_measure_timing_statistics():
    t = measure(lambda: time.sleep(0.005), warmup=1, repeats=5)
    assert t.p20_ms <= t.median_ms <= t.p80_ms
    assert t.median_ms >= 5.0
    with pytest.raises(ValueError, match="repeats"):
        measure(lambda: None, repeats=0)


def test_measure_interleaved_round_robin_with_rotation():
    order = []

    def call(name, seconds):
        def fn():
            order.append(name)
            time.sleep(seconds)

        return fn

    timings = measure_interleaved(
        {"a": call("a", 0.002), "b": call("b", 0.006)}, warmup=1, repeats=3
    )
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then rotated repeats
    assert set(timings) == {"a", "b"} and len(timings["a"].times_ms) == 3
    assert min(timings["a"].times_ms) >= 2.0 and min(timings["b"].times_ms) >= 6.0


def test_markdown_table_formats_values():
    rows = [{"impl": "a", "ms": 1234.56, "err": 1.5e-6, "x": None}, {"impl": "b", "ms": 12.34}]
    table = markdown_table(rows, ["impl", "ms", "err", "x"])
    assert table.splitlines() == [
        "| impl | ms | err | x |",
        "|---|---|---|---|",
        "| a | 1235 | 1.5e-06 | - |",
        "| b | 12.3 | - | - |",
    ]


def test_write_results_prints_table_and_writes_json_and_md(tmp_path, capsys):
    rows = [{"impl": "naive", "median_ms": 3.0, "extra": "kept in json"}]
    path = write_results("demo", rows, ["impl", "median_ms"], out_dir=tmp_path, meta={"n": 4})
    assert path == tmp_path / "demo.json"
    payload = json.loads(path.read_text())
    assert payload["rows"] == rows and payload["meta"] == {"n": 4}
    assert {"torch", "triton", "git_sha", "cpu", "gpu", "host"} <= set(payload["env"])
    md = (tmp_path / "demo.md").read_text()
    assert "| impl | median_ms |" in md and "| naive | 3 |" in md and "- n: 4" in md
    assert "| naive | 3 |" in capsys.readouterr().out


def test_env_stamp_is_json_serializable():
    stamp = env_stamp()
    assert stamp["torch"] == torch.__version__
    json.dumps(stamp)


@pytest.mark.process  # the harness runs in the default tier through test_kernel_seams' bench test
def test_bench_logprobs_smoke(tmp_path):
    bench_logprobs.main(
        [
            "--quick",
            "--shapes",
            "64x32x300",
            "--impls",
            "naive,chunked,liger,triton",
            "--repeats",
            "1",
            "--out-dir",
            str(tmp_path),
            "--name",
            "smoke",
        ]
    )
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    assert len(rows) == 4 * 4 + 2  # modes x impls, and bwd (derived) of naive and chunked
    chunked = [r for r in rows if r["impl"] == "chunked" and r["mode"] != "bwd"]
    assert all(r["median_ms"] > 0 and r["lp_err"] < 1e-4 for r in chunked)
    assert all(r["note"].startswith("skipped") for r in rows if r["impl"] in ("liger", "triton"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_cuda_peak_of_a_200mb_tensor():
    t = measure(lambda: torch.ones(50_000_000, device="cuda"), warmup=1, repeats=3, device="cuda")
    assert 0.99 * MIB_200MB < t.peak_mem_mib < 1.05 * MIB_200MB
    assert t.median_ms > 0


def test_benchmark_arguments_name_the_bad_item(capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="bench")
    add_output_args(parser, "stem")
    args = parser.parse_args([])
    assert (args.name, args.out_dir) == ("stem", None)
    assert comma_list(parser, "--cases", "a,,b", ("a", "b", "c")) == ["a", "b"]
    with pytest.raises(SystemExit) as e:
        comma_list(parser, "--cases", "a,x", ("a", "b"))
    assert e.value.code == 2
    assert "--cases: unknown 'x'; valid: ['a', 'b']" in capsys.readouterr().err


@pytest.mark.skipif(
    not isolation().complete, reason=f"the sandbox is not available here: {isolation().error}"
)
def test_bench_python_env_smoke(tmp_path):
    """The sandbox-cost benchmark runs both modes on one code and writes its table."""
    from benchmarks import bench_python_env

    rows = bench_python_env.main(["--codes", "pass", "--repeats", "2", "--out-dir", str(tmp_path)])
    assert [r["mode"] for r in rows] == ["sandbox", "limits only"]
    assert rows[1]["ratio"] == 1.0 and rows[0]["ratio"] > 0
    assert (tmp_path / "python_env_cpu.json").exists()
