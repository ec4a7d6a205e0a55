"""Reliability: exact resume after SIGKILL, atomic checkpoints, non-finite guard, and a
bad-input matrix through the CLI (one line, non-zero exit, no traceback, nothing lost)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import live_lora, tree_digest

from grpo.apps import cli
from grpo.errors import GrpoError
from grpo.run.state import (
    TrainState,
    checkpoint_weights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from grpo.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
FAST = ["train.progress=false", "data.eval_samples=0", "train.save_every=1"]


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model):
    return shared_tiny_model  # read only: runs write to their own directories


def grpo_cmd(*args, torchrun=False):
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        if torchrun
        else [sys.executable]
    )
    return [*launcher, "-m", "grpo", *args]


def run_to_end(cmd, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


def start(cmd, cwd, log: str):
    """`run_to_end` in the background (runs that do not depend on each other overlap): the
    process, its stderr going to cwd/log; `finish` waits for it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    err = open(Path(cwd) / log, "w+")
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    p.err = err
    return p


def finish(p):
    try:
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.err.seek(0)
        tail = p.err.read()[-3000:]
        p.err.close()
    assert p.returncode == 0, tail


def run_and_kill(cmd, cwd, ckpt_root: Path, seed: int):
    """Start `cmd`, wait for its first checkpoint, SIGKILL its whole process group at a random
    moment shortly after (possibly inside a later save)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while not (ckpt_root / "latest").exists():
        assert p.poll() is None, "the run ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0.0, 1.5))
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def final_weights(run: Path, step: int) -> dict:
    """The trainable weights of the run's checkpoint of `step` (either format)."""
    return checkpoint_weights(run / "checkpoints" / f"step_{step:06d}")


CASES = [
    ("train", "grpo-lora", []),
    pytest.param("sft", "sft-full", ["lora.enabled=false"], marks=pytest.mark.process),
]


@pytest.mark.parametrize("command, name, extra", CASES)
def test_sigkill_then_resume_is_bitwise_identical(model_dir, tmp_path, command, name, extra):
    steps = 4
    common = [
        command,
        "--config",
        TINY_CI,
        f"model.path={model_dir}",
        *FAST,
        f"train.max_steps={steps}",
        *extra,
    ]
    straight = start(grpo_cmd(*common, "train.output_dir=straight"), tmp_path, "straight.err")
    cmd = grpo_cmd(*common, "train.output_dir=killed")
    run_and_kill(cmd, tmp_path, tmp_path / "killed" / "checkpoints", seed=len(name))
    run_to_end([*cmd, "--resume"], tmp_path)
    finish(straight)  # ran beside the killed one: one process each
    a, b = final_weights(tmp_path / "straight", steps), final_weights(tmp_path / "killed", steps)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no duplicated steps


@pytest.mark.process
def test_sigkill_then_resume_under_torchrun(model_dir, tmp_path):
    steps = 3
    common = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={model_dir}",
        *FAST,
        f"train.max_steps={steps}",
    ]
    run_to_end(grpo_cmd(*common, "train.output_dir=straight", torchrun=True), tmp_path)
    cmd = grpo_cmd(*common, "train.output_dir=killed", torchrun=True)
    run_and_kill(cmd, tmp_path, tmp_path / "killed" / "checkpoints", seed=3)
    run_to_end([*cmd, "--resume"], tmp_path)
    a, b = final_weights(tmp_path / "straight", steps), final_weights(tmp_path / "killed", steps)
    for k in a:
        assert torch.equal(a[k], b[k]), k


QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


@pytest.mark.process
def test_fsdp_sigkill_resume_is_exact_and_resumes_on_one_process(
    model_dir, tmp_path, monkeypatch, capsys
):
    """train.parallel=fsdp under torchrun (full fine-tuning, the quickstart's reward: real
    gradients from step 1): killed and resumed equals the straight run bitwise; its checkpoint
    (gathered from the shards) resumes on 2 DDP ranks to the FSDP run's next step (1e-5: the
    reductions differ in order) and in one process (which samples a batch of its own); the
    final weights are a checkpoint `grpo eval` loads. The one-process resume and `grpo eval`
    go through the CLI in this process (no interpreter to start)."""
    steps = 3
    common = [
        "train",
        "--config",
        QUICKSTART,
        f"model.path={model_dir}",
        *FAST,
        "train.batch_size=16",
        "rollout.max_new_tokens=8",
        "train.keep_last=5",
    ]
    fsdp = [*common, "train.parallel=fsdp"]
    straight = grpo_cmd(
        *fsdp, f"train.max_steps={steps}", "train.output_dir=straight", torchrun=True
    )
    run_to_end(straight, tmp_path)
    cmd = grpo_cmd(*fsdp, f"train.max_steps={steps}", "train.output_dir=killed", torchrun=True)
    run_and_kill(cmd, tmp_path, tmp_path / "killed" / "checkpoints", seed=5)
    run_to_end([*cmd, "--resume"], tmp_path)
    a, b = final_weights(tmp_path / "straight", steps), final_weights(tmp_path / "killed", steps)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    start = final_weights(tmp_path / "straight", 1)
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-3  # it did train
    # step 2's checkpoint, resumed for its last step in one process and on 2 DDP ranks
    monkeypatch.chdir(tmp_path)  # the same relative paths as the runs above
    # one process keeps the job's global batch of 2 x 16 (16 alone is refused with the numbers)
    one = ["train.batch_size=32"]
    for name, extra, torchrun in (("one", one, False), ("ddp", ["train.parallel=ddp"], True)):
        shutil.copytree(tmp_path / "straight", tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / f"step_{steps:06d}")
        (tmp_path / name / "checkpoints" / "latest").write_text(f"step_{steps - 1:06d}\n")
        args = [*fsdp, f"train.max_steps={steps}", f"train.output_dir={name}", *extra, "--resume"]
        if name == "one":
            capsys.readouterr()
            assert cli.main([a for a in args if a not in one]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "a global batch of 32" in err[0], err
            assert "makes a global batch of 16: set train.batch_size=32 to keep it" in err[0]
        if torchrun:
            run_to_end(grpo_cmd(*args, torchrun=True), tmp_path)
        else:  # one process: this one, through the CLI
            assert cli.main(args) == 0, capsys.readouterr().err[-3000:]
        c = final_weights(tmp_path / name, steps)
        diff = max((a[k] - c[k]).abs().max().item() for k in a)
        if name == "ddp":  # the same batch, reduced by all-reduce instead of reduce-scatter
            assert diff <= 1e-5, (name, diff)
        else:  # one process samples its own batch: a different step, from the same state
            before = final_weights(tmp_path / "straight", steps - 1)
            assert all(torch.isfinite(c[k]).all() for k in c)
            assert max((c[k] - before[k]).abs().max().item() for k in c) > 1e-4
    final = tmp_path / "straight" / "final"
    assert (final / "model.safetensors").is_file()
    out = tmp_path / "eval.json"
    code = cli.main(
        [
            "eval",
            "--model",
            str(final),
            "--data",
            "minimath",
            "--max-samples",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    assert json.loads(out.read_text())


def _trained(seed: int = 0):
    """A small model and its AdamW after two steps (state to save), and a fresh pair."""
    from grpo.config import OptimConfig
    from grpo.run.optim import build_optimizer

    def fresh():
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        return model, build_optimizer(list(model.parameters()), OptimConfig(lr=0.1))

    model, opt = fresh()
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return (model, opt), fresh()


def _same_optimizer_state(want: dict, got: dict) -> None:
    def plain(groups):  # a checkpoint stores betas as a list
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]

    assert plain(want["param_groups"]) == plain(got["param_groups"])
    assert want["state"].keys() == got["state"].keys()
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["state"][i][k]), (i, k)


def test_optimizer_state_by_position_converts_to_by_name():
    """An FSDP run resuming an unsharded run's checkpoint reads its positional optimizer state
    by parameter name; the conversion gives back the same state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from grpo.run.state import _named_optimizer_state

    (model, opt), (model2, opt2) = _trained()
    named = _named_optimizer_state(opt.state_dict(), model2, opt2)
    assert isinstance(next(iter(named["state"])), str)
    full = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model2, opt2, named, options=full)
    _same_optimizer_state(opt.state_dict(), opt2.state_dict())


def test_resume_trains_at_the_configured_lr(tmp_path, caplog):
    """The checkpoint's scheduler and optimizer carry the lr it was saved with; a resumed run
    whose config changes optim.lr (the advice after a non-finite update) trains at the new one,
    from the schedule's current step, and says so in one line. The same lr: nothing said."""
    from grpo.config import OptimConfig
    from grpo.run.optim import build_optimizer, build_scheduler, lr_lambda

    def fresh(lr):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = build_optimizer(list(model.parameters()), OptimConfig(lr=lr))
        return model, opt, build_scheduler(opt, 10, OptimConfig(lr=lr))

    model, opt, sched = fresh(1e-3)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        sched.step()
    ckpt = save_checkpoint(tmp_path, TrainState(step=3), model, opt, sched, {})
    for lr, lines in ((5e-4, 1), (1e-3, 0)):
        model2, opt2, sched2 = fresh(lr)
        caplog.clear()
        load_checkpoint(ckpt, model2, opt2, sched2)
        want = lr * lr_lambda(3, 10, OptimConfig(lr=lr))
        assert {g["lr"] for g in opt2.param_groups} == {want}  # decay and no-decay groups
        assert set(sched2.get_last_lr()) == {want}
        said = [r.getMessage() for r in caplog.records if "optim.lr" in r.getMessage()]
        assert len(said) == lines, said
    assert said == [] and "replaces the checkpoint's 0.001" not in caplog.text
    sched2.step()  # the schedule goes on from the new base
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_lambda(4, 10, OptimConfig()))


def test_sharded_checkpoint_round_trip_and_verify(tmp_path):
    """The FSDP format (shards/ written by torch.distributed.checkpoint's safetensors storage,
    here from one process): saved atomically with a manifest over every shard, loaded into an
    unsharded model and optimizer exactly, read back by `checkpoint_weights`, and skipped with
    a reason when a shard is truncated."""
    from grpo.run.state import checkpoint_tmp, prepare_tmp, save_shards, verify_checkpoint

    (model, opt), (model2, opt2) = _trained()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    tmp = checkpoint_tmp(tmp_path, 2)
    prepare_tmp(tmp)
    groups = save_shards(tmp, model, opt)
    ckpt = save_checkpoint(
        tmp_path, TrainState(step=2), model, opt, sched, {}, sharded=(tmp, groups)
    )
    assert not (ckpt / "trainable.safetensors").exists() and list((ckpt / "shards").iterdir())
    assert verify_checkpoint(ckpt) is None and not tmp.exists()
    manifest = json.loads((ckpt / "manifest.json").read_text())["sizes"]
    assert any(name.startswith("shards/") for name in manifest)
    state = load_checkpoint(
        ckpt, model2, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda _: 1.0)
    )
    assert state.step == 2
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a, b), n
    _same_optimizer_state(opt.state_dict(), opt2.state_dict())
    weights = checkpoint_weights(ckpt)
    assert weights.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    shard = sorted((ckpt / "shards").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-8])
    assert "has" in verify_checkpoint(ckpt) and "truncated" in verify_checkpoint(ckpt)
    assert latest_checkpoint(tmp_path) is None  # the only checkpoint is skipped


# ----------------------------------------------------------------- atomic checkpoints

SAVE_SCRIPT = """
import sys, time, torch
from grpo.run import state as st
root = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
st.save_checkpoint(root, st.TrainState(step=1), model, opt, sched, {})
real_save = torch.save
def stalled(*a, **k):
    real_save(*a, **k)
    print("IN_SAVE", flush=True)
    time.sleep(120)
st.torch.save = stalled
with torch.no_grad():
    model.weight.add_(1.0)
st.save_checkpoint(root, st.TrainState(step=2), model, opt, sched, {})
"""


def tiny_training_objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def test_kill_inside_save_keeps_latest_readable(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", SAVE_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "IN_SAVE"  # step 2 is half written
    p.kill()
    p.wait()
    assert list((tmp_path / "checkpoints").glob(".tmp-*"))  # the torn save is there...
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_000001"  # ...but latest is the good one
    model, opt, sched = tiny_training_objects()
    with torch.no_grad():
        model.weight.zero_()
    assert load_checkpoint(ckpt, model, opt, sched).step == 1
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(4, 4).weight)  # step-1 weights back
    save_checkpoint(tmp_path, TrainState(step=3), model, opt, sched, {})
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # cleaned by the next save


def test_failing_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import grpo.run.state as st

    model, opt, sched = tiny_training_objects()
    save_checkpoint(tmp_path, TrainState(step=1), model, opt, sched, {})

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_safetensors", no_space)
    with pytest.raises(GrpoError, match="could not write checkpoint .*No space left on device"):
        save_checkpoint(tmp_path, TrainState(step=2), model, opt, sched, {})
    assert latest_checkpoint(tmp_path).name == "step_000001"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_000001",
    ]


def test_keep_last_k(tmp_path):
    model, opt, sched = tiny_training_objects()
    for step in range(1, 5):
        save_checkpoint(tmp_path, TrainState(step=step), model, opt, sched, {}, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000003", "step_000004"]


# ----------------------------------------------------------------- non-finite guard


def test_nonfinite_updates_are_skipped_then_stop(model_dir, tmp_path, monkeypatch):
    import grpo.train.grpo as g
    from grpo.config import load_config

    real = g.policy_loss_on_device

    def nan_loss(*a, **k):
        loss, stats, bad_row = real(*a, **k)
        return loss * float("nan"), stats, bad_row

    monkeypatch.setattr(g, "policy_loss_on_device", nan_loss)
    overrides = [
        f"model.path={model_dir}",
        f"train.output_dir={tmp_path}/run",
        "train.progress=false",
        "data.eval_samples=0",
        "loss.num_iterations=1",
        "train.max_nonfinite_steps=2",
    ]
    cfg = load_config(TINY_CI, overrides)
    with pytest.raises(GrpoError, match="2 consecutive updates had a non-finite loss") as e:
        g.train_grpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/nonfinite_skipped"] for r in rows] == [1, 1]  # logged and counted
    # no update was applied: the weights are intact, saved before the stop (tests/test_guards.py)
    assert latest_checkpoint(tmp_path / "run").name == "step_000002"
    assert "checkpoint saved in " in str(e.value) and "--resume" in str(e.value)


def _nan_sft_or_rm(recipe: str, model: Path, tmp_path: Path, monkeypatch):
    """`train_sft` / `train_rm` with every loss NaN (skipped updates), and its config."""
    from grpo.config import load_config

    common = [
        f"model.path={model}",
        f"train.output_dir={tmp_path}/run",
        "train.progress=false",
        "train.max_steps=4",
        "train.max_nonfinite_steps=2",
        "train.save_every=0",
        "data.eval_samples=0",
        "train.epochs=null",
        "train.log_every=1",
    ]
    if recipe == "sft":
        import grpo.train.sft as mod

        real = mod.sft_loss

        def nan_loss(*a, **k):
            loss, n = real(*a, **k)
            return loss * float("nan"), n

        monkeypatch.setattr(mod, "sft_loss", nan_loss)
        cfg = load_config(
            REPO / "configs" / "gsm8k_qwen3_0.6b_sft.yaml",
            [
                *common,
                f"data.source={REPO / 'tests' / 'data' / 'gsm8k'}",
                "data.split=test",
                "data.max_samples=8",
                "train.batch_size=2",
                "rollout.max_new_tokens=12",
            ],
        )
        return mod.train_sft, cfg
    import grpo.train.rm as mod

    real = mod.pair_loss
    monkeypatch.setattr(mod, "pair_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    rows = [
        {
            "chosen": [
                {"role": "user", "content": f"Is {i} even?"},
                {"role": "assistant", "content": "yes"},
            ],
            "rejected": [
                {"role": "user", "content": f"Is {i} even?"},
                {"role": "assistant", "content": "no"},
            ],
        }
        for i in range(8)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        REPO / "configs" / "rm_qwen3_0.6b.yaml",
        [
            *common,
            f"data.dataset={data}",
            "data.split=train",
            "train.batch_size=4",
            "rm.max_length=64",
        ],
    )
    return mod.train_rm, cfg


@pytest.mark.parametrize("recipe", ["sft", pytest.param("rm", marks=pytest.mark.process)])
def test_sft_and_rm_save_before_a_nonfinite_stop(recipe, shared_tiny_model, tmp_path, monkeypatch):
    """As GRPO does: train.max_nonfinite_steps skipped updates in a row stop the run through
    the guard, which checkpoints first (the weights are those of the last update applied) and
    names the resume command; the skipped steps are logged."""
    from grpo.run.loop import GuardStop

    train, cfg = _nan_sft_or_rm(recipe, shared_tiny_model, tmp_path, monkeypatch)
    with pytest.raises(GuardStop, match="2 consecutive updates had a non-finite loss") as e:
        train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/nonfinite_skipped"] for r in rows] == [1, 1]
    assert latest_checkpoint(tmp_path / "run").name == "step_000002"  # save_every=0: the guard's
    assert "checkpoint saved in " in str(e.value) and "--resume" in str(e.value)


def nan_at_update(k: int):
    """`build_optimizer` whose k-th optimizer step (1-based) leaves a weight NaN, as an lr far
    too large or an fp16 overflow would."""
    from grpo.run.optim import build_optimizer

    def build(params, cfg):
        opt = build_optimizer(params, cfg)
        calls = [0]

        def after_step(opt, args, kwargs):
            calls[0] += 1
            if calls[0] == k:
                with torch.no_grad():
                    opt.param_groups[0]["params"][0].view(-1)[0] = float("nan")

        opt.register_step_post_hook(after_step)
        return opt

    return build


@pytest.mark.parametrize(
    "command, extra", [("train", ["loss.num_iterations=1"]), ("sft", ["lora.enabled=false"])]
)
def test_nonfinite_weights_stop_the_run_at_that_step(
    model_dir, tmp_path, capsys, monkeypatch, command, extra
):
    """An update that leaves a weight NaN stops the run at that step in one line naming the
    step, its loss, grad norm and lr; the checkpoint before it stays, no final/ is written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("grpo.run.loop.build_optimizer", nan_at_update(2))
    args = [
        command,
        "--config",
        TINY_CI,
        f"model.path={model_dir}",
        *FAST,
        *extra,
        "train.max_steps=3",
        "train.output_dir=run",
    ]
    code = cli.main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(
        f"grpo {command}: error: step 2: the weights are not finite after the update (loss "
    ), err
    # lr: update 2 of 3 on the cosine from 1e-3: 1e-3 * (1 + cos(pi / 3)) / 2
    assert ", grad norm " in err and ", lr 0.00075); lower optim.lr" in err, err
    run = tmp_path / "run"
    assert latest_checkpoint(run).name == "step_000001" and not (run / "final").exists()
    assert all(torch.isfinite(w).all() for w in final_weights(run, 1).values())


def test_optimizer_settings_that_cannot_train_are_refused():
    from grpo.config import OptimConfig
    from grpo.settings import ConfigError

    with pytest.raises(ConfigError, match=r"^optim.lr: must be <= 1 \(AdamW moves every"):
        OptimConfig(lr=1e30)
    with pytest.raises(ConfigError, match=r"^optim.weight_decay: times optim.lr must be < 1"):
        OptimConfig(lr=0.5, weight_decay=2.0)
    OptimConfig(lr=1.0, weight_decay=0.5)  # the bounds themselves are fine


# ----------------------------------------------------------------- resume at or past the end


def run_files(run: Path) -> dict:
    """Every path under `run` (and `run` itself) with its modification time and size."""
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in [run, *run.rglob("*")]}


def test_resume_at_or_past_max_steps(model_dir, tmp_path, capsys, monkeypatch):
    """--resume with train.max_steps below the checkpoint: one line, exit 2; at it with final/
    written: "nothing to do", exit 0; neither writes anything. At it without final/ (killed
    between the last checkpoint and the final save) the run writes final/ and ends."""
    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={model_dir}",
        *FAST,
        "loss.num_iterations=1",
        "train.output_dir=run",
    ]
    assert cli.main([*args, "train.max_steps=2"]) == 0
    capsys.readouterr()
    run = tmp_path / "run"
    before, digest = run_files(run), tree_digest(run)

    code = cli.main([*args, "train.max_steps=1", "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "grpo train: error: --resume: the run is at step 2 (run/checkpoints/step_000002), past "
        "train.max_steps=1; a resumed run cannot go back: raise the limit above 2 to continue "
        "it, or start afresh with --overwrite or another train.output_dir"
    ), err
    assert run_files(run) == before and tree_digest(run) == digest

    code = cli.main([*args, "train.max_steps=2", "--resume"])
    out = capsys.readouterr()
    assert code == 0 and out.out == "", out
    assert out.err.strip() == (
        "grpo train: nothing to do: the run already reached "
        "train.max_steps=2 (weights in run/final); raise it to train "
        "further"
    )
    assert run_files(run) == before and tree_digest(run) == digest

    final = tree_digest(run / "final")
    shutil.rmtree(run / "final")
    assert cli.main([*args, "train.max_steps=2", "--resume"]) == 0
    assert capsys.readouterr().out.strip() == "done: 2 steps; weights in run/final"
    assert tree_digest(run / "final") == final  # the same weights, written again
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


# ----------------------------------------------------------------- bad-input matrix

REWARDS = """
def raises(completions, **columns):
    raise RuntimeError("kaboom")
def short(completions, **columns):
    return [0.0]
def nan(completions, **columns):
    return [float("nan")] * len(completions)
def sleeps(completions, **columns):
    import time
    time.sleep(5)  # past its timeout_s: left running in a daemon thread
    return [0.0] * len(completions)
def adv_raises(scores, mask, *, group_size):
    raise ValueError("no advantage today")
def loss_raises(logprobs, advantages):
    raise ValueError("no loss today")
def kl_raises(logprobs, ref_logprobs):
    raise ValueError("no KL today")
class Hangs:
    tools = []
    def start(self, row):
        return None
    def step(self, text, token_ids):
        import time
        time.sleep(5)  # past rollout.env_timeout_s
        from grpo.envs import Step
        return Step(done=True)
"""


@pytest.fixture(scope="module")
def bad_inputs(model_dir, tmp_path_factory):
    """Files the matrix points at, and an existing run whose checkpoint must survive."""
    d = tmp_path_factory.mktemp("bad")
    (d / "rewards_mod.py").write_text(REWARDS)
    (d / "empty.jsonl").write_text("")
    (d / "broken.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": \n')
    (d / "nocols.jsonl").write_text('{"prompt": "1+1?", "solution": "2"}\n')
    (d / "gpt2").mkdir()
    (d / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    shutil.copytree(model_dir, d / "nochat")
    (d / "nochat" / "chat_template.jinja").unlink()
    tc = json.loads((d / "nochat" / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (d / "nochat" / "tokenizer_config.json").write_text(json.dumps(tc))
    # an adapter of a wider model (C=192) cannot fit the C=64 tiny model
    from grpo.lora import apply_lora, save_adapter
    from grpo.models import load_model

    wide = load_model(make_tiny_model(d / "wide", size="demo"))
    apply_lora(wide, rank=4, alpha=8, targets=["q_proj"])
    save_adapter(wide, d / "wide_adapter")
    (d / "bad.yaml").write_text("model: {path: x\n  lora: [")
    # an existing run with a checkpoint, as the target of every failing case
    model, opt, sched = tiny_training_objects()
    save_checkpoint(d / "run", TrainState(step=7), model, opt, sched, {"ok": True})
    return d


def matrix(d: Path, m: Path):
    """(name, extra CLI args, expected message fragment) for `grpo train --config tiny_ci`."""
    fresh = f"train.output_dir={d}/started"
    return [
        ("unknown key", ["optim.lrr=1"], "optim.lrr: unknown key; valid keys of optim"),
        ("wrong type", ["train.max_steps=abc"], "train.max_steps: expected an integer"),
        ("group size 1", ["rollout.group_size=1"], "rollout.group_size: must be >= 2"),
        ("negative lr", ["optim.lr=-0.1"], "optim.lr: must be > 0"),
        ("epsilon 0", ["loss.epsilon_low=0"], "loss.epsilon_low: must be > 0"),
        (
            "batch vs group",
            ["train.batch_size=6", "train.micro_batch_size=3"],
            "not divisible by rollout.group_size",
        ),
        ("missing model", ["model.path=/nonexistent/model"], "is not a directory or a hub id"),
        ("unsupported arch", [f"model.path={d}/gpt2"], "unsupported architecture 'GPT2LMHead"),
        ("no chat template", [f"model.path={d}/nochat"], "has no chat template"),
        ("missing dataset", [f"data.dataset={d}/missing.jsonl"], "missing.jsonl"),
        ("empty dataset", [f"data.dataset={d}/empty.jsonl"], "empty.jsonl"),
        ("malformed json", [f"data.dataset={d}/broken.jsonl"], "broken.jsonl"),
        ("lacking columns", [f"data.dataset={d}/nocols.jsonl"], "question"),
        ("prompt too long", ["data.max_prompt_len=4"], "data.max_prompt_len 4"),
        ("unknown reward", ["rewards=[{name: acuracy}]"], "acuracy"),
        ("reward import", ["rewards=[{name: 'no_such_mod:fn'}]"], "no_such_mod"),
        # rewards fail inside the first step, after the run has started: in a directory of
        # their own (with --overwrite, the existing run would have been replaced by then)
        ("reward raises", ["rewards=[{name: 'rewards_mod:raises'}]", fresh], "kaboom"),
        ("reward length", ["rewards=[{name: 'rewards_mod:short'}]", fresh], "short"),
        ("reward nan", ["rewards=[{name: 'rewards_mod:nan'}]", fresh], "nan"),
        # no hang: a reward or an environment past its time limit (issue #31)
        (
            "reward hangs",
            ["rewards=[{name: 'rewards_mod:sleeps', timeout_s: 0.5}]", fresh],
            "reward function 'sleeps' did not return within its timeout_s=0.5 s",
        ),
        (
            "environment hangs",
            ["rollout.env=rewards_mod:Hangs", "rollout.env_timeout_s=0.5", fresh],
            "environment 'rewards_mod:Hangs': step() of trajectory 0 (turn 1) did not return "
            "within rollout.env_timeout_s=0.5 s",
        ),
        # a plug-in that raises is one line naming it, like a reward
        (
            "advantage raises",
            ["loss.advantage=rewards_mod:adv_raises", fresh],
            "step 1: advantage estimator 'rewards_mod:adv_raises' raised ValueError: no advantage",
        ),
        (
            "policy loss raises",
            ["loss.policy_loss=rewards_mod:loss_raises", fresh],
            "step 1: policy loss 'rewards_mod:loss_raises' raised ValueError: no loss today",
        ),
        (
            "KL raises",
            ["loss.kl_estimator=rewards_mod:kl_raises", fresh],
            "step 1: KL estimator 'rewards_mod:kl_raises' raised ValueError: no KL today",
        ),
        # settings that cannot train: AdamW moves every weight by about lr per update
        ("lr huge", ["optim.lr=1e30"], "optim.lr: must be <= 1"),
        ("adapter misfit", [f"lora.adapter={d}/wide_adapter"], "shape (4, 192), expected (4, 64)"),
        ("no checkpoint", ["train.output_dir=" + str(d / "fresh"), "--resume"], "no checkpoint"),
    ]


def test_bad_input_matrix(model_dir, bad_inputs, capsys, monkeypatch):
    d = bad_inputs
    monkeypatch.syspath_prepend(str(d))
    before = tree_digest(d / "run")
    base = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={model_dir}",
        f"train.output_dir={d}/run",
        "train.progress=false",
        "data.eval_samples=0",
    ]
    results = []
    for name, extra, expect in matrix(d, model_dir):
        # --overwrite gets past the refusal of a used directory (tests/test_rundir.py) to the
        # case's own check, which fails before anything, clearing included, is written
        code = cli.main(base + extra + ([] if "--resume" in extra else ["--overwrite"]))
        err = capsys.readouterr().err.strip()
        results.append(name)
        assert code == 2, (name, err)
        assert len(err.splitlines()) == 1, (name, err)
        assert "Traceback" not in err, name
        assert expect.lower() in err.lower(), (name, err)
        assert tree_digest(d / "run") == before, f"{name} touched the existing checkpoint"
    code = cli.main(["train", "--config", str(d / "bad.yaml")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is not valid YAML" in err and len(err.splitlines()) == 1
    code = cli.main(["train", "--config", str(d / "nope.yaml")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not exist" in err
    assert len(results) + 2 >= 20


def test_bad_input_through_a_real_process(model_dir, tmp_path):
    r = subprocess.run(
        grpo_cmd("train", "--config", TINY_CI, f"model.path={model_dir}", "rollout.group_size=1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "grpo train: error: rollout.group_size: must be >= 2, got 1"
    ]


# ----------------------------------------------------------------- long phases, signals

# Its first call writes its pid to HANDSHAKE_DIR/ready and waits for HANDSHAKE_DIR/go: the test
# then knows the process is inside the call.
HANDSHAKE = """
import os, time
from pathlib import Path
def length(completions, **_):
    d = Path(os.environ["HANDSHAKE_DIR"])
    if not (d / "ready").exists():
        (d / "ready").write_text(str(os.getpid()))
        deadline = time.time() + 120
        while not (d / "go").exists() and time.time() < deadline:
            time.sleep(0.01)
    return [len(c) / 50 for c in completions]
"""


@pytest.mark.process
def test_sigterm_in_an_evaluation_stage_records_interrupted(model_dir, tmp_path):
    """`grpo pipeline` SIGTERMed inside its SFT evaluation (in the stage's reward, which runs
    in a worker thread under its timeout): one line, exit 143, the stage and the pipeline
    "interrupted" in training_results.json, SFT's results kept."""
    (tmp_path / "handshake_reward.py").write_text(HANDSHAKE)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(tmp_path),
        "HANDSHAKE_DIR": str(tmp_path),
    }
    cmd = [
        sys.executable,
        "-m",
        "grpo",
        "pipeline",
        "--config",
        str(REPO / "configs" / "pipeline_tiny.yaml"),
        f"model.path={model_dir}",
        "output_dir=out",
        "eval.max_samples=4",
        "sft.rewards=[{name: 'handshake_reward:length'}]",
    ]
    p = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 240
        while not (tmp_path / "ready").exists():  # inside sft_eval's reward
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        (tmp_path / "go").touch()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    results_file = tmp_path / "out" / "training_results.json"
    ours = [line for line in err.splitlines() if line.startswith("grpo pipeline:")]
    assert ours == [
        "grpo pipeline: interrupted by SIGTERM in stage 'sft_eval' (results of "
        f"earlier stages kept in {Path('out') / 'training_results.json'})"
    ], err
    assert "Traceback" not in err
    results = json.loads(results_file.read_text())
    assert results["status"] == "interrupted" and results["failed_stage"] == "sft_eval"
    stages = results["stages"]
    assert stages["sft"]["status"] == "done"
    assert (tmp_path / stages["sft"]["paths"]["final"] / "adapter_model.safetensors").is_file()
    assert stages["sft_eval"]["status"] == "interrupted"
    assert stages["sft_eval"]["error"] == "interrupted by SIGTERM"
    assert list(stages) == ["prepare_data", "sft", "sft_eval"]


def test_long_phases_show_progress(model_dir, tmp_path, capsys, monkeypatch):
    """train.progress shows a bar for the rollout (its decode steps) and, with more than one
    micro-batch, the reference, old log-probs and update passes, once a phase has run
    PHASE_BAR_DELAY_S (0 here); at the default delay a quick step shows none of them."""
    import grpo.run.perf as perf

    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={model_dir}",
        "data.eval_samples=0",
        "train.max_steps=1",
        "loss.old_logprobs=recompute",
        "train.micro_batch_size=4",
        "train.progress=true",
    ]
    phases = ["rollout (8 rows)", "reference log-probs", "old log-probs", "update"]
    assert cli.main([*args, "train.output_dir=quick"]) == 0
    err = capsys.readouterr().err
    assert "grpo" in err and not any(f"{name}:" in err for name in phases), err[-2000:]
    monkeypatch.setattr(perf, "PHASE_BAR_DELAY_S", 0.0)
    assert cli.main([*args, "train.output_dir=shown"]) == 0
    err = capsys.readouterr().err
    for name in phases:
        assert f"{name}:" in err, (name, err[-2000:])
    assert cli.main([*args, "train.output_dir=silent", "train.progress=false"]) == 0
    assert not any(f"{name}:" in capsys.readouterr().err for name in phases)


# ----------------------------------------------------------------- grpo merge: inputs and output


@pytest.fixture
def merge_inputs(model_dir, tmp_path):
    """root/base (a model), root/adapter (a LoRA adapter for it), root/old (an earlier output
    with a stale file) and root/notes.txt (a file)."""
    from grpo.lora import save_adapter
    from grpo.models import load_model

    shutil.copytree(model_dir, tmp_path / "base")
    model = load_model(tmp_path / "base")
    live_lora(model, ["q_proj", "v_proj"], std=0.1, seed=1)
    save_adapter(model, tmp_path / "adapter")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "stale.bin").write_bytes(b"from an earlier merge")
    (tmp_path / "notes.txt").write_text("not a directory")
    return tmp_path


def merge_argv(root: Path, out: Path, *extra: str) -> list[str]:
    return [
        "merge",
        "--model",
        str(root / "base"),
        "--adapter",
        str(root / "adapter"),
        "--out",
        str(out),
        *extra,
    ]


MERGE_REFUSALS = [
    ("out is the model", "base", [], "is the --model directory"),
    ("out inside the model", "base/merged", ["--overwrite"], "is inside the --model directory"),
    ("out is the adapter", "adapter", ["--overwrite"], "is the --adapter directory"),
    ("out inside the adapter", "adapter/sub", [], "is inside the --adapter directory"),
    ("out contains the inputs", ".", ["--overwrite"], "contains the --model directory"),
    ("non-empty out", "old", [], "is not empty (1 entries); pass --overwrite"),
    ("out is a file", "notes.txt", ["--overwrite"], "exists and is not a directory"),
]


@pytest.mark.parametrize(
    "name, out, extra, expect", MERGE_REFUSALS, ids=[c[0] for c in MERGE_REFUSALS]
)
def test_merge_refuses_outputs_that_would_destroy_something(
    merge_inputs, capsys, name, out, extra, expect
):
    root = merge_inputs
    before = tree_digest(root)
    code = cli.main(merge_argv(root, root / out, *extra))
    err = capsys.readouterr().err.strip()
    assert code == 2, (name, err)
    assert len(err.splitlines()) == 1 and err.startswith("grpo merge: error: --out "), err
    assert expect in err, (name, err)
    assert tree_digest(root) == before, f"{name}: something on disk changed"


def test_merge_refuses_an_adapter_of_another_base(merge_inputs, capsys):
    """An adapter whose adapter_config.json names another base than --model (issue 64: it
    was folded in silently): one line naming both, nothing written; the same directory by
    another path merges; --any-base merges anyway. A non-causal-LM task_type is refused."""
    root = merge_inputs
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    other = {**config, "base_model_name_or_path": "Qwen/Qwen3-0.6B"}
    (root / "adapter" / "adapter_config.json").write_text(json.dumps(other))
    before = tree_digest(root)
    assert cli.main(merge_argv(root, root / "out")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo merge: error: --adapter "), err
    assert "was trained on 'Qwen/Qwen3-0.6B'" in err and f"not --model {root / 'base'}" in err
    assert "--any-base" in err and tree_digest(root) == before
    assert cli.main(merge_argv(root, root / "out", "--any-base")) == 0
    same = {**config, "base_model_name_or_path": str(root / "old" / ".." / "base")}
    (root / "adapter" / "adapter_config.json").write_text(json.dumps(same))
    assert cli.main(merge_argv(root, root / "out2")) == 0
    seq_cls = {**same, "task_type": "SEQ_CLS"}
    (root / "adapter" / "adapter_config.json").write_text(json.dumps(seq_cls))
    capsys.readouterr()
    assert cli.main(merge_argv(root, root / "out3")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task_type 'SEQ_CLS'" in err, err
    assert not (root / "out3").exists()


def test_merge_overwrite_replaces_the_contents(merge_inputs, capsys):
    from grpo.models import load_model

    root = merge_inputs
    inputs = tree_digest(root / "base"), tree_digest(root / "adapter")
    (root / "empty").mkdir()
    assert cli.main(merge_argv(root, root / "empty")) == 0  # an empty directory needs no flag
    assert cli.main(merge_argv(root, root / "old", "--overwrite")) == 0
    capsys.readouterr()
    assert not (root / "old" / "stale.bin").exists()  # cleared, not mixed
    assert sorted(p.name for p in (root / "old").iterdir()) == sorted(
        p.name for p in (root / "empty").iterdir()
    )
    assert not list(root.glob(".*merge-tmp*"))  # no temporary left beside it
    a, b = load_model(root / "old"), load_model(root / "empty")
    base = load_model(root / "base")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    q_proj = a.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj, base.layers[0].self_attn.q_proj.weight)  # merged in
    assert (tree_digest(root / "base"), tree_digest(root / "adapter")) == inputs
