"""DDP and FSDP2 over gloo (CPU): 2 ranks (the session's rank pool) equal 1 process on the
combined batch, the CLI runs end to end under torchrun, and a failing rank fails the job
instead of hanging it."""

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


def test_two_ranks_equal_one_process(tiny_checkpoints, tmp_path, rank_pool):
    """DDP and FSDP2 (every weight sharded over the 2 ranks) each equal one process on the
    combined batch: GRPO (LoRA, full fine-tuning, shared prefix, multi-turn) and SFT (LoRA,
    full), micro-batches accumulated, gradients clipped."""
    ckpt = str(tiny_checkpoints("qwen3"))
    worker = str(REPO / "tests" / "ddp_worker.py")
    (tmp_path / "single").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "single.err", "w+") as err:  # the reference, beside the two ranks
        single = subprocess.Popen(
            [sys.executable, worker, ckpt, str(tmp_path / "single")],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:  # the session's ranks (tests/rank_pool.py): ddp, then fsdp
            rank_pool.run("ddp_worker:run_modes", ckpt, str(tmp_path), "ddp,fsdp")
            single.wait(timeout=300)
        finally:
            single.kill()  # a no-op once it exited
        err.seek(0)
        assert single.returncode == 0, err.read()[-3000:]
    cases = sorted(p.name for p in (tmp_path / "single").iterdir() if p.suffix != ".json")
    assert cases == [
        "grpo_balanced.safetensors",
        "grpo_full.safetensors",
        "grpo_multiturn.safetensors",
        "grpo_packed_shared.safetensors",
        "grpo_packed_tokens.safetensors",
        "grpo_seq_mean_token_mean.safetensors",
        "grpo_seq_mean_token_sum_norm.safetensors",
        "grpo_shared_prefix.safetensors",
        "grpo_token_mean.safetensors",
        "ppo_critic.safetensors",
        "ppo_policy.safetensors",
        "sft.safetensors",
        "sft_full.safetensors",
    ]
    start = load_file(tiny_checkpoints("qwen3") / "model.safetensors")
    for name in cases:
        b = load_file(tmp_path / "single" / name)
        if name.endswith("full.safetensors"):  # the update moved the weights
            moved = [
                (b[k] - start[f"model.{k}"]).abs().max().item() for k in b if f"model.{k}" in start
            ]
            assert moved and max(moved) > 1e-5, name  # ten times the bound below
        for mode in ("ddp", "fsdp"):
            a = load_file(tmp_path / mode / name)
            assert a.keys() == b.keys(), (mode, name)
            diff = max((a[k] - b[k]).abs().max().item() for k in a)
            assert diff <= 1e-6, (mode, name, diff)
    # PPO: the critic trained (its head moved, the second update clipped some values) and
    # the estimator's and critic's metrics (of the global batch) equal one process's
    critic = load_file(tmp_path / "single" / "ppo_critic.safetensors")
    assert float(critic["model.score.weight"].abs().max()) > 0
    assert all("lora_" in k or k == "model.score.weight" for k in critic), sorted(critic)[:4]
    want = json.loads((tmp_path / "single" / "ppo_metrics.json").read_text())
    assert want["module/critic/clip_frac"] > 0 and "advantage/return_mean" in want, want
    for mode in ("ddp", "fsdp"):
        got = json.loads((tmp_path / mode / "ppo_metrics.json").read_text())
        assert got.keys() == want.keys(), mode
        for k in want:
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (mode, k, got, want)
    for mode in ("ddp", "fsdp"):  # packed by tokens: unequal needs, equal micro-batch counts
        counts = [
            json.loads((tmp_path / mode / f"grpo_packed_tokens_counts_{r}.json").read_text())
            for r in (0, 1)
        ]
        assert counts[0]["needed"] != counts[1]["needed"], counts
        assert counts[0]["used"] == counts[1]["used"] == max(c["needed"] for c in counts)
        moved = json.loads((tmp_path / mode / "balance_0.json").read_text())  # same on rank 1
        assert moved == json.loads((tmp_path / mode / "balance_1.json").read_text())
        before = moved["perf/rank_tokens_max_ratio_before"]
        after = moved["perf/rank_tokens_max_ratio"]
        assert 1 <= after < before, moved  # the ranks sampled unequal tokens; now more even


P = pytest.mark.process  # the variants of `grpo train` under torchrun (the default tier: train)


@pytest.mark.parametrize(
    "command, precision",
    [
        ("train", []),
        pytest.param("sft", [], marks=P),
        pytest.param(
            "train", ["model.autocast_bf16=true", "train.shared_prefix=on"], marks=P
        ),  # the tutorial's
        pytest.param("sft", ["model.dtype=bfloat16"], marks=P),  # bf16 base, float32 adapters
        pytest.param(
            "train",
            [
                "train.parallel=fsdp",
                "model.autocast_bf16=true",
                "model.gradient_checkpointing=true",
            ],
            marks=P,
        ),
        pytest.param(
            "sft",
            ["train.parallel=fsdp", "model.dtype=bfloat16", "train.fsdp_offload=true"],
            marks=P,
        ),
    ],
    ids=[
        "train",
        "sft",
        "train-bf16-autocast",
        "sft-bf16-weights",
        "train-fsdp-bf16-autocast",
        "sft-fsdp-bf16-weights-offload",
    ],
)
def test_torchrun_cli_end_to_end(shared_tiny_model, tmp_path, command, precision):
    cfg = str(REPO / "configs" / "tiny_ci.yaml")
    r = run(
        [
            *TORCHRUN,
            "-m",
            "grpo",
            command,
            "--config",
            cfg,
            f"model.path={shared_tiny_model}",
            "train.output_dir=out",
            "train.progress=false",
            "train.max_steps=2",
            *precision,
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]  # one set of metrics, not one per rank
    if command == "train":  # sampler vs trainer within the bf16 budget (docs/precision.md)
        assert max(row["rollout/logprob_diff_max"] for row in rows) <= 1e-2
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


class _Recorded(Exception):
    """Raised by the fake collectives once they have seen the tensor (a meta tensor has no
    data to reduce)."""


def test_every_collective_puts_its_tensor_on_the_rank_device(monkeypatch):
    """NCCL moves only CUDA tensors: every helper must build its tensor on Dist.device, never
    on the CPU by default. A meta device stands in for the rank's GPU: a helper that built its
    tensor anywhere else (the old `device="cpu"` default) fails here, on a CPU-only machine."""
    import torch
    import torch.distributed as td

    from grpo import distributed as D

    seen = []

    def fake(t, *args, **kwargs):
        tensors = t if isinstance(t, list) else [t]
        seen.extend(x.device for x in tensors)
        raise _Recorded

    monkeypatch.setattr(td, "all_reduce", fake)
    monkeypatch.setattr(td, "all_gather", lambda parts, x, **kw: fake([x, *parts]))
    rank = D.Dist(rank=0, world_size=2, local_rank=0, device=torch.device("meta"))
    calls = [
        lambda: D.all_reduce_sum(1.0, rank),
        lambda: D.all_reduce_max(1.0, rank),
        lambda: D.all_reduce_mean_dict({"a": 1.0}, rank),
        lambda: D.all_reduce_sum_dict({"a": 1.0}, rank),
        lambda: D.all_reduce_max_dict({"a": 1.0}, rank),
        lambda: D.barrier(rank),
        lambda: D.all_gather_cat(torch.zeros(2, 3, device="meta"), rank),
    ]
    for call in calls:
        with pytest.raises(_Recorded):
            call()
    assert len(seen) >= len(calls) and all(d.type == "meta" for d in seen), seen
    with pytest.raises(ValueError, match="tensor on cpu, the rank's device is meta"):
        D.all_gather_cat(torch.zeros(2), rank)  # a caller's tensor on the wrong device


def test_cuda_ranks_join_nccl_bound_to_their_local_device(monkeypatch):
    import torch
    import torch.distributed as td

    from grpo import distributed as D

    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(td, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(
        td, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw)
    )
    monkeypatch.setattr(td, "new_group", lambda **kw: "gloo side group")
    dist = D.init_distributed("cuda", timeout_s=42)
    assert (dist.rank, dist.world_size, dist.local_rank) == (3, 4, 1)
    assert dist.device == torch.device("cuda", 1) == calls["set_device"] == calls["device_id"]
    assert calls["backend"] == "nccl" and calls["timeout"].total_seconds() == 42
    assert D.device_for(dist, torch.device("cuda")) == torch.device("cuda", 1)
    calls.clear()
    cpu = D.init_distributed("cpu", timeout_s=5)
    assert calls["backend"] == "gloo" and "device_id" not in calls
    assert cpu.device == torch.device("cpu")


def test_cuda_devices_follow_the_visible_count_and_producers_get_theirs(monkeypatch):
    """A scheduler that shows each process one GPU (CUDA_VISIBLE_DEVICES per process): every
    local rank computes on cuda:0, not cuda:LOCAL_RANK (which does not exist there). Two
    producer ranks (rollout.ranks=2) compute on their local rank's GPU, though their lockstep
    group's collectives run on the CPU (gloo)."""
    import torch

    from grpo import distributed as D

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert D.cuda_device(3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert D.cuda_device(3) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # 8 ranks a node on 4 GPUs
    assert D.cuda_device(6) == torch.device("cuda", 2)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for local_rank in (6, 7):  # producers of a 6 + 2 job: their lockstep group lives on the CPU
        lockstep = D.Dist(local_rank - 6, 2, local_rank, torch.device("cpu"), object())
        assert D.device_for(lockstep, cuda) == torch.device("cuda", local_rank)


def test_fsdp_offload_on_cuda_joins_gloo_beside_nccl(monkeypatch, shared_tiny_model, tmp_path):
    """train.fsdp_offload keeps shards, gradients and their norm in CPU memory: the job's group
    must move CPU tensors too (`cpu:gloo,cuda:nccl`; NCCL alone fails the grad-norm
    all-reduce), and the policy computes on the rank's GPU though its model reports the CPU."""
    import torch
    import torch.distributed as td

    from grpo import distributed as D
    from grpo.config import load_config
    from grpo.policy import build_policy
    from grpo.run import loop

    seen = {}
    for var, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(td, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(td, "init_process_group", lambda backend, **kw: seen.update(b=backend))
    monkeypatch.setattr(td, "new_group", lambda **kw: None)  # the gloo side group
    monkeypatch.setattr(loop, "resolve_device", lambda name: torch.device("cuda"))

    class Joined(Exception):
        pass

    def joined(*a, **kw):
        seen["dist"] = D.init_distributed(*a, **kw)
        raise Joined

    monkeypatch.setattr(loop, "init_distributed", joined)
    base = [
        f"model.path={shared_tiny_model}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.parallel=fsdp",
    ]
    for offload, backend in ((True, "cpu:gloo,cuda:nccl"), (False, "nccl")):
        cfg = load_config(
            REPO / "configs" / "tiny_ci.yaml", [*base, f"train.fsdp_offload={offload}"]
        )
        with pytest.raises(Joined):
            loop.run_training(cfg, "train", False, False, None, None)
        assert seen["b"] == backend and seen["dist"].device == torch.device("cuda", 0)
    cfg = load_config(REPO / "configs" / "tiny_ci.yaml", base)
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    policy.compute_device = torch.device("cuda", 0)  # FSDP offload: the model reports the CPU
    assert policy.model.device == torch.device("cpu") and policy.device == torch.device("cuda", 0)


# A rank whose reward raises, returns NaN, exits or hangs: tests/test_rank_failures.py


# ------------------------------------------------- a failure in rank-local work (rank_local)


def launch_ranks(cmd, cwd: Path, deadline_s: float, env=None, world: int = 2):
    """`cmd` once per rank as plain processes joined through MASTER_ADDR / MASTER_PORT. No
    torchrun: nobody stops a rank's peers when it dies (as under srun or mpirun), so a rank left
    waiting for a peer waits for the whole process-group timeout. Returns [(exit code, stdout,
    stderr)] per rank, or fails naming the ranks still running at the deadline."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, files = [], []
    for rank in range(world):
        out, err = open(cwd / f"rank{rank}.out", "w+"), open(cwd / f"rank{rank}.err", "w+")
        files.append((out, err))
        rank_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=rank_env, stdout=out, stderr=err))
    end = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.wait(timeout=max(end - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    running = [rank for rank, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    results = []
    for p, (out, err) in zip(procs, files):
        out.seek(0), err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close(), err.close()
    assert not running, f"ranks {running} still running after {deadline_s} s: {results}"
    return results


RANK_LOCAL_SCRIPT = """
from grpo.distributed import RankFailed, Where, init_distributed, rank_local, teardown

dist = init_distributed("cpu", timeout_s=300)
where = Where("evaluation / logging", 3)
with rank_local(dist, where):  # nobody fails: nothing raised
    pass
for failing in ([0], [0, 1]):
    try:
        with rank_local(dist, where):
            if dist.rank in failing:
                raise ValueError(f"eval rows of rank {dist.rank} are empty\\nsecond line")
        print("NONE")
    except ValueError as e:
        print("OWN", str(e).splitlines()[0])
    except RankFailed as e:
        print("PEER", e, e.failed_ranks)
teardown()
"""


def test_rank_local_failure_reaches_the_other_ranks_at_once(tmp_path):
    """Rank 0 raises inside a rank-local section, with a 300 s process-group timeout: it
    re-raises its own error, and rank 1 learns of it in the section's all-reduce and raises
    RankFailed naming rank 0, the phase, the step and the error, within seconds. When both
    fail, each keeps its own error."""
    (tmp_path / "rank_local_job.py").write_text(RANK_LOCAL_SCRIPT)
    results = launch_ranks([sys.executable, "rank_local_job.py"], tmp_path, deadline_s=60)
    assert [code for code, _, _ in results] == [0, 0], results
    assert results[0][1].splitlines() == [
        "OWN eval rows of rank 0 are empty",
        "OWN eval rows of rank 0 are empty",
    ]
    assert results[1][1].splitlines() == [
        "PEER rank 1: stopped: rank 0 failed (evaluation / logging, step 3): ValueError: eval "
        "rows of rank 0 are empty (0,)",
        "OWN eval rows of rank 1 are empty",
    ]


ON_STEP_SCRIPT = """
import sys
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.train.grpo import train_grpo

def on_step(step, metrics):  # runs on the main rank only
    raise ValueError(f"on_step refused step {step}")

try:
    train_grpo(load_config(sys.argv[1], sys.argv[2:]), on_step=on_step)
except (GrpoError, ValueError) as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(3)
"""


@pytest.mark.process
def test_on_step_failing_on_rank_0_stops_every_rank_within_seconds(shared_tiny_model, tmp_path):
    """The on_step callback (main rank only) raises after step 1, with train.dist_timeout_s=300:
    rank 1 must not sit in the step's next collective for 300 s but stop at once with one line
    naming rank 0, the phase, the step and the cause; rank 0 keeps its own error."""
    (tmp_path / "on_step_job.py").write_text(ON_STEP_SCRIPT)
    cmd = [
        sys.executable,
        "on_step_job.py",
        str(REPO / "configs" / "tiny_ci.yaml"),
        f"model.path={shared_tiny_model}",
        "train.output_dir=out",
        "train.progress=false",
        "train.dist_timeout_s=300",
        "data.eval_samples=0",
    ]
    (code0, out0, err0), (code1, out1, err1) = launch_ranks(cmd, tmp_path, deadline_s=90)
    last0 = out0.splitlines()[-1] if out0 else ""  # after rank 0's metrics line of step 1
    assert (code0, last0) == (3, "ValueError: on_step refused step 1"), err0[-3000:]
    assert (code1, out1) == (
        3,
        "RankFailed: rank 1: stopped: rank 0 failed (evaluation / "
        "logging, step 1): ValueError: on_step refused step 1\n",
    ), err1[-3000:]


@pytest.mark.process
def test_bad_eval_split_on_rank_0_fails_every_rank_with_one_line(shared_tiny_model, tmp_path):
    """Rank 0 alone loads the evaluation rows; a bad eval split fails it at start-up. Through
    the CLI, with train.dist_timeout_s=300, both ranks exit 2 within seconds, each with one
    error line: rank 0 the cause, rank 1 that rank 0 failed and why."""
    cmd = [
        sys.executable,
        "-m",
        "grpo",
        "train",
        "--config",
        str(REPO / "configs" / "tiny_ci.yaml"),
        f"model.path={shared_tiny_model}",
        "train.output_dir=out",
        "train.progress=false",
        "train.dist_timeout_s=300",
        "data.eval_split=nope",
    ]
    results = launch_ranks(cmd, tmp_path, deadline_s=60)
    cause = "dataset 'minimath' has splits train and test, not 'nope'"
    errors = [[x for x in err.splitlines() if "error:" in x] for _, _, err in results]
    assert [code for code, _, _ in results] == [2, 2], results
    assert errors == [
        [f"grpo train: error: rank 0 (start-up): {cause}"],
        [f"grpo train: error: rank 1: stopped: rank 0 failed (start-up): {cause}"],
    ]


def test_fsdp_settings_that_cannot_work_are_one_line(tmp_path):
    from grpo.config import load_config
    from grpo.settings import ConfigError

    base = {"model": {"path": str(tmp_path)}}
    with pytest.raises(ConfigError, match=r"^train.fsdp_offload: needs train.parallel: fsdp"):
        load_config(base=base, overrides=["train.fsdp_offload=true"])
    cfg = load_config(base=base, overrides=["train.parallel=fsdp", "rollout.compile=on"])
    with pytest.raises(ConfigError, match=r"^rollout.compile: 'on' cannot run under train.par"):
        cfg.check_grpo()
    load_config(base=base, overrides=["train.parallel=fsdp", "rollout.compile=auto"]).check_grpo()
    cfg_file = str(REPO / "configs" / "tiny_ci.yaml")
    r = run(
        [
            sys.executable,
            "-m",
            "grpo",
            "train",
            "--config",
            cfg_file,
            "train.parallel=fsdp",
            "rollout.compile=on",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "rollout.compile: 'on' cannot run" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.process
def test_torchrun_with_one_rank_joins_a_process_group(shared_tiny_model, tmp_path):
    """`torchrun --nproc_per_node=1` joins a process group (gloo here; NCCL on one GPU, the
    GPU check's case) and trains through DDP or FSDP as a larger job does, which the run's
    header records; DDP over one rank is the plain single-process run bitwise, FSDP over one
    rank the same numbers within float32 rounding, written as a sharded checkpoint."""
    from grpo.metrics import read_metrics

    config = str(REPO / "configs" / "quickstart.yaml")
    args = ["--config", config, f"model.path={shared_tiny_model}", "train.max_steps=2"]
    one = [*TORCHRUN[:-1], "--nproc_per_node=1", "-m", "grpo", "train", *args]
    runs = {
        "plain": [sys.executable, "-m", "grpo", "train", *args],
        "ddp": [*one, "train.parallel=ddp"],
        "fsdp": [*one, "train.parallel=fsdp"],
    }
    for name, cmd in runs.items():
        r = run([*cmd, f"train.output_dir={name}"], tmp_path)
        assert r.returncode == 0, (name, r.stderr[-3000:])
    metrics = {name: read_metrics(tmp_path / name / "metrics.jsonl") for name in runs}
    parallel = {name: m[0]["run/parallel"] for name, m in metrics.items()}
    assert parallel == {
        "plain": "single process",
        "ddp": "ddp over 1 rank (gloo)",
        "fsdp": "fsdp over 1 rank (gloo)",
    }
    weights = {n: load_file(tmp_path / n / "final" / "model.safetensors") for n in runs}
    for k, w in weights["plain"].items():
        assert w.equal(weights["ddp"][k]), k
        assert (w - weights["fsdp"][k]).abs().max() <= 1e-5, k
    for a, b in zip(metrics["plain"], metrics["ddp"]):
        assert (
            a["train/loss"] == b["train/loss"]
            and a["rollout/reward_mean"] == b["rollout/reward_mean"]
        )
    assert not list((tmp_path / "ddp" / "checkpoints").rglob("shards"))
    assert list((tmp_path / "fsdp" / "checkpoints").rglob("shards"))
