"""Modules trained beside the policy (`modules:`): docs/extending.md's value head as a user
writes it, trained by `grpo train` with its own optimizer, its extras read by an estimator; a
run killed with SIGKILL and resumed ends bitwise where an uninterrupted one does (policy and
module); two gloo ranks with half the rows each train it as one process does on all of them;
bad specs are named before anything is written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LENGTH_REWARD, docs_example, tiny_train, tiny_train_here, write_package
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")
MODULE = "modules=[{name: my_pkg.value:ValueHead, kwargs: {dim: 16}, optim: {lr: 0.01}}]"
ESTIMATOR = "loss.advantage=my_pkg.value:value_baseline"

# a copy of the docs' module that kills its own process (SIGKILL) when asked, at a step
KILLER = """
import os, signal
from my_pkg.value import ValueHead

class KilledValueHead(ValueHead):
    def attach(self, batch):
        if str(batch.policy_version) == os.environ.get("KILL_AT_VERSION"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().attach(batch)
"""


# a module with annotated kwargs and nothing to train
FROZEN = """
import torch
from grpo.modules import TrainedModule

class Frozen(TrainedModule):
    def __init__(self, *, scale: float = 1.0, name: str | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((1,), scale), requires_grad=False)
"""


@pytest.fixture()
def my_pkg(tmp_path):
    return write_package(
        tmp_path,
        {
            "value.py": docs_example("# my_pkg/value.py"),
            "frozen.py": FROZEN,
            "killer.py": KILLER,
            "rewards.py": LENGTH_REWARD,
        },
    )


def grpo_train(cwd, model, *args, env=None):
    return tiny_train(cwd, model, *args, env=env)


def metrics(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [r for r in rows if "module/ValueHead/loss" in r]


def test_the_docs_value_head_trains_beside_the_policy(
    my_pkg, shared_tiny_model, monkeypatch, capsys
):
    code = tiny_train_here(
        monkeypatch,
        my_pkg,
        shared_tiny_model,
        "train.output_dir=run",
        "train.max_steps=3",
        "train.save_every=2",
        MODULE,
        ESTIMATOR,
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = metrics(my_pkg / "run" / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert m["module/ValueHead/loss"] >= 0 and m["module/ValueHead/abs_error"] >= 0
        assert m["module/ValueHead/grad_norm"] > 0
    header = json.loads((my_pkg / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert re.search(
        r"ValueHead \(my_pkg\.value\.ValueHead, \d+ parameters\)", header["run/modules"]
    )
    ckpt = my_pkg / "run" / "checkpoints" / "step_000002" / "modules" / "ValueHead"
    assert {p.name for p in ckpt.iterdir()} == {
        "weights.safetensors",
        "optimizer.pt",
        "scheduler.pt",
    }
    saved = load_file(ckpt / "weights.safetensors")
    final = load_file(my_pkg / "run" / "final" / "modules" / "ValueHead" / "weights.safetensors")
    assert set(saved) == set(final) == {"embed.weight", "out.weight", "out.bias"}
    assert any((saved[k] != final[k]).any() for k in saved)  # step 3 moved it


@pytest.mark.process
def test_a_killed_run_resumes_bitwise(my_pkg, shared_tiny_model):
    """SIGKILL at step 3 (after the step-2 checkpoint); `--resume` then ends where the run that
    was never stopped ends: the policy's adapter and the module's weights, bitwise."""
    killer = "modules=[{name: my_pkg.killer:KilledValueHead, label: ValueHead, optim: {lr: 0.01}}]"
    common = ["train.max_steps=4", "train.save_every=2", killer, ESTIMATOR]
    whole = grpo_train(my_pkg, shared_tiny_model, "train.output_dir=whole", *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = grpo_train(
        my_pkg, shared_tiny_model, "train.output_dir=cut", *common, env={"KILL_AT_VERSION": "2"}
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (my_pkg / "cut" / "final").exists()
    resumed = grpo_train(my_pkg, shared_tiny_model, "train.output_dir=cut", *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rel in ("adapter_model.safetensors", "modules/ValueHead/weights.safetensors"):
        a, b = (
            load_file(my_pkg / "whole" / "final" / rel),
            load_file(my_pkg / "cut" / "final" / rel),
        )
        assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a), rel
    want = metrics(my_pkg / "whole" / "metrics.jsonl")
    got = metrics(my_pkg / "cut" / "metrics.jsonl")
    assert [m["module/ValueHead/loss"] for m in got] == [m["module/ValueHead/loss"] for m in want]


WORKER = """
import sys, types
import torch
from safetensors.torch import save_file
from grpo.config import load_config
from grpo.distributed import init_distributed, teardown
from grpo.precision import Precision
from grpo.modules.module_set import ModuleSet

dist = init_distributed("cpu")
cfg = load_config(sys.argv[1], [f"model.path={sys.argv[2]}", sys.argv[3]])
config = types.SimpleNamespace(vocab_size=64)
policy = types.SimpleNamespace(model=types.SimpleNamespace(config=config), tokenizer=None,
                               precision=Precision.from_config(cfg.model))
modules = ModuleSet(cfg, policy, dist, torch.device("cpu"), total_steps=3)
g = torch.Generator().manual_seed(0)
B, T = 8, 6
per = B // dist.world_size
lo = dist.rank * per
for step in range(3):  # the same global batches; each rank takes its rows
    ids = torch.randint(1, 64, (B, T), generator=g)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    rewards = torch.rand(B, generator=g)
    rollout = types.SimpleNamespace(prompt_ids=ids[lo:lo + per], prompt_width=T,
                                    prompt_lens=lens[lo:lo + per])
    batch = types.SimpleNamespace(rollout=rollout, rewards=rewards[lo:lo + per], size=per)
    modules.step(batch, None, step + 1)
if dist.rank == 0:
    state = modules.items[0].module.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[4])
teardown()
"""


@pytest.mark.process
def test_two_ranks_train_a_module_as_one_process(my_pkg, shared_tiny_model):
    (my_pkg / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(my_pkg)}
    args = [TINY, str(shared_tiny_model), MODULE]
    one = subprocess.run(
        [sys.executable, "worker.py", *args, "one.safetensors"],
        cwd=my_pkg,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "worker.py",
            *args,
            "two.safetensors",
        ],
        cwd=my_pkg,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load_file(my_pkg / "one.safetensors"), load_file(my_pkg / "two.safetensors")
    for k in a:  # the mean of two half-batch means is the whole batch's mean (float32 sums)
        assert (a[k] - b[k]).abs().max() <= 1e-6, k
    # and training moved the weights (the check is not of two untouched inits)
    init = subprocess.run(
        [
            sys.executable,
            "worker.py",
            TINY,
            str(shared_tiny_model),
            MODULE.replace("lr: 0.01", "lr: 1.0e-12"),
            "init.safetensors",
        ],
        cwd=my_pkg,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert init.returncode == 0, init.stderr[-3000:]
    c = load_file(my_pkg / "init.safetensors")
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-3


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "modules=[{name: my_pkg.value:Nope}]",
            "modules[0].name: 'my_pkg.value:Nope': module 'my_pkg.value' has no attribute 'Nope'",
        ),
        (
            "modules=[{name: my_pkg.value:ValueHead, kwargs: {dims: 3}}]",
            "modules[0].kwargs: 'dims' is not a parameter of trained module",
        ),
        (
            "modules=[{name: my_pkg.value:ValueHead, optim: {lrr: 1}}]",
            "modules[].optim.lrr: unknown key",
        ),
        # a value of another type than the factory's annotation: at the config check
        (
            "modules=[{name: my_pkg.frozen:Frozen, kwargs: {scale: big, name: null}}]",
            "modules[0].kwargs.scale: expected float, got str 'big'",
        ),
        (
            "modules=[{name: my_pkg.frozen:Frozen, kwargs: {name: [1]}}]",
            "modules[0].kwargs.name: expected str or null, got list [1]",
        ),
        # nothing to train: known once it is built, still before anything is written
        (
            "modules=[{name: my_pkg.frozen:Frozen, kwargs: {scale: 2}}]",
            "modules[0]: 'Frozen' (Frozen, from 'my_pkg.frozen:Frozen') has no trainable "
            "parameters",
        ),
    ],
)
def test_bad_module_specs_are_named_before_anything_is_written(
    my_pkg, shared_tiny_model, monkeypatch, capsys, spec, message
):
    code = tiny_train_here(
        monkeypatch, my_pkg, shared_tiny_model, "train.output_dir=run", "train.max_steps=1", spec
    )
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert message in err, err[-2000:]
    assert not (my_pkg / "run").exists()


@pytest.mark.process
def test_grpo_train_with_a_module_under_torchrun(my_pkg, shared_tiny_model):
    """2 ranks, the policy sharded by FSDP2 (DDP's runs are the other torchrun tests'), the
    module replicated: it trains, its extras reach the estimator, its checkpoint resumes."""
    parallel = "fsdp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(my_pkg)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "grpo",
        "train",
        "--config",
        TINY,
        f"model.path={shared_tiny_model}",
        "train.progress=false",
        "data.eval_samples=0",
        "rollout.compile=off",
        "train.log_every=1",
        "rollout.max_new_tokens=8",
        "train.save_every=1",
        "rewards=[{name: my_pkg.rewards:length}]",
        f"train.parallel={parallel}",
        "train.output_dir=run",
        MODULE,
        ESTIMATOR,
    ]
    r = subprocess.run(
        [*cmd, "train.max_steps=1"],
        cwd=my_pkg,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [*cmd, "train.max_steps=2", "--resume"],
        cwd=my_pkg,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(my_pkg / "run" / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2]
    assert all(m["module/ValueHead/loss"] >= 0 for m in rows)
    assert (my_pkg / "run" / "final" / "modules" / "ValueHead" / "weights.safetensors").is_file()
