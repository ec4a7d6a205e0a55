"""DDP under torchrun (gloo, CPU): 2 processes equal 1 process on the combined batch, the CLI
runs end to end under torchrun, and a failing rank fails the job instead of hanging it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run(cmd, cwd, timeout=300, env=None):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def test_two_ranks_equal_one_process(tiny_checkpoints, tmp_path):
    ckpt = str(tiny_checkpoints("qwen3"))
    worker = str(REPO / "tests" / "ddp_worker.py")
    (tmp_path / "ddp").mkdir()
    (tmp_path / "single").mkdir()
    r = run([*TORCHRUN, worker, ckpt, str(tmp_path / "ddp")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run([sys.executable, worker, ckpt, str(tmp_path / "single")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = sorted(p.name for p in (tmp_path / "single").iterdir())
    assert cases == [
        "grpo_multiturn.safetensors",
        "grpo_seq_mean_token_mean.safetensors",
        "grpo_seq_mean_token_sum_norm.safetensors",
        "grpo_shared_prefix.safetensors",
        "grpo_token_mean.safetensors",
        "sft.safetensors",
    ]
    for name in cases:
        a, b = load_file(tmp_path / "ddp" / name), load_file(tmp_path / "single" / name)
        assert a.keys() == b.keys()
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        assert diff <= 1e-6, (name, diff)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp_model")
    r = run([sys.executable, "-m", "grpo", "tiny-model", "--out", str(d / "m")], cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "m"


@pytest.mark.parametrize("command", ["train", "sft"])
def test_torchrun_cli_end_to_end(tiny_model_dir, tmp_path, command):
    cfg = str(REPO / "configs" / "tiny_ci.yaml")
    r = run(
        [*TORCHRUN, "-m", "grpo", command, "--config", cfg, f"model.path={tiny_model_dir}",
         "train.output_dir=out", "train.progress=false", "train.max_steps=2"],
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]  # one set of metrics, not one per rank
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


def test_failing_rank_fails_the_job(tiny_model_dir, tmp_path):
    (tmp_path / "rank_reward.py").write_text(
        "import os\n"
        "def reward(completions, **columns):\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        raise ValueError('boom on rank 1')\n"
        "    return [0.0] * len(completions)\n"
    )
    cfg = str(REPO / "configs" / "tiny_ci.yaml")
    r = run(
        [*TORCHRUN, "-m", "grpo", "train", "--config", cfg, f"model.path={tiny_model_dir}",
         "train.output_dir=out", "train.progress=false",
         "rewards=[{name: 'rank_reward:reward'}]"],
        cwd=tmp_path,
        timeout=240,
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert r.returncode != 0
    assert "boom on rank 1" in r.stderr
