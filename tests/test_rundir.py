"""The run directory contract (grpo/run/rundir.py) and signal handling: the lock, fresh runs
refused in a used directory unless --overwrite, checkpoints ordered by step, resume from the
newest valid checkpoint with a compatible config, SIGTERM -> checkpoint at the step boundary
and an exact resume; every refusal is one line, exit 2, and leaves the directory as it was."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tree_digest
from safetensors.torch import load_file

from grpo.apps import cli
from grpo.errors import GrpoError
from grpo.run.rundir import (
    LOCK_FILE,
    LOCK_STALE_S,
    RunLock,
    TrainingInterrupted,
    algorithm_changes,
    lock_is_live,
    read_lock,
    resume_conflicts,
)
from grpo.run.state import (
    TrainState,
    latest_checkpoint,
    process_alive,
    process_start,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
FAST = ["train.progress=false", "data.eval_samples=0", "rollout.compile=off", "data.max_samples=16"]

# A reward with spread (so the weights move), which at call HANDSHAKE_CALL on rank
# HANDSHAKE_RANK writes its pid to HANDSHAKE_DIR/ready and waits for HANDSHAKE_DIR/go: the test
# then knows the run is inside that step, with its lock held and nothing being written.
HANDSHAKE = """
import os, time
from pathlib import Path
calls = [0]
def length(completions, **_):
    calls[0] += 1
    d = os.environ.get("HANDSHAKE_DIR")
    mine = os.environ.get("RANK", "0") == os.environ.get("HANDSHAKE_RANK", "0")
    if d and mine and calls[0] == int(os.environ.get("HANDSHAKE_CALL", "2")):
        Path(d, "ready").write_text(str(os.getpid()))
        deadline = time.time() + 120
        while not Path(d, "go").exists() and time.time() < deadline:
            time.sleep(0.01)
    return [len(c) / 50 for c in completions]
"""


def one_line(code: int, capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def steps_logged(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def tiny_objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


@pytest.fixture()
def sleeper():
    """A live process that is not a run (its pid goes into hand-written lock files)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def write_lock(run: Path, pid: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    record = {
        "pid": pid,
        "host": socket.gethostname(),
        "started": "2025-01-01T00:00:00+00:00",
        "proc_start": process_start(pid),
        "token": "x",
    }
    (run / LOCK_FILE).write_text(json.dumps(record))


# ----------------------------------------------------------------- a used directory


def test_used_directory_needs_resume_or_overwrite(shared_tiny_model, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    base = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        f"train.output_dir={run}",
        *FAST,
        "train.save_every=1",
    ]
    assert cli.main([*base, "train.max_steps=2"]) == 0
    capsys.readouterr()
    (run / "notes.txt").write_text("the user's own file")
    before = tree_digest(run)

    err = one_line(cli.main([*base, "train.max_steps=2"]), capsys)  # a fresh start: refused
    assert err == (
        f"grpo train: error: train.output_dir {run} holds a finished run (final/) and "
        "checkpoints up to step 2; continue it with --resume, replace it with "
        "--overwrite, or choose another train.output_dir"
    )
    assert tree_digest(run) == before
    err = one_line(cli.main([*base, "--resume", "--overwrite"]), capsys)
    assert "--resume and --overwrite exclude each other" in err
    assert tree_digest(run) == before

    # --resume refuses a config that changes what the checkpoint trained, listing each change
    # (checked before the model loads: the new model path need not exist)
    changed = [
        "model.path=/elsewhere/model",
        "lora.rank=4",
        "rollout.group_size=2",
        "data.dataset=gsm8k",
        "optim.lr=1e-4",
    ]
    err = one_line(cli.main([*base, *changed, "--resume"]), capsys)
    listed = err.split("the config changes ")[1].split(" from checkpoint")[0]
    assert listed == (
        f"model.path ('{shared_tiny_model}' -> '/elsewhere/model'), lora.rank (8 -> 4), "
        "rollout.group_size (4 -> 2), data.dataset ('minimath' -> 'gsm8k')"
    )
    assert err.endswith("(start afresh with --overwrite or another train.output_dir)")
    assert tree_digest(run) == before

    # --overwrite: the earlier run's outputs go (the user's file stays), a new run starts
    assert cli.main([*base, "train.max_steps=1", "--overwrite"]) == 0
    assert steps_logged(run) == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert (run / "notes.txt").read_text() == "the user's own file"
    assert not (run / LOCK_FILE).exists()

    # --resume with a longer schedule continues it; config.yaml stays that of the start
    config_yaml = (run / "config.yaml").read_text()
    assert cli.main([*base, "train.max_steps=2", "--resume"]) == 0
    assert steps_logged(run) == [1, 2]
    assert (run / "config.yaml").read_text() == config_yaml
    assert "max_steps: 2" in (run / "config.resume.yaml").read_text()

    # a truncated newest checkpoint: resume from the one before, with a warning naming it
    opt = run / "checkpoints" / "step_000002" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:-64])
    caplog.clear()
    assert cli.main([*base, "train.max_steps=3", "--resume"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "step_000002 skipped: optimizer.pt has" in w and "(truncated?)" in w for w in warned
    ), warned
    assert any(
        "resuming from step_000001 instead of the newer, broken step_000002" in w for w in warned
    ), warned
    assert steps_logged(run) == [1, 2, 3]  # step 2 redone once, not logged twice


def test_metrics_without_checkpoint_need_overwrite(shared_tiny_model, tmp_path, capsys):
    run = tmp_path / "run"  # a run killed before its first checkpoint: nothing to resume
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = tree_digest(run)
    base = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        f"train.output_dir={run}",
        *FAST,
    ]
    err = one_line(cli.main(base), capsys)
    assert err == (
        f"grpo train: error: train.output_dir {run} holds the metrics.jsonl of an "
        "earlier run; replace it with --overwrite, or choose another "
        "train.output_dir"
    )
    err = one_line(cli.main([*base, "--resume"]), capsys)
    assert err == f"grpo train: error: --resume: no checkpoint in {run / 'checkpoints'}"
    assert tree_digest(run) == before


def test_resume_conflicts_compare_what_was_trained():
    saved = {
        "model": {"path": "m", "tokenizer": None, "adapter": None},
        "lora": {"enabled": False, "rank": 8, "alpha": 16.0, "targets": ["q_proj"]},
        "rollout": {"group_size": 4},
        "data": {
            "dataset": "minimath",
            "split": "train",
            "max_samples": 64,
            "difficulty": 0,
            "seed": 0,
            "source": None,
        },
    }
    same = json.loads(json.dumps(saved))
    same["lora"]["rank"] = 32  # LoRA off in both: its shape is irrelevant
    same["data"]["source"] = "elsewhere"  # minimath has no source
    assert resume_conflicts(saved, same, "train") == []
    other = json.loads(json.dumps(saved))
    other["data"]["seed"] = 1
    other["rollout"]["group_size"] = 8
    assert resume_conflicts(saved, other, "train") == [
        "rollout.group_size (4 -> 8)",
        "data.seed (0 -> 1)",
    ]
    assert resume_conflicts(saved, other, "sft") == ["data.seed (0 -> 1)"]  # SFT has no groups
    assert resume_conflicts({"ok": True}, other, "train") == []  # an older format: no keys
    # PPO resumed without its critic, or with another start: refused; a reward model's pad id
    ppo = {**saved, "modules": [{"name": "critic", "kwargs": {}}], "rm": {"pad_token_id": 0}}
    grpo = {**ppo, "modules": []}
    assert resume_conflicts(ppo, grpo, "train") == [
        "modules ([{'name': 'critic', 'kwargs': {}}] -> [])"
    ]
    init = {**ppo, "modules": [{"name": "critic", "kwargs": {"init": "rm"}}]}
    assert resume_conflicts(ppo, init, "train")[0].startswith("modules (")
    pad = {**ppo, "rm": {"pad_token_id": 5}}
    assert resume_conflicts(ppo, pad, "rm") == ["rm.pad_token_id (0 -> 5)"]
    assert resume_conflicts(ppo, pad, "train") == []  # GRPO has no pad id to keep
    # the algorithm may change on a resume, said (not refused)
    loss = {**saved, "loss": {"advantage": "grpo", "policy_loss": "clip", "kl_estimator": "k3"}}
    gspo = {**loss, "loss": {**loss["loss"], "policy_loss": "gspo"}}
    assert resume_conflicts(loss, gspo, "train") == []
    assert algorithm_changes(loss, gspo, "train") == ["loss.policy_loss ('clip' -> 'gspo')"]
    assert (
        algorithm_changes(loss, gspo, "sft") == [] and algorithm_changes(saved, gspo, "train") == []
    )


def test_a_resume_that_changes_the_algorithm_says_so(shared_tiny_model, tmp_path, caplog):
    """Resuming with another advantage estimator, policy loss or KL estimator (or their
    kwargs) goes on with the new one, but is said: one warning line naming each change, and
    the start's run/start record lists them (a resume that changes none says nothing:
    `algorithm_changes` in test_resume_conflicts_compare_what_was_trained)."""
    run = tmp_path / "run"
    base = ["train", "--config", TINY_CI, f"model.path={shared_tiny_model}"]
    base += [f"train.output_dir={run}", *FAST, "train.save_every=1", "rollout.max_new_tokens=8"]
    assert cli.main([*base, "train.max_steps=1"]) == 0
    with caplog.at_level("WARNING", logger="grpo.run.rundir"):
        changed = ["loss.advantage=rloo", "loss.kl_estimator=k2", "train.max_steps=2"]
        assert cli.main([*base, *changed, "--resume"]) == 0
    said = [r.getMessage() for r in caplog.records if "changes the algorithm" in r.getMessage()]
    changes = "loss.advantage ('grpo' -> 'rloo'), loss.kl_estimator ('k3' -> 'k2')"
    assert said == [
        f"--resume: the config changes the algorithm from checkpoint {run}/checkpoints/"
        f"step_000001: {changes}; the run goes on with the new one from its next step "
        "(recorded in run/start)"
    ]
    starts = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    starts = [r["run/start"] for r in starts if "run/start" in r]
    assert starts == ["fresh", f"resumed from step_000001, changing {changes}"]
    assert steps_logged(run) == [1, 2]


def test_one_directory_spelled_two_ways_is_the_same_model(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    saved = {"model": {"path": "m"}}
    assert resume_conflicts(saved, {"model": {"path": str(tmp_path / "m")}}, "sft") == []
    assert resume_conflicts(saved, {"model": {"path": "./m/"}}, "sft") == []
    assert resume_conflicts(saved, {"model": {"path": "n"}}, "sft") == ["model.path ('m' -> 'n')"]


# ----------------------------------------------------------------- the lock


def test_live_lock_refuses_and_stale_lock_is_taken_over(
    shared_tiny_model, tmp_path, capsys, caplog, sleeper
):
    run = tmp_path / "run"
    base = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        f"train.output_dir={run}",
        *FAST,
        "train.max_steps=1",
    ]
    write_lock(run, sleeper.pid)
    before = tree_digest(run)
    for extra in ([], ["--overwrite"], ["--resume"]):
        err = one_line(cli.main(base + extra), capsys)
        assert err.startswith(
            f"grpo train: error: {run} is in use by another run (pid "
            f"{sleeper.pid} on {socket.gethostname()}, started "
            "2025-01-01T00:00:00+00:00); wait for it to end, or delete "
            f"{run / LOCK_FILE} if that process is gone"
        ), err
        assert tree_digest(run) == before
    sleeper.kill()
    sleeper.wait()  # now the lock names a dead process
    caplog.clear()
    assert cli.main(base) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"taking over the stale lock of pid {sleeper.pid}" in w for w in warned), warned
    assert not (run / LOCK_FILE).exists() and steps_logged(run) == [1]


def test_a_lock_of_another_host_lives_while_its_holder_renews_it(tmp_path, caplog):
    """A multi-node job on a shared filesystem: a lock written on another host cannot be
    checked by pid; it is live while its holder renews it and stale once it stops (a crashed
    node), instead of live forever."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / LOCK_FILE
    path.write_text(json.dumps({"pid": 7, "host": "node-that-died", "token": "x"}))
    assert lock_is_live(read_lock(path), path)  # just written: its holder may be running
    with pytest.raises(GrpoError, match="in use by another run .pid 7 on node-that-died"):
        RunLock.acquire(run)
    old = time.time() - LOCK_STALE_S - 1
    os.utime(path, (old, old))  # not renewed for LOCK_STALE_S
    assert not lock_is_live(read_lock(path), path)
    lock = RunLock.acquire(run, heartbeat_s=0.05)
    assert any(
        "taking over the stale lock of pid 7 on node-that-died" in r.getMessage()
        for r in caplog.records
    )
    os.utime(path, (old, old))
    deadline = time.time() + 30
    while path.stat().st_mtime < time.time() - 5:  # our heartbeat renews it
        assert time.time() < deadline
        time.sleep(0.02)
    lock.release()
    assert not path.exists() and lock.stop.is_set()


def test_process_alive_tells_reused_pids_and_zombies():
    me, start = os.getpid(), process_start(os.getpid())
    assert start is not None  # Linux /proc
    assert process_alive(me, socket.gethostname(), start)
    assert not process_alive(me, socket.gethostname(), start + 1)  # same pid, another process
    assert process_alive(me, "some-other-host", start + 1)  # cannot be checked: counts as alive
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.time() < deadline
        time.sleep(0.01)
    assert not process_alive(child.pid)  # exited, not yet reaped
    child.wait()
    assert not process_alive(child.pid)


def test_save_removes_only_its_own_or_dead_temporaries(tmp_path, sleeper):
    model, opt, sched = tiny_objects()
    root = tmp_path / "checkpoints"
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [
        f".tmp-step_000005-{host}-{sleeper.pid}",  # a live process's save in progress
        f".tmp-step_000004-{host}-{dead.pid}",  # left by a killed save
        f".tmp-step_000003-{dead.pid}",  # the same, older naming (no host)
        ".tmp-step_000002-other-host-7",  # another host's: cannot be judged from here
    ]
    for n in names:
        (root / n).mkdir(parents=True)
    save_checkpoint(tmp_path, TrainState(step=1), model, opt, sched, {})
    left = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
    assert left == sorted([names[0], names[3]])


# ----------------------------------------------------------------- ordering and validity


@pytest.mark.parametrize(
    "steps, keep, kept",
    [
        ([9, 10, 11], 2, ["step_000010", "step_000011"]),
        ([999999, 1000000], 1, ["step_1000000"]),  # by name, step_1000000 sorts first
    ],
)
def test_keep_last_orders_by_step_number(tmp_path, steps, keep, kept):
    model, opt, sched = tiny_objects()
    for step in steps:
        save_checkpoint(tmp_path, TrainState(step=step), model, opt, sched, {}, keep_last=keep)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name != "latest")
    assert names == kept
    assert latest_checkpoint(tmp_path).name == kept[-1]


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-16])


BREAKS = [
    ("trainable.safetensors", _truncate, True, "trainable.safetensors has"),
    ("trainable.safetensors", _truncate, False, "file not fully covered"),
    ("optimizer.pt", _truncate, False, "optimizer.pt is not a complete torch file"),
    ("scheduler.pt", Path.unlink, False, "scheduler.pt missing"),
    ("state.json", lambda p: p.write_text('{"train_state": '), False, "invalid JSON"),
]


@pytest.mark.parametrize("name, breaks, manifest, why", BREAKS)
def test_broken_newest_checkpoint_falls_back_with_a_warning(
    tmp_path, caplog, name, breaks, manifest, why
):
    model, opt, sched = tiny_objects()
    for step in (1, 2):
        save_checkpoint(tmp_path, TrainState(step=step), model, opt, sched, {}, keep_last=3)
    newest = tmp_path / "checkpoints" / "step_000002"
    if not manifest:  # a checkpoint of an older version: the files themselves are checked
        (newest / "manifest.json").unlink()
    breaks(newest / name)
    caplog.clear()
    assert latest_checkpoint(tmp_path).name == "step_000001"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"{newest} skipped: " in warned[0] and why in warned[0], warned


# ----------------------------------------------------------------- signals


def test_sigterm_saves_at_the_step_boundary_and_resumes_exactly(
    shared_tiny_model, tmp_path, capsys, monkeypatch
):
    (tmp_path / "handshake_reward.py").write_text(HANDSHAKE)
    args = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        *FAST,
        "train.max_steps=3",
        "train.save_every=100",
        "loss.num_iterations=1",
        "rewards=[{name: 'handshake_reward:length'}]",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(tmp_path),
        "HANDSHAKE_DIR": str(tmp_path),
    }
    p = subprocess.Popen(
        [sys.executable, "-m", "grpo", *args, "train.output_dir=run"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 240
        while not (tmp_path / "ready").exists():  # inside step 2
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.02)
        # a second process on the same directory is refused by the lock, changing nothing
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        before = tree_digest(tmp_path / "run")
        for extra in ([], ["--resume"]):
            err = one_line(cli.main([*args, "train.output_dir=run", *extra]), capsys)
            assert f"run is in use by another run (pid {p.pid} on " in err, err
        assert tree_digest(tmp_path / "run") == before
        p.send_signal(signal.SIGTERM)
    finally:
        (tmp_path / "go").touch()
    _, err = p.communicate(timeout=240)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("grpo train:")]
    assert ours == [
        "grpo train: interrupted by SIGTERM at step 2: checkpoint saved in "
        "run/checkpoints/step_000002; resume with: grpo train --config "
        "run/config.yaml --resume"
    ], err[-3000:]
    assert "Traceback" not in err
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert steps_logged(run) == [1, 2] and not (run / LOCK_FILE).exists()

    # the printed command continues it to the weights of a run never interrupted
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the subprocess: the same float sums
    try:
        assert cli.main([*args, "train.output_dir=straight"]) == 0
        resume = shlex.split(ours[0].split("resume with: ")[1])
        assert resume[0] == "grpo" and cli.main(resume[1:]) == 0
    finally:
        torch.set_num_threads(threads)
    assert steps_logged(run) == [1, 2, 3]
    a = load_file(tmp_path / "straight" / "final" / "adapter_model.safetensors")
    b = load_file(run / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in a.items())  # moved
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.process
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(shared_tiny_model, tmp_path):
    (tmp_path / "handshake_reward.py").write_text(HANDSHAKE)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(tmp_path),
        "HANDSHAKE_DIR": str(tmp_path),
        "HANDSHAKE_RANK": "1",
    }
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
        TINY_CI,
        f"model.path={shared_tiny_model}",
        *FAST,
        "train.max_steps=3",
        "train.save_every=100",
        "train.output_dir=run",
        "rewards=[{name: 'handshake_reward:length'}]",
    ]
    p = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 240
        ready = tmp_path / "ready"
        while not (ready.exists() and ready.read_text()):  # rank 1 inside step 2, rank 0 waiting
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.02)
        os.kill(int(ready.read_text()), signal.SIGTERM)  # rank 1 only
    finally:
        (tmp_path / "go").touch()
    _, err = p.communicate(timeout=240)
    assert p.returncode != 0
    ours = [line for line in err.splitlines() if "grpo train:" in line]
    resume = "torchrun --standalone --nproc_per_node=2 -m grpo train --config run/config.yaml"
    expected = (
        "grpo train: interrupted by SIGTERM at step 2: checkpoint saved in "
        f"run/checkpoints/step_000002; resume with: {resume} --resume"
    )
    assert ours == [expected], err[-3000:]
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000002"]
    state = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["train_state"]["step"] == 2 and len(state["rng"]) == 2  # both ranks, one step
    assert steps_logged(run) == [1, 2] and not (run / LOCK_FILE).exists()


def test_pipeline_and_sweep_record_interrupted(shared_tiny_model, tmp_path, monkeypatch):
    from grpo.apps.pipeline import RESULTS_FILE, load_pipeline_config, run_pipeline
    from grpo.apps.sweep import load_space, run_sweep

    calls = []

    def stopped(cfg, resume=False, **kwargs):
        calls.append(kwargs)
        raise TrainingInterrupted("interrupted by SIGTERM at step 3: ...", signal.SIGTERM)

    monkeypatch.setattr("grpo.train.sft.train_sft", stopped)
    over = [f"model.path={shared_tiny_model}", f"output_dir={tmp_path}/p"]
    pipe = load_pipeline_config(REPO / "configs" / "pipeline_tiny.yaml", over)
    with pytest.raises(TrainingInterrupted) as e:
        run_pipeline(pipe)
    assert e.value.exit_code == 143
    results = json.loads((tmp_path / "p" / RESULTS_FILE).read_text())
    assert results["status"] == "interrupted" and results["failed_stage"] == "sft"
    assert results["stages"]["sft"]["status"] == "interrupted"
    with pytest.raises(TrainingInterrupted):  # `grpo pipeline --overwrite` reaches the trainer
        run_pipeline(pipe, overwrite=True)
    assert calls == [{}, {"overwrite": True}]

    monkeypatch.setattr("grpo.train.grpo.train_grpo", stopped)
    (tmp_path / "space.yaml").write_text("optim.lr: [0.001, 0.002]\n")
    with pytest.raises(TrainingInterrupted):
        run_sweep(
            TINY_CI,
            load_space(tmp_path / "space.yaml"),
            out_dir=tmp_path / "sweep",
            overrides=[f"model.path={shared_tiny_model}"],
        )
    record = json.loads((tmp_path / "sweep" / "trial_000" / "trial.json").read_text())
    assert record["status"] == "interrupted" and "SIGTERM" in record["error"]
    assert not (tmp_path / "sweep" / "trial_001").exists()  # the sweep stopped there


def test_interrupt_exit_code_and_line_through_the_cli(monkeypatch, capsys):
    def stopped(cfg, resume=False, overwrite=False):
        raise TrainingInterrupted("interrupted by SIGINT at step 1: ...", signal.SIGINT)

    monkeypatch.setattr("grpo.train.sft.train_sft", stopped)
    code = cli.main(["sft", "--config", TINY_CI])
    assert code == 130
    assert capsys.readouterr().err.strip() == "grpo sft: interrupted by SIGINT at step 1: ..."

    def other_rank(cfg, resume=False, overwrite=False):
        raise TrainingInterrupted("interrupted by SIGTERM at step 1: ...", signal.SIGTERM, rank=1)

    monkeypatch.setattr("grpo.train.sft.train_sft", other_rank)
    assert cli.main(["sft", "--config", TINY_CI]) == 143
    assert capsys.readouterr().err == ""  # rank 0 says it, once

    def failing(cfg, resume=False, overwrite=False):
        raise GrpoError("data: no rows")

    monkeypatch.setattr("grpo.train.sft.train_sft", failing)  # any other error: as before
    assert cli.main(["sft", "--config", TINY_CI]) == 2
    assert capsys.readouterr().err.strip() == "grpo sft: error: data: no rows"
