"""A job on a cluster (docs/distributed.md, "On a cluster"): `--resume auto`, the checks of
what goes wrong only over several nodes (`grpo.run.cluster`), the Slurm script and the
Kubernetes manifest of configs/cluster/ as written, with stand-in `srun` / `scontrol`
(tests/slurm_standin/) and torchrun agents on 127.0.0.1 in place of nodes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from grpo.apps import cli
from grpo.config import load_config, save_config
from grpo.errors import GrpoError
from grpo.run.cluster import check_job, first_difference, hash_sources, source_hash
from grpo.run.rundir import auto_start, check_run_dir
from grpo.run.state import checkpoint_weights

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
SBATCH = REPO / "configs" / "cluster" / "grpo.sbatch"
MANIFEST = REPO / "configs" / "cluster" / "pytorchjob.yaml"
STANDIN = REPO / "tests" / "slurm_standin"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FAST = ["train.progress=false", "data.eval_samples=0", "train.save_every=1"]
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def final_weights(run: Path, step: int) -> dict:
    return checkpoint_weights(run / "checkpoints" / f"step_{step:06d}")


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------ --resume auto, in process


def test_resume_words_keep_overrides_apart():
    """`--resume` never takes the override after it for its value; `--resume auto` is one."""
    parse = cli.build_parser().parse_args
    args = parse(cli.resume_words(["train", "--config", "c.yaml", "--resume", "a.b=1"]))
    assert args.resume is True and args.overrides == ["a.b=1"]
    args = parse(cli.resume_words(["train", "--resume", "auto", "--config", "c.yaml", "a.b=1"]))
    assert args.resume == "auto" and args.overrides == ["a.b=1"]
    assert parse(cli.resume_words(["sft", "--config", "c.yaml"])).resume is False
    with pytest.raises(SystemExit):
        parse(cli.resume_words(["train", "--config", "c.yaml", "--resume=later"]))


def test_overrides_after_a_flag_join_the_others():
    """Dotted overrides anywhere among the options (after `--plugin X`, `--resume`), in the
    order given; an unknown flag is still argparse's one-line error (exit 2)."""
    parser = cli.build_parser()
    argv = ["train", "--config", "c.yaml", "a.b=1", "--plugin", "m", "c.d=2", "--resume", "e=3"]
    args = cli.parse_args(parser, argv)
    assert args.overrides == ["a.b=1", "c.d=2", "e=3"] and args.plugin == ["m"]
    assert args.resume is True
    with pytest.raises(SystemExit) as e:
        cli.parse_args(parser, ["train", "--config", "c.yaml", "a=1", "--bogus", "b=2"])
    assert e.value.code == 2


def test_auto_start_chooses_by_what_the_directory_holds(tmp_path):
    cfg = load_config(TINY_CI, [f"train.output_dir={tmp_path / 'run'}"])
    assert auto_start(cfg)[:2] == (False, False)  # missing: start
    (tmp_path / "run").mkdir()
    assert auto_start(cfg)[:2] == (False, False)  # empty: start
    save_config(cfg, tmp_path / "run" / "config.yaml")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    resume, overwrite, said = auto_start(cfg)  # this config's start, no checkpoint yet
    assert (resume, overwrite) == (False, True) and "again" in said
    other = load_config(TINY_CI, [f"train.output_dir={tmp_path / 'run'}", "optim.lr=0.5"])
    assert auto_start(other)[:2] == (False, False)  # another config's: refused as today
    with pytest.raises(GrpoError, match="holds the metrics.jsonl of an earlier run"):
        check_run_dir(other, "train", False, False)
    (tmp_path / "run" / "checkpoints" / "step_000001").mkdir(parents=True)
    assert auto_start(other)[:2] == (True, False)  # a checkpoint: resume (checked as --resume)
    with pytest.raises(GrpoError, match="exclude each other"):
        auto_start(cfg, overwrite=True)


def test_resume_auto_starts_resumes_and_says_so(shared_tiny_model, tmp_path, monkeypatch, caplog):
    """The same command three times: starts (2 steps), resumes to 3 steps with a raised limit,
    and has nothing to do; each start says what it chose in the log and the run header."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "--config", TINY_CI, "--resume", "auto", f"model.path={shared_tiny_model}"]
    args += [*FAST, "train.output_dir=run"]
    with caplog.at_level("INFO", logger="grpo.run.rundir"):
        assert cli.main([*args, "train.max_steps=2"]) == 0
        assert cli.main([*args, "train.max_steps=3"]) == 0
        assert cli.main([*args, "train.max_steps=3"]) == 0  # nothing to do: exit 0
    said = [r.getMessage() for r in caplog.records if "--resume auto" in r.getMessage()]
    assert len(said) == 3 and "starting" in said[0] and "resuming" in said[1], said
    headers = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "run/start" in line
    ]
    assert [h["run/start"].split(" (")[0] for h in headers] == [
        "fresh",
        "resumed from step_000002",
    ]


# --------------------------------------------- several nodes: the same code, config, directory


def job_check(
    dist, cwds: list[str], overrides: list[list[str]], code: list[str] | None = None
) -> str | None:
    """On each rank of the pool: `check_job` with this rank's working directory, overrides and
    (`code`) source hash; the error it raised (None if none), and that the run directory was
    not made."""
    import grpo.run.cluster as cluster

    back, real_hash = os.getcwd(), cluster.source_hash
    os.chdir(cwds[dist.rank])
    if code is not None:
        cluster.source_hash = lambda: code[dist.rank]
    try:
        cfg = load_config(TINY_CI, ["train.output_dir=run", *overrides[dist.rank]])
        try:
            check_job(cfg, dist)
            return None
        except GrpoError as e:
            assert not Path("run").exists()  # refused before anything is written in it
            return str(e)
    finally:
        os.chdir(back)
        cluster.source_hash = real_hash


def test_a_job_refuses_ranks_that_do_not_share_the_output_dir(rank_pool, tmp_path):
    """A relative train.output_dir read in two working directories (two nodes without a
    shared filesystem): the same config text, two directories; refused on every rank, naming
    train.output_dir; in one working directory it passes."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    errors = rank_pool.run("test_cluster:job_check", [str(a), str(b)], [[], []])
    assert errors[0] == errors[1] and errors[0] is not None
    assert "train.output_dir run is not one directory for every rank: rank 1" in errors[0]
    assert rank_pool.run("test_cluster:job_check", [str(a), str(a)], [[], []]) == [None, None]
    assert not list(a.glob(".run.grpo-probe-*"))  # the probe is removed


def test_a_job_refuses_ranks_with_another_config(rank_pool, tmp_path):
    errors = rank_pool.run(
        "test_cluster:job_check", [str(tmp_path)] * 2, [[], ["loss.beta=0.5"]], timeout_s=120
    )
    assert errors[0] == errors[1] and "rank 1" in errors[0] and "loss.beta differs" in errors[0]


def test_a_job_refuses_ranks_that_run_other_code(rank_pool, tmp_path):
    errors = rank_pool.run(
        "test_cluster:job_check", [str(tmp_path)] * 2, [[], []], ["aaaa", "bbbb"], timeout_s=120
    )
    assert errors[0] == errors[1] and "rank 1" in errors[0] and "runs other code" in errors[0]
    assert "bbbb vs aaaa" in errors[0]


def test_first_difference_and_source_hash():
    assert first_difference({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == "a.c"
    assert first_difference({"a": [1, 2]}, {"a": [1, 2]}) is None
    assert first_difference({"a": 1}, {"a": 1, "z": 0}) == "z"
    assert len(source_hash()) == 16


def test_hash_sources_sees_a_changed_or_moved_file(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code")
    before = hash_sources({"pkg": pkg})
    (pkg / "notes.txt").write_text("still not code")
    assert hash_sources({"pkg": pkg}) == before  # .py files only
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    edited = hash_sources({"pkg": pkg})
    assert edited != before
    (pkg / "sub" / "b.py").rename(pkg / "b.py")
    assert hash_sources({"pkg": pkg}) not in (before, edited)  # the same bytes, moved


# --------------------------------------------------------------------- Slurm (stand-ins)


def slurm_env(tmp_path: Path, nodes: str, **extra) -> dict:
    extra.setdefault("PATH", f"{STANDIN}{os.pathsep}{os.environ['PATH']}")
    return env_with(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=nodes,
        SLURM_JOB_NUM_NODES=str(len(nodes.split(","))),
        GPUS_PER_NODE="1",
        GRPO_PYTHON=sys.executable,
        GRPO_RDZV_PORT=str(free_port()),
        GRPO_LOG_DIR=str(tmp_path / "logs"),
        STANDIN_RECORD=str(tmp_path / "record"),
        **extra,
    )


def test_sbatch_refuses_a_job_without_nodes(tmp_path):
    """No scontrol, or an empty node list: one line and exit 1, nothing launched (no fallback
    to localhost)."""
    env = slurm_env(tmp_path, "", PATH="/usr/bin:/bin")
    r = subprocess.run(["bash", str(SBATCH), TINY_CI], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "scontrol not found" in r.stderr
    env = slurm_env(tmp_path, "")
    r = subprocess.run(["bash", str(SBATCH), TINY_CI], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "SLURM_JOB_NODELIST is empty" in r.stderr, r.stderr
    assert not (tmp_path / "record").exists()


def grpo_args(model: Path, out: Path, steps: int) -> list[str]:
    return [
        f"model.path={model}",
        *FAST,
        f"train.max_steps={steps}",
        "train.batch_size=4",
        f"train.output_dir={out}",
    ]


@pytest.mark.process
def test_sbatch_trains_two_nodes_as_one(shared_tiny_model, tmp_path):
    """configs/cluster/grpo.sbatch as written, srun and scontrol standing in for Slurm, two
    "nodes" (one torchrun agent each, c10d rendezvous on the first): the same final weights as
    one agent running both ranks, bitwise; per-node logs; the rendezvous on the head node with
    the job's id."""
    env = slurm_env(tmp_path, "127.0.0.1,127.0.0.2")
    cmd = ["bash", str(SBATCH), TINY_CI, *grpo_args(shared_tiny_model, tmp_path / "nodes", 2)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    assert r.returncode == 0, (r.stderr[-2000:], {k: v[-2000:] for k, v in logs.items()})
    assert sorted(logs) == ["node-127.0.0.1.log", "node-127.0.0.2.log"]
    srun = (tmp_path / "record").read_text()
    assert "--kill-on-bad-exit=1" in srun and "--nodes=2" in srun
    one = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "grpo", "train"]
    one += ["--config", TINY_CI, *grpo_args(shared_tiny_model, tmp_path / "one", 2)]
    r = subprocess.run(one, cwd=tmp_path, env=env_with(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_bitwise(final_weights(tmp_path / "nodes", 2), final_weights(tmp_path / "one", 2))


@pytest.mark.process
def test_sbatch_requeues_before_the_time_limit(shared_tiny_model, tmp_path):
    """USR1 (Slurm's --signal=B:USR1@300) to the batch script: `scontrol requeue` of the job,
    then SIGTERM: every rank checkpoints at the step boundary and stops before the end; the
    requeued job (the same script) resumes from that checkpoint to the end."""
    env = slurm_env(tmp_path, "127.0.0.1")
    out = tmp_path / "run"
    steps = 8
    cmd = ["bash", str(SBATCH), TINY_CI, *grpo_args(shared_tiny_model, out, steps)]
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + TIMEOUT_S
    while not (out / "checkpoints" / "latest").exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    p.communicate(timeout=TIMEOUT_S)
    node_log = (tmp_path / "logs" / "node-127.0.0.1.log").read_text()
    assert "interrupted by SIGTERM" in node_log, node_log[-3000:]
    assert "requeue 4242" in (tmp_path / "record").read_text()
    assert not (out / "final").exists()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-2000:]
    node_log = (tmp_path / "logs" / "node-127.0.0.1.log").read_text()
    assert "--resume auto: resuming" in node_log and (out / "final").is_dir()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r["step"] for r in rows if "train/loss" in r]
    assert sorted(steps_logged) == list(range(1, steps + 1))  # each step once


# ------------------------------------------------------ restarts: torchrun, SIGTERM, requeue


KILLER = '''
import os, signal, time

# the restarted rank 1 starts late: a key of the attempt before must not be read for its own
# (grpo.distributed.attempt_store)
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
    time.sleep(3)

def kill_rank1_once(completions, *, context, **columns):
    """SIGKILL on rank 1 in the first attempt's rollout of step 3 (checkpoint 2 written)."""
    if (
        os.environ.get("KILL_ONCE") == "1"
        and os.environ.get("RANK") == "1"
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        and context.step == 2
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
'''


@pytest.mark.process
def test_torchrun_restarts_a_killed_rank_and_the_run_resumes_bitwise(shared_tiny_model, tmp_path):
    """`torchrun --max-restarts=1 ... --resume auto`, 2 gloo ranks, rank 1 SIGKILLed in step 3:
    torchrun restarts the job, which resumes from step 2's checkpoint; the final weights are
    an uninterrupted run's, bitwise."""
    (tmp_path / "killer.py").write_text(KILLER)
    rewards = 'rewards=[{name: accuracy, weight: 1.0}, {name: "killer:kill_rank1_once", weight: 0}]'

    def job(out: str, **extra) -> subprocess.CompletedProcess:
        cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
        cmd += ["-m", "grpo", "train", "--config", TINY_CI, "--resume", "auto"]
        cmd += ["--plugin", "killer", rewards]
        cmd += grpo_args(shared_tiny_model, tmp_path / out, 4)
        env = env_with(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", **extra)
        return subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )

    r = job("killed", KILL_ONCE="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming (checkpoints up to step" in r.stderr  # the restart's choice, logged
    r = job("straight")
    assert r.returncode == 0, r.stderr[-3000:]
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    assert_bitwise(final_weights(straight, 4), final_weights(killed, 4))
    steps = [
        json.loads(x).get("step") for x in (killed / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [s for s in steps if s is not None][-2:] == [3, 4]


@pytest.mark.process
def test_a_sigterm_job_started_again_resumes_with_the_same_command(shared_tiny_model, tmp_path):
    """SIGTERM mid-run: checkpoint, exit 143; the same command (with --resume auto) continues
    from it to the uninterrupted run's final weights, bitwise."""
    cmd = [sys.executable, "-m", "grpo", "train", "--config", TINY_CI, "--resume", "auto"]
    cmd += grpo_args(shared_tiny_model, tmp_path / "run", 4)
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env_with(), stderr=subprocess.PIPE, text=True)
    deadline = time.time() + TIMEOUT_S
    while not (tmp_path / "run" / "checkpoints" / "latest").exists():
        assert p.poll() is None and time.time() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=TIMEOUT_S)
    assert p.returncode == 143, err[-2000:]
    assert "--resume auto" in err  # the resume command it names is the same command
    r = subprocess.run(cmd, cwd=tmp_path, env=env_with(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    straight = [*cmd[:-1], f"train.output_dir={tmp_path / 'straight'}"]
    r = subprocess.run(straight, cwd=tmp_path, env=env_with(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_bitwise(final_weights(tmp_path / "straight", 4), final_weights(tmp_path / "run", 4))


# ------------------------------------------------------------------------- Kubernetes


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def pod_command(spec: dict, **env) -> list[str]:
    """The container's command with Kubernetes' $(VAR) expansion from its env (and `env`)."""
    container = spec["template"]["spec"]["containers"][0]
    values = {e["name"]: e["value"] for e in container["env"]} | env
    out = []
    for word in container["command"]:
        for name, value in values.items():
            word = word.replace(f"$({name})", value)
        out.append(word)
    return out


def test_pytorchjob_manifest_carries_what_the_operator_needs():
    job = manifest()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] >= 1
    for role in ("Master", "Worker"):
        spec = replicas[role]
        assert spec["restartPolicy"] == "ExitCode"  # a signal's exit restarts; exit 1 / 2 not
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the container the operator configures
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        claims = {v["name"]: v.get("persistentVolumeClaim") for v in pod["volumes"]}
        assert claims["shared"]["claimName"]
        cmd = pod_command(spec)
        assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
        assert cmd[cmd.index("--resume") + 1] == "auto"
        out = next(w for w in cmd if w.startswith("train.output_dir="))
        assert out.removeprefix("train.output_dir=").startswith(mounts["shared"] + "/")
        limits = container["resources"]["limits"]["nvidia.com/gpu"]
        assert str(limits) == job["spec"]["nprocPerNode"]
    assert not any(w.startswith(("--nnodes", "--node-rank", "--master")) for w in cmd)


@pytest.mark.process
def test_pytorchjob_command_trains_two_pods_as_one(shared_tiny_model, tmp_path):
    """The manifest's command as the operator runs it in two pods (PET_* variables: torchrun's
    options), here two agents on 127.0.0.1: the same final weights as the Slurm test's one
    agent with both ranks."""
    spec = manifest()["spec"]["pytorchReplicaSpecs"]
    port = str(free_port())
    out = tmp_path / "pods"
    procs, logs = [], []
    for rank, role in enumerate(("Master", "Worker")):
        cmd = pod_command(spec[role], GRPO_CONFIG=TINY_CI, GRPO_OUTPUT_DIR=str(out))
        cmd = [sys.executable if w == "python" else w for w in cmd]
        cmd += grpo_args(shared_tiny_model, out, 2)[:-1]  # the tiny model, 2 steps
        env = env_with(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE="2",
            RANK=str(rank),
            PET_NNODES="2",
            PET_NODE_RANK=str(rank),
            PET_MASTER_ADDR="127.0.0.1",
            PET_MASTER_PORT=port,
            PET_NPROC_PER_NODE="1",
        )
        logs.append(open(tmp_path / f"pod{rank}.err", "w+"))
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=logs[-1])
        )
    for p in procs:
        p.wait(timeout=TIMEOUT_S)
    for p, log in zip(procs, logs):
        log.seek(0)
        assert p.returncode == 0, log.read()[-2000:]
    one = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "grpo", "train"]
    one += ["--config", TINY_CI, *grpo_args(shared_tiny_model, tmp_path / "one", 2)]
    r = subprocess.run(one, cwd=tmp_path, env=env_with(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_bitwise(final_weights(out, 2), final_weights(tmp_path / "one", 2))
