"""The prepared GPU check (benchmarks/gpu_check.sh -> benchmarks/gpu_check.py): steps in order
of value; a step whose estimate exceeds the time left is skipped, not killed; every
measurement is a JSON line on disk as soon as it is made, so a killed check keeps every finished
result; a step that overruns is stopped by the watchdog with its record; tests run by node id
with their failure texts recorded; the caches round-trip; nothing comes from an index and jobs
rendezvous on this host only; run summaries judge what they claim; and (slow, CI) the CPU dry
run passes every step of both plans on a Python that lacks what the offline CUDA image lacks,
given the wheels benchmarks/gpu_wheels.sh downloads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_run
from benchmarks.gpu_check import Check, Results, Step, run_plan

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
# What such an image lacks (its package list); dill and multiprocess come with datasets.
NOT_ON_IMAGE = (
    "datasets",
    "dill",
    "multiprocess",
    "fastapi",
    "uvicorn",
    "starlette",
    "openai",
    "optuna",
    "trl",
    "liger_kernel",
)


def test_plans_put_the_most_valuable_steps_first():
    """The main plan in the issue's order of value; the second command carries the rest."""
    main = [s.name for s in gpu_check.PLANS["main"]]
    assert main == ["env", "decode", "known-failing", "grpo-step", "packing", "cuda-rest", "parity"]
    more = {s.name for s in gpu_check.PLANS["more"]}
    assert {
        "grpo-ddp",
        "grpo-fsdp",
        "tutorial-grpo",
        "tutorial-async",
        "precision",
        "logprobs",
    } <= more
    for plan in gpu_check.PLANS.values():
        names = [s.name for s in plan]
        assert len(names) == len(set(names)) and all(s.gpu_s > 0 and s.dry_s > 0 for s in plan)
    # the first run's real durations: a process start and CUDA init alone took 5-9 s
    assert all(s.gpu_s >= 10 for plan in gpu_check.PLANS.values() for s in plan)
    assert len(gpu_check.KNOWN_FAILING) == 3 and all("::" in n for n in gpu_check.KNOWN_FAILING)


def quick(name, calls, measure=1):
    def run(check):
        calls.append(name)
        for i in range(measure):
            check.record(kind="measure", value=i)

    return Step(name, 1, 1, run)


def test_a_step_that_would_not_fit_is_skipped_not_run(tmp_path):
    calls = []

    def slow(check):
        calls.append("slow")
        raise AssertionError("a skipped step must not start")

    check = Check(tmp_path / "out", dry=False, budget_s=60, reserve_s=5)
    failed = run_plan(check, [quick("a", calls), Step("slow", 1000, 1000, slow), quick("b", calls)])
    recs = Results.read(tmp_path / "out" / "results.jsonl")
    status = {(r["step"], r["status"]) for r in recs if "status" in r}
    assert failed == 0 and calls == ["a", "b"]
    assert {("a", "ok"), ("slow", "skipped"), ("b", "ok")} <= status
    skip = next(r for r in recs if r.get("status") == "skipped")
    assert skip["reason"].startswith("estimate 1000 s >") and "left" in skip["reason"]
    summary = (tmp_path / "out" / "gpu_summary.md").read_text()
    assert "| slow | skipped | 1000 |" in summary and "| a | ok | 1 |" in summary
    check.close()


def test_a_failing_step_is_recorded_and_the_next_one_runs(tmp_path):
    calls = []

    def boom(check):
        check.record(kind="measure", before="the failure")
        raise RuntimeError("no such kernel")

    check = Check(tmp_path, dry=True, budget_s=60, reserve_s=1)
    assert run_plan(check, [Step("boom", 1, 1, boom), quick("after", calls)]) == 1
    recs = Results.read(tmp_path / "results.jsonl")
    failed = next(r for r in recs if r.get("status") == "failed")
    assert failed["step"] == "boom" and failed["error"] == "RuntimeError: no such kernel"
    assert any(r.get("before") == "the failure" for r in recs) and calls == ["after"]
    check.close()


def test_each_measurement_is_on_disk_when_it_is_made(tmp_path):
    """A step reading the results file sees its own earlier record: nothing waits for the end
    of the step; benchmark rows arrive through the harness hook once each."""
    from benchmarks import harness

    seen = []

    def step(check):
        check.record(kind="measure", first=1)
        seen.append(Results.read(check.results.path)[-1])
        harness.write_results("t", [{"x": 1}], ["x"], out_dir=check.res)
        harness.write_results("t", [{"x": 1}, {"x": 2}], ["x"], out_dir=check.res)
        seen.append(Results.read(check.results.path)[-1])

    check = Check(tmp_path, dry=True, budget_s=60, reserve_s=1)
    harness.RESULT_HOOKS.append(check.benchmark_rows)
    try:
        run_plan(check, [Step("s", 1, 1, step)])
    finally:
        harness.RESULT_HOOKS.remove(check.benchmark_rows)
    assert seen[0]["first"] == 1 and seen[1]["x"] == 2
    rows = [r for r in Results.read(tmp_path / "results.jsonl") if r.get("kind") == "row"]
    assert [r["x"] for r in rows] == [1, 2] and rows[0]["table"] == "t"
    check.close()


_DRIVER = """
import sys, time
from pathlib import Path
from benchmarks.gpu_check import Check, Step, run_plan

def fast(check):
    check.record(kind="measure", value=1)
    check.record(kind="measure", value=2)

def hang(check):
    check.record(kind="measure", hanging=True)
    time.sleep(120)

check = Check(Path(sys.argv[1]), dry=True, budget_s=float(sys.argv[2]), reserve_s=0)
run_plan(check, [Step("fast", 1, 1, fast), Step("hang", 1, 1, hang), Step("never", 1, 1, fast)])
"""


def _driver(out: Path, budget: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(out), str(budget)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for(path: Path, pred, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if any(pred(r) for r in Results.read(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no such record in {path} after {timeout} s")


def test_a_killed_check_keeps_every_finished_result(tmp_path):
    """SIGKILL in the middle of a step (the outer time limit): every record made before is
    readable, the finished step's summary and archive are there."""
    proc = _driver(tmp_path, 600)
    try:
        _wait_for(tmp_path / "results.jsonl", lambda r: r.get("hanging"))
    finally:
        proc.kill()
        proc.wait()
    recs = Results.read(tmp_path / "results.jsonl")
    assert [r["value"] for r in recs if "value" in r] == [1, 2]
    assert {"step": "fast", "status": "ok"}.items() <= next(
        r for r in recs if r.get("status") == "ok"
    ).items()
    assert "| fast | ok |" in (tmp_path / "gpu_summary.md").read_text()
    with tarfile.open(tmp_path / "gpu_results.tar.gz") as tar:
        assert "results.jsonl" in tar.getnames()


@pytest.mark.process
def test_the_watchdog_stops_a_step_that_overruns_the_time_left(tmp_path):
    """A step whose estimate fit but which runs past the time left: the watchdog records it,
    rewrites the summary and exits 124; the steps after it are not started."""
    t0 = time.monotonic()
    proc = _driver(tmp_path, 2)
    code = proc.wait(timeout=90)
    assert code == 124 and time.monotonic() - t0 < 60, proc.stderr.read()[-2000:]
    recs = Results.read(tmp_path / "results.jsonl")
    killed = next(r for r in recs if r.get("status") == "killed")
    assert killed["step"] == "hang" and "watchdog" in killed["reason"]
    assert [r["value"] for r in recs if "value" in r] == [1, 2]
    assert not any(r["step"] == "never" for r in recs)
    assert "| hang | killed |" in (tmp_path / "gpu_summary.md").read_text()


@pytest.mark.process
def test_tests_run_by_name_with_outcomes_and_failure_texts(tmp_path):
    """`Check.pytest`: a record per test as pytest prints it (-v), then each failure's
    assertion text from the JUnit XML; a failing run fails the step."""
    tests = tmp_path / "test_fake_gpu.py"
    tests.write_text(
        "def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 + 1 == 3, 'arithmetic is off'\n"
    )
    check = Check(tmp_path / "out", dry=True, budget_s=120, reserve_s=1)
    check.step = "t"
    with pytest.raises(RuntimeError, match="pytest exited 1"):
        check.pytest([f"{tests}::test_ok", f"{tests}::test_bad"], "fake.xml")
    recs = Results.read(check.results.path)
    outcomes = {r["test"].split("::")[-1]: r["outcome"] for r in recs if r.get("kind") == "test"}
    assert outcomes == {"test_ok": "PASSED", "test_bad": "FAILED"}
    failure = next(r for r in recs if r.get("kind") == "failure")
    assert failure["test"].endswith("::test_bad") and "arithmetic is off" in failure["message"]
    check.close()


def test_caches_round_trip_under_their_key(tmp_path, monkeypatch):
    for name in ("inductor", "triton"):
        d = tmp_path / "before" / name
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "kernel.bin").write_bytes(name.encode() * 10)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before" / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "before" / "triton"))
    check = Check(tmp_path / "out", dry=True, budget_s=60)
    gpu_check.archive_caches(check)
    key = gpu_check.cache_key()
    assert "torch" in key and "triton" in key and gpu_check.host_isa() in key
    archive = tmp_path / "out" / "caches" / f"{key}.tar.gz"
    assert archive.exists()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "after" / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "after" / "triton"))
    gpu_check.restore_caches(check, tmp_path / "out" / "caches")
    for name in ("inductor", "triton"):
        got = (tmp_path / "after" / name / "sub" / "kernel.bin").read_bytes()
        assert got == name.encode() * 10
    check.close()


def test_nothing_comes_from_an_index_and_jobs_stay_on_this_host():
    sh = SCRIPT.read_text()
    pips = [line for line in sh.splitlines() if "pip install" in line]
    assert pips and all("--no-index" in line for line in pips), pips
    src = (REPO / "benchmarks" / "gpu_check.py").read_text()
    runs = re.findall(r'"torch\.distributed\.run",\s*"([^"]+)"', src)
    assert runs and set(runs) == {"--standalone"}, runs  # rendezvous on 127.0.0.1 only
    assert '"configs/gsm8k_qwen3_0.6b_grpo.yaml"' in src and '"configs/tiny_ci.yaml"' in src


def image_env(hidden) -> dict:
    """This environment as a Python without the `hidden` packages (tests/image_sim)."""
    return {
        **os.environ,
        "GRPO_HIDE_PACKAGES": ",".join(hidden),
        "PYTHONPATH": str(REPO / "tests" / "image_sim"),
    }


def test_training_needs_no_serving_or_search_package(tmp_path):
    """fastapi, uvicorn, openai and optuna are imported where serving or a search needs
    them, never by the training path: with them hidden, the CLI and the trainers import and
    the tiny model is made (the GPU check's first steps on an image without them)."""
    env = image_env(("fastapi", "uvicorn", "starlette", "openai", "optuna"))
    probe = "import importlib.util as u; assert u.find_spec('fastapi') is None; import fastapi"
    hidden = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert "No module named 'fastapi'" in hidden.stderr, hidden.stderr  # the simulation holds
    code = (
        "import grpo.apps.cli, grpo.train.grpo, grpo.train.sft, grpo.eval, grpo.apps.pipeline"
        ", grpo.apps.demo, grpo_kernels, benchmarks.bench_step, "
        "benchmarks.gpu_run"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, "-m", "grpo", "tiny-model", "--out", str(tmp_path / "m")],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]


def record(step, **kw):
    base = {
        "step": step,
        "perf/step_s": 1.0 + step,
        "perf/rollout_s": 0.5,
        "perf/logprob_s": 0.2,
        "perf/update_s": 0.3,
        "perf/tokens_per_s": 100.0,
        "perf/peak_mem_mib": 10.0 * step,
        "rollout/logprob_diff_max": 1e-6,
        "rollout/logprob_diff_mean": 1e-7,
        "rollout/first_pass_ratio_mean": 1.0,
        "rollout/reward_mean": 0.1 * step,
    }
    return {**base, **kw}


def test_gpu_run_summarizes_and_judges_a_run(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    recs = [record(1, **{"run/parallel": "ddp over 1 rank (nccl)"}), record(2), record(3)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"torn')
    args = ["--metrics", str(metrics), "--out-dir", str(tmp_path)]
    ok = gpu_run.main(["--name", "ok", *args, "--parallel", "ddp over 1 rank (nccl)"])
    assert ok == 0
    row = json.loads((tmp_path / "ok.json").read_text())["rows"][0]
    # medians over steps 2..3 (step 1 compiles), maxima over all
    assert row["step_s"] == 3.5 and row["first_step_s"] == 2.0 and row["peak_mem_mib"] == 30.0
    assert row["parallel"] == "ddp over 1 rank (nccl)" and row["steps"] == 3
    assert gpu_run.main(["--name", "gloo", *args, "--parallel", "ddp over 1 rank (gloo)"]) == 1
    recs[2]["rollout/logprob_diff_max"] = 2e-4
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert gpu_run.main(["--name", "diff", *args]) == 1
    assert gpu_run.main(["--name", "report", *args, "--accept", "inf"]) == 0
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    assert gpu_run.main(["--name", "crash", *args, "--", *failing]) == 3


@pytest.mark.slow
def test_dry_run_passes_every_step_on_the_image_python(tmp_path):
    """Both plans on the CPU (DRY_RUN=1) with the packages the image lacks made unimportable
    from site-packages (tests/image_sim/sitecustomize.py): importable only from the wheels
    benchmarks/gpu_wheels.sh downloads (needs the package index), installed by the script
    itself. Every step finishes ok (none skipped: the dry budget is an hour); each plan's
    results.jsonl has its measurements. CI runs it apart from the suite (`pytest -m slow`)."""
    wheels = tmp_path / "whl"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "PYTHON_VERSION": version, "PYTHON": sys.executable}
    fetch = ["bash", str(REPO / "benchmarks" / "gpu_wheels.sh"), str(wheels)]
    got = subprocess.run(fetch, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    image = {**image_env(NOT_ON_IMAGE), "PYTHON_VERSION": version, "PYTHON": sys.executable}
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec(sys.argv[1]) is not None)"
    for name in NOT_ON_IMAGE:  # the simulation hides them
        assert subprocess.run([sys.executable, "-c", probe, name], env=image).returncode == 0
    for plan in ("main", "more"):
        out = tmp_path / plan
        run = subprocess.run(
            ["bash", str(SCRIPT), plan],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=3600,
            env={**image, "DRY_RUN": "1", "OUT": str(out), "WHEELS": str(wheels)},
        )
        recs = Results.read(out / "results.jsonl")
        status = {r["step"]: r["status"] for r in recs if r.get("status") not in (None, "started")}
        want = {s.name for s in gpu_check.PLANS[plan]}
        assert run.returncode == 0 and set(status) == want, (status, run.stdout[-4000:])
        assert set(status.values()) == {"ok"}, status
        assert (out / "gpu_summary.md").exists() and (out / "gpu_results.tar.gz").exists()
    recs = Results.read(tmp_path / "more" / "results.jsonl")
    fsdp = next(r for r in recs if r.get("table") == "grpo_fsdp_dry")
    assert fsdp["parallel"] == "fsdp over 1 rank (gloo)"
    main = Results.read(tmp_path / "main" / "results.jsonl")
    assert any(r.get("mode") == "compiled" and "ms_per_step" in r for r in main)
