"""benchmarks/gpu_check.sh, the one command a CUDA machine runs first: its step limits fit the
budget, it installs nothing from an index, its jobs rendezvous on this host only, its run
summaries judge what they claim, and (slow, CI) its CPU dry run passes every step on a Python
that lacks what the offline CUDA image lacks, given the wheels benchmarks/gpu_wheels.sh
downloads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_run

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
BUDGET_S = 540  # of the 600 s one command may run: start-up, packing and slack
# What such an image lacks (its package list); dill and multiprocess come with datasets.
NOT_ON_IMAGE = ("datasets", "dill", "multiprocess", "fastapi", "uvicorn", "starlette", "openai",
                "optuna", "trl", "liger_kernel")  # fmt: skip


def commands(text: str) -> list[str]:
    """The script's lines with continuations joined, comments and heredoc bodies dropped."""
    text = re.sub(r"<<'EOF'\n.*?\nEOF\n", "\n", text, flags=re.S)
    text = text.replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]


def test_step_limits_fit_the_budget_and_nothing_comes_from_an_index():
    lines = commands(SCRIPT.read_text())
    steps = [line.split()[1:3] for line in lines if re.match(r"step \d+ ", line)]
    names = [name for _, name in steps]
    assert len(names) == len(set(names)), names  # each step runs once, in both modes
    total = sum(int(limit) for limit, _ in steps)
    assert total <= BUDGET_S, f"step limits sum to {total} s > {BUDGET_S} s: {steps}"
    assert {"grpo-ddp", "grpo-fsdp", "tutorial-grpo"} <= set(names)
    pips = [line for line in lines if "pip install" in line]
    assert pips and all("--no-index" in line for line in pips), pips
    runs = [line for line in lines if "torch.distributed.run" in line or "torchrun" in line]
    assert runs and all("--standalone" in line for line in runs), runs  # 127.0.0.1 only


def test_one_rank_steps_demand_the_backend_and_parallel_mode():
    text = " ".join(commands(SCRIPT.read_text()))
    for mode in ("ddp", "fsdp"):
        step = re.search(rf"step \d+ grpo-{mode} (.*?)(?= step \d+ |$)", text).group(1)
        assert f'--parallel "{mode} over 1 rank ($BACKEND)"' in step
        assert '"${TORCHRUN[@]}"' in step and f"train.parallel={mode}" in step
    assert 'TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1)' in text
    assert 'BACKEND=$([[ "$DRY_RUN" == 1 ]] && echo gloo || echo nccl)' in text


def image_env(hidden) -> dict:
    """This environment as a Python without the `hidden` packages (tests/image_sim)."""
    return {**os.environ, "GRPO_HIDE_PACKAGES": ",".join(hidden),
            "PYTHONPATH": str(REPO / "tests" / "image_sim")}  # fmt: skip


def test_training_needs_no_serving_or_search_package(tmp_path):
    """fastapi, uvicorn, openai and optuna are imported where serving or a search needs
    them, never by the training path: with them hidden, the CLI and the trainers import and
    the tiny model is made (the GPU check's first steps on an image without them)."""
    env = image_env(("fastapi", "uvicorn", "starlette", "openai", "optuna"))
    probe = "import importlib.util as u; assert u.find_spec('fastapi') is None; import fastapi"
    hidden = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert "No module named 'fastapi'" in hidden.stderr, hidden.stderr  # the simulation holds
    code = ("import grpo.apps.cli, grpo.train.grpo, grpo.train.sft, grpo.eval, grpo.apps.pipeline"
            ", grpo.apps.demo, kernels, benchmarks.bench_step, benchmarks.gpu_run")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "grpo", "tiny-model", "--out", str(tmp_path / "m")],
                       env=env, capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]


def record(step, **kw):
    base = {
        "step": step, "perf/step_s": 1.0 + step, "perf/rollout_s": 0.5, "perf/logprob_s": 0.2,
        "perf/update_s": 0.3, "perf/tokens_per_s": 100.0, "perf/peak_mem_mib": 10.0 * step,
        "rollout/logprob_diff_max": 1e-6, "rollout/logprob_diff_mean": 1e-7,
        "rollout/first_pass_ratio_mean": 1.0, "rollout/reward_mean": 0.1 * step,
    }  # fmt: skip
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
    """The whole check on the CPU (DRY_RUN=1) with the packages the image lacks made
    unimportable from site-packages (tests/image_sim/sitecustomize.py): importable only from
    the wheels benchmarks/gpu_wheels.sh downloads (needs the package index), installed by the
    script's own install-wheels step. About 4-5 minutes on 2 cores: CI runs it apart from the
    suite (`pytest -m slow`)."""
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
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=3600,
        env={**image, "DRY_RUN": "1", "OUT": str(out), "WHEELS": str(wheels),
             "RES": str(tmp_path / "res")},
    )  # fmt: skip
    summary = (out / "gpu_summary.md").read_text()
    assert run.returncode == 0, summary + run.stdout[-4000:]
    steps_table = summary.split("| step | limit_s |", 1)[1].split("\n\n", 1)[0]
    rows = [r for r in steps_table.splitlines()[2:] if r.startswith("| ")]  # past the header
    exits = {r.split("|")[1].strip(): r.split("|")[4].strip() for r in rows}
    names = {"install-wheels", "env", "pytest-cuda", "grpo-ddp", "grpo-fsdp", "tutorial-grpo"}
    assert names <= set(exits) and set(exits.values()) == {"0"}, exits
    grpo = json.loads((tmp_path / "res" / "grpo_fsdp_dry.json").read_text())["rows"][0]
    assert grpo["parallel"] == "fsdp over 1 rank (gloo)"
