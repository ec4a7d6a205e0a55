"""A failing rank on an NCCL job reaches its peers at once, on CPU: the scalar reductions,
agreements and object gathers of CUDA ranks run over a gloo side group (`Dist.cpu_group`)
with CPU tensors, every process group has the job's timeout, and a rank on its way out of an
error leaves the group to its exit instead of destroying it under peers that may still sit in
a collective (grpo/distributed.py, docs/distributed.md#when-a-rank-fails).

NCCL is not needed: the collectives are spied on, a `meta` device stands in for the rank's GPU
(as in tests/test_distributed.py), and the destroy test runs 2 gloo ranks on 127.0.0.1."""

from __future__ import annotations

import ast
import datetime
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as td

from grpo import distributed as D
from tests.test_distributed import launch_ranks

REPO = Path(__file__).resolve().parents[1]
NCCL, GLOO = object(), object()  # a CUDA rank's groups, as the spies see them


def test_cuda_ranks_join_a_gloo_side_group_with_the_job_timeout(monkeypatch):
    """A CUDA job's init makes one gloo group over every rank beside NCCL, with the job's
    timeout; a CPU job's group is gloo already and makes none."""
    made = []
    for var, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(td, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(td, "init_process_group", lambda backend, **kw: None)
    monkeypatch.setattr(td, "new_group", lambda *a, **kw: made.append((a, kw)) or GLOO)
    dist = D.init_distributed("cuda", timeout_s=42)
    assert made == [((), {"backend": "gloo", "timeout": datetime.timedelta(seconds=42)})]
    assert dist.cpu_group is GLOO and dist.group is None  # the model's tensors: NCCL
    made.clear()
    cpu = D.init_distributed("cpu", timeout_s=42)
    assert made == [] and cpu.cpu_group is None


def spy_collectives(monkeypatch) -> list[tuple[str, object, torch.device | None]]:
    """(collective, group, tensor device) of every collective; each returns this rank's own
    values (as if every other rank had passed zeros / the same object)."""
    seen = []

    def all_reduce(t, op=None, group=None):
        seen.append(("all_reduce", group, t.device))

    def all_gather_object(out, obj, group=None):
        seen.append(("all_gather_object", group, None))
        out[:] = [obj] * len(out)

    def all_gather(parts, x, group=None):
        seen.append(("all_gather", group, x.device))

    monkeypatch.setattr(td, "all_reduce", all_reduce)
    monkeypatch.setattr(td, "all_gather_object", all_gather_object)
    monkeypatch.setattr(td, "all_gather", all_gather)
    return seen


def every_scalar_collective(dist: D.Dist) -> None:
    """Each scalar reduction, agreement and object gather once, on `dist`."""
    assert D.all_reduce_sum(2.5, dist) == 2.5
    assert D.all_reduce_max(2.5, dist) == 2.5
    assert D.all_reduce_mean_dict({"a": 3.0}, dist) == {"a": 1.5}
    assert D.all_reduce_sum_dict({"a": 3.0}, dist) == {"a": 3.0}
    assert D.all_reduce_max_dict({"a": 3.0}, dist) == {"a": 3.0}
    D.barrier(dist)
    assert D.gather_objects("x", dist) == ["x", "x"]
    where = D.Where("evaluation / logging", 3)
    with D.rank_local(dist, where):  # nobody failed: one all-reduce
        pass
    with pytest.raises(ValueError, match="boom"):  # this rank failed: all-reduce, then gather
        with D.rank_local(dist, where):
            raise ValueError("boom")


def test_scalars_and_agreements_of_a_cuda_rank_go_over_the_gloo_side_group(monkeypatch):
    """On a CUDA rank (a meta device stands in) the scalar reductions, `barrier`,
    `gather_objects` and `rank_local`'s agreement run over the gloo side group with CPU
    tensors, never over NCCL: a rank that failed makes them fail at once (gloo's closed
    connection) instead of leaving its peers in NCCL until the watchdog. The model's tensors
    (`all_gather_cat`) stay on the device, over NCCL."""
    seen = spy_collectives(monkeypatch)
    cuda = D.Dist(rank=0, world_size=2, device=torch.device("meta"), group=NCCL, cpu_group=GLOO)
    every_scalar_collective(cuda)
    kinds = [kind for kind, _, _ in seen]
    assert kinds == ["all_reduce"] * 6 + [
        "all_gather_object",
        "all_reduce",
        "all_reduce",
        "all_gather_object",
    ], kinds
    for kind, group, device in seen:
        assert group is GLOO, (kind, group)
        assert device in (None, torch.device("cpu")), (kind, device)
    seen.clear()
    D.all_gather_cat(torch.zeros(2, 3, device="meta"), cuda)
    assert seen == [("all_gather", NCCL, torch.device("meta"))]


def test_cpu_ranks_keep_their_one_gloo_group(monkeypatch):
    """A CPU job has no side group: everything runs over its gloo group, as before."""
    seen = spy_collectives(monkeypatch)
    group = object()
    every_scalar_collective(D.Dist(rank=0, world_size=2, group=group))
    assert seen and all(g is group and d in (None, torch.device("cpu")) for _, g, d in seen)


def test_split_roles_gives_every_group_the_timeout_and_nccl_trainers_a_gloo_twin(monkeypatch):
    """rollout.ranks: the trainers' group has the job's timeout like the others (without one,
    torch's default applies: 10 min for NCCL, 30 for gloo, whatever train.dist_timeout_s
    says); on CUDA the trainers get their own gloo side group over the same ranks."""
    made = []

    def new_group(ranks=None, **kw):
        made.append((ranks, kw))
        return ("group", len(made))

    monkeypatch.setattr(td, "new_group", new_group)
    timeout = datetime.timedelta(seconds=7)
    for device, side in ((torch.device("cpu"), None), (torch.device("meta"), GLOO)):
        made.clear()
        dist = D.Dist(rank=1, world_size=4, device=device, joined=True, cpu_group=side)
        roles = D.split_roles(dist, n_producers=2, timeout_s=7)
        assert made and all(kw.get("timeout") == timeout for _, kw in made), made
        trainers = roles.trainers
        assert made[0] == ([0, 1], {"timeout": timeout})
        assert trainers.group == ("group", 1) and trainers.device == device
        if side is None:
            assert trainers.cpu_group is None and len(made) == 4
        else:
            assert made[1] == ([0, 1], {"backend": "gloo", "timeout": timeout})
            assert trainers.cpu_group == ("group", 2) and len(made) == 5


def test_every_process_group_in_grpo_has_a_timeout():
    """Statically, every `new_group(...)` / `init_process_group(...)` call in grpo/ passes
    `timeout=`: a group without one waits torch's default (10 or 30 min), not the job's
    train.dist_timeout_s, before a hung or dead peer fails the job."""
    missing = []
    for path in sorted((REPO / "grpo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name in ("new_group", "init_process_group"):
                if not any(k.arg in ("timeout", None) for k in node.keywords):  # None: **kw
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert missing == []


DESTROY_SCRIPT = """
import sys
import torch.distributed as td
from grpo.distributed import (JobError, RankFailed, Where, exit_if_joined, init_distributed,
                              rank_local, teardown)

destroy = td.destroy_process_group

def spy(*args, **kwargs):
    print("DESTROYED", flush=True)
    destroy(*args, **kwargs)

td.destroy_process_group = spy
case = sys.argv[1]
dist = init_distributed("cpu", timeout_s=300)
try:
    try:
        with rank_local(dist, Where("evaluation / logging", 3)):
            if case == "fails" and dist.rank == 0:
                raise ValueError("eval rows of rank 0 are empty")
        if case == "verdict":  # the same error on every rank, decided once
            raise JobError("run directory is locked", dist.rank)
    finally:
        teardown()
except (ValueError, RankFailed, JobError) as e:
    print(type(e).__name__, flush=True)
    exit_if_joined(3)  # as the CLI: a group left joined is not torn down by the interpreter
    sys.exit(3)
"""


@pytest.mark.process
def test_a_rank_that_fails_leaves_the_group_to_its_exit(tmp_path):
    """Rank 0 raises inside `rank_local`, rank 1 learns of it (RankFailed): neither destroys
    the process group on its way out (on NCCL, destroying under a peer still in a collective
    can block; the peers learn of the exit from gloo), and both still end within seconds with
    a 300 s timeout. A clean end and a verdict every rank reached together do destroy it."""
    (tmp_path / "destroy_job.py").write_text(DESTROY_SCRIPT)
    outs = {}
    for case in ("fails", "clean", "verdict"):
        results = launch_ranks([sys.executable, "destroy_job.py", case], tmp_path, deadline_s=60)
        outs[case] = [(code, out.split()) for code, out, _ in results]
    assert outs == {
        "fails": [(3, ["ValueError"]), (3, ["RankFailed"])],
        "clean": [(0, ["DESTROYED"]), (0, ["DESTROYED"])],
        "verdict": [(3, ["DESTROYED", "JobError"]), (3, ["DESTROYED", "JobError"])],
    }, outs
