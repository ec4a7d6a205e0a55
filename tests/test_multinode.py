"""Two nodes train as one: two torchrun agents on this machine (one rank each, joined by a
rendezvous on 127.0.0.1, as two machines would be, docs/distributed.md) write the same final
weights as one agent running both ranks (`--standalone --nproc_per_node=2`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.process  # a variant of 2 ranks = 1 process (ARCHITECTURE.md, Test tiers)

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from grpo.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("multinode") / "m", size="ci")


def train_args(model: Path, out: Path, parallel: str) -> list[str]:
    """The quickstart for 2 steps, full fine-tuning; `out` is shared by every node."""
    return [
        "-m",
        "grpo",
        "train",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        f"model.path={model}",
        "train.max_steps=2",
        "train.batch_size=16",
        "rollout.max_new_tokens=8",
        "train.progress=false",
        "data.eval_samples=0",
        f"train.output_dir={out}",
        f"train.parallel={parallel}",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agents(cmds: list[list[str]], cwd: Path) -> None:
    """Start every torchrun agent at once (a rendezvous waits for all of them), wait for all
    within TIMEOUT_S; fail with each agent's exit code and stderr tail otherwise."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(cwd / f"agent{k}.err", "w+") for k in range(len(cmds))]
    procs = [
        subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        for c, log in zip(cmds, logs)
    ]
    end = time.monotonic() + TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    tails = []
    for k, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        tails.append(f"agent {k}: exit {p.returncode}\n{log.read()[-2000:]}")
        log.close()
    assert all(p.returncode == 0 for p in procs), "\n".join(tails)


# fsdp only: the rendezvous is the same for ddp, and each case costs ~16 s of the suite
@pytest.mark.parametrize("parallel", ["fsdp"])
def test_two_nodes_equal_one_node(tiny_model, tmp_path, parallel):
    """--nnodes=2 --node_rank=0/1 (static rendezvous at --master_addr:--master_port), one rank
    per node, into one shared train.output_dir, against --standalone --nproc_per_node=2: the
    same ranks on the same batch, so the same final weights (bitwise, and to 1e-6 whatever
    the transport)."""
    port = free_port()
    nodes = [
        [
            *TORCHRUN,
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={k}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            *train_args(tiny_model, tmp_path / "nodes", parallel),
        ]
        for k in (0, 1)
    ]
    run_agents(nodes, tmp_path)
    one = [
        *TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        *train_args(tiny_model, tmp_path / "one", parallel),
    ]
    run_agents([one], tmp_path)

    a = load_file(tmp_path / "nodes" / "final" / "model.safetensors")
    b = load_file(tmp_path / "one" / "final" / "model.safetensors")
    start = load_file(tiny_model / "model.safetensors")
    assert a.keys() == b.keys() == start.keys()
    moved = max((b[k] - start[k]).abs().max().item() for k in b)
    assert moved > 1e-4  # two steps of full fine-tuning changed the weights
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 1e-6, diff
    assert all(a[k].equal(b[k]) for k in a)  # same ranks, same reductions: bitwise
    step_dirs = sorted(p.name for p in (tmp_path / "nodes" / "checkpoints").glob("step_*"))
    assert step_dirs == ["step_000002"]  # written once, by rank 0 (node 0)
