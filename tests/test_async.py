"""Asynchronous rollouts (rollout.async): batch j is sampled by the policy of update
max(start, j - k), so with max_staleness 0 the run is bitwise the synchronous one (colocated
in one process, and with producer ranks under torchrun), with k > 0 every consumed batch is
exactly min(j, k) updates old and keeps the log-probs of the policy that sampled it; faults
(a producer that raises, hangs or dies, kill -9, SIGTERM) end in one line or a clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.apps import cli
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.metrics import read_metrics
from grpo.rewards import register_reward

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
FAST = [
    "train.progress=false",
    "data.eval_samples=0",
    "rollout.compile=off",
    "data.max_samples=32",
    "train.save_every=0",
    "train.log_every=1",
]


def reply_length(completions, **_):
    """A reward with spread, so every update moves the weights."""
    return [len(c) / 50 for c in completions]


# registered here for in-process runs; a torchrun job's processes import this module for it
register_reward("test_async_length", reply_length, overwrite=True)
REWARD = "rewards=[{name: test_async_length}]"
REWARD_MODULE = "plugins=[test_async]"


def config(model, out, *overrides):
    return load_config(
        TINY_CI, [f"model.path={model}", f"train.output_dir={out}", *FAST, REWARD, *overrides]
    )


def train(model, out, *overrides) -> tuple[dict, list[dict]]:
    from grpo.train.grpo import train_grpo

    cfg = config(model, out, *overrides)
    final = Path(train_grpo(cfg, overwrite=True)["final"])
    name = "adapter_model.safetensors" if cfg.lora.enabled else "model.safetensors"
    return load_file(final / name), read_metrics(Path(out) / "metrics.jsonl")


def same_run(a, b) -> None:
    """Bitwise the same weights, and every metric the synchronous run logs (timings aside, how
    the reward's code was loaded: a plugin module under torchrun, registered here, and how the
    start began: `run/start`)."""
    (wa, ma), (wb, mb) = a, b
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert len(ma) == len(mb)
    loading = ("run/plugins", "run/replaced", "run/start")  # how each start began differs
    for ra, rb in zip(ma, mb):
        differ = {
            k: (v, rb.get(k))
            for k, v in ra.items()
            if not k.startswith("perf/") and k not in loading and rb.get(k) != v
        }
        assert not differ, (ra["step"], differ)


@pytest.mark.parametrize(
    "case",
    [
        ["train.max_steps=3"],  # LoRA, KL to the reference, 2 passes, 2 micro-batches
        [
            "train.max_steps=3",
            "lora.enabled=false",
            "rollout.dynamic_sampling=true",
            "rollout.max_sampling_rounds=3",
            "loss.num_iterations=1",
            "optim.lr=1e-4",
        ],
        ["train.max_steps=3", "model.autocast_bf16=true"],
    ],  # the tutorial's precision
    ids=["lora-kl-2passes", "full-dynamic-sampling", "lora-bf16-autocast"],
)
def test_staleness_zero_is_the_synchronous_run_bitwise(shared_tiny_model, tmp_path, case):
    sync = train(shared_tiny_model, tmp_path / "sync", *case)
    async0 = train(
        shared_tiny_model, tmp_path / "async", *case, "rollout.async=on", "rollout.max_staleness=0"
    )
    same_run(sync, async0)
    assert [r["async/staleness"] for r in async0[1]] == [0, 0, 0]
    start = load_file(shared_tiny_model / "model.safetensors")
    if "lora.enabled=false" in case:  # the updates moved the weights: the check has teeth
        assert any(not torch.equal(v, start[k]) for k, v in sync[0].items() if k in start)


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_is_exactly_min_j_k_updates_old(shared_tiny_model, tmp_path, k):
    steps = ["train.max_steps=4", "loss.num_iterations=1", "loss.beta=0"]
    sync = train(shared_tiny_model, tmp_path / "sync", *steps)
    stale = train(
        shared_tiny_model,
        tmp_path / "stale",
        *steps,
        "rollout.async=on",
        f"rollout.max_staleness={k}",
    )
    assert [r["async/staleness"] for r in stale[1]] == [min(j, k) for j in range(4)]
    # log pi_theta - log pi_behaviour at the first pass (the log-ratio the clipped loss
    # starts from, old_logprobs: sampler): 0 up to float noise while the sampler was the
    # current policy, clearly not once the batch is older
    diffs = [r["rollout/logprob_diff_max"] for r in stale[1]]
    assert diffs[0] < 1e-5 and all(d > 1e-3 for d in diffs[1:]), diffs
    assert max(r["rollout/logprob_diff_max"] for r in sync[1]) < 1e-5
    assert not all(torch.equal(sync[0][n], stale[0][n]) for n in sync[0])


def test_truncated_is_weights_against_the_behaviour_policy(shared_tiny_model, tmp_path):
    """loss.tis_cap (old_logprobs: recompute): the loss weighs each token by
    min(pi_old / pi_behaviour, cap) where pi_behaviour is the policy that sampled the batch:
    1 on the first, fresh batch, not 1 on the stale ones."""
    _, rows = train(
        shared_tiny_model,
        tmp_path / "tis",
        "train.max_steps=3",
        "loss.num_iterations=1",
        "rollout.async=on",
        "rollout.max_staleness=1",
        "loss.tis_cap=2.0",
    )
    w = [r["train/tis_weight_mean"] for r in rows]
    assert abs(w[0] - 1) < 1e-6 and all(abs(x - 1) > 1e-5 for x in w[1:]), w


def test_batches_keep_the_log_probs_of_the_policy_that_sampled_them(shared_tiny_model):
    """Colocated producer, k = 1: batch 1 is sampled by version 0 although version 1 is
    published, batch 2 by version 1; each batch's log-probs are those its sampling policy
    gives (recomputed by the trainer's scorer), not the newer policy's."""
    from grpo.algo.logprobs import CompletionLogprobs
    from grpo.experience.batch import counted_mask, micro_batch_plan
    from grpo.experience.inline import make_sampler
    from grpo.experience.producer import ColocatedRollouts
    from grpo.loading import load_rows
    from grpo.policy import build_policy
    from grpo.rewards import build_rewards
    from grpo.run.state import TrainState
    from grpo.train.grpo import micro_logprobs

    cfg = config(
        shared_tiny_model,
        "unused",
        "rollout.async=on",
        "rollout.max_staleness=1",
        "train.max_steps=3",
    ).check_grpo()
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    policy.model.eval()
    rows = load_rows(cfg.data, cfg.data.split, cfg.data.max_samples, "rl", policy.tokenizer)
    fns = build_rewards([r.spec for r in cfg.rewards])
    state = TrainState()

    def scored(batch):
        r = batch.rollout
        mask = counted_mask(r, False)
        scorer = CompletionLogprobs(policy.model, policy.precision)
        with torch.no_grad():
            return torch.cat(
                [micro_logprobs(cfg, scorer, r, mask, mb) for mb in micro_batch_plan(r, 4)]
            ), mask

    def update(version):  # what an optimizer step does to the adapters, by hand
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in policy.model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
        source.published(policy.model, version)

    with ColocatedRollouts(
        cfg, policy, lambda m: make_sampler(cfg, policy, m), rows, fns, None, state
    ) as source:
        batches, versions = [], []
        for _ in range(3):
            b = source.next(state)
            versions.append(b.policy_version)
            own, mask = scored(b)  # the trainer's weights now are version `step`
            batches.append((b, own, mask))
            state.step += 1
            update(state.step)
    assert versions == [0, 0, 1]
    b0, own0, m0 = batches[0]
    assert (b0.rollout.logprobs - own0).abs()[m0].max() < 1e-5  # fresh: the trainer's own
    b1, own1, m1 = batches[1]  # sampled by version 0, scored now with version 1
    assert (b1.rollout.logprobs - own1).abs()[m1].max() > 1e-3
    assert state.data_index == 3 * (cfg.train.batch_size // cfg.rollout.group_size)


def test_rollout_batches_for_several_ranks_equal_each_rank_alone(shared_tiny_model):
    """What a producer samples for trainer ranks 0 and 1 of 2 is what each would sample for
    itself (prompts, seeds, tokens, log-probs, rewards)."""
    from grpo.experience.collect import rollout_batches
    from grpo.loading import load_rows
    from grpo.policy import build_policy
    from grpo.rewards import build_rewards
    from grpo.rollout import Sampler
    from grpo.run.state import TrainState

    cfg = config(shared_tiny_model, "unused").check_grpo()
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    policy.model.eval()
    rows = load_rows(cfg.data, cfg.data.split, cfg.data.max_samples, "rl", policy.tokenizer)
    fns = build_rewards([r.spec for r in cfg.rewards])
    sampler = Sampler(policy.model, precision=policy.precision)
    both = rollout_batches(cfg, policy, sampler, rows, TrainState(), fns, 5, [0, 1], 2)
    alone = [
        rollout_batches(cfg, policy, sampler, rows, TrainState(), fns, 5, [t], 2)[0] for t in (0, 1)
    ]
    for a, b in zip(both, alone):
        assert a.rows == b.rows and a.texts == b.texts
        assert torch.equal(a.rollout.ids, b.rollout.ids)
        assert torch.equal(a.rollout.logprobs, b.rollout.logprobs)
        assert torch.equal(a.rewards, b.rewards)
    assert both[0].rows != both[1].rows


def test_wire_round_trip_is_bitwise():
    from grpo.experience.batch import RolloutBatch
    from grpo.experience.wire import decode_header, pack_batch, unpack_batch
    from grpo.rollout import Rollout

    g = torch.Generator().manual_seed(0)
    B, T_p, T_c = 4, 3, 5
    mask = torch.rand(B, T_c, generator=g) > 0.3
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(6)]
    for multi in (False, True):
        r = Rollout(
            ids=torch.randint(0, 50, (B, T_p + T_c), generator=g),
            prompt_lens=torch.tensor([3, 3, 2, 2]),
            prompt_width=T_p,
            completion_ids=torch.randint(0, 50, (B, T_c), generator=g),
            completion_mask=mask,
            completion_lens=mask.sum(1),
            finished=torch.tensor([True, False, True, True]),
            logprobs=-torch.rand(B, T_c, generator=g),
            group_size=2,
            generated_mask=mask & (torch.rand(B, T_c, generator=g) > 0.2) if multi else None,
            turn_ids=torch.randint(-1, 2, (B, T_c), generator=g) if multi else None,
            turn_rewards=[[0.5, 1.0], [0.0], [1.0], [0.25, 0.0]] if multi else None,
            turn_texts=[[[1, 2], [3]], [[4]], [[5]], [[6], [7, 8]]] if multi else None,
            infos=[{"tool_calls": 2}, {}, {"tool_calls": 1}, {}] if multi else None,
        )
        picked = [rows[5], rows[5], rows[1], rows[1]]
        batch = RolloutBatch(
            r,
            picked,
            ["a", "b", "c", "é"],
            torch.rand(B, generator=g),
            torch.rand(B, T_c, generator=g),
            {"acc": torch.rand(B, generator=g)},
            policy_version=7,
            frac_zero_std=0.5,
        )
        header, buffer = pack_batch(batch, [5, 5, 1, 1], {"index": 9})
        h = decode_header(header)
        back = unpack_batch(h, buffer, rows)
        assert h["extra"] == {"index": 9}
        assert back.rows == picked and back.texts == batch.texts
        assert (back.policy_version, back.frac_zero_std) == (7, 0.5)
        for name in (
            "ids",
            "prompt_lens",
            "completion_ids",
            "completion_mask",
            "completion_lens",
            "finished",
            "logprobs",
            "generated_mask",
        ):
            x, y = getattr(back.rollout, name), getattr(r, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert back.rollout.multi_turn == multi
        if multi:
            assert torch.equal(back.rollout.turn_ids, r.turn_ids)
            assert back.rollout.turn_rewards == r.turn_rewards
            assert back.rollout.turn_texts == r.turn_texts and back.rollout.infos == r.infos
        assert torch.equal(back.rewards, batch.rewards)
        assert torch.equal(back.token_rewards, batch.token_rewards)
        assert torch.equal(back.per_fn["acc"], batch.per_fn["acc"])


# ----------------------------------------------------------------- faults, colocated


def one_error_line(code: int, capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert code != 0, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_producer_that_raises_stops_the_trainer_in_one_line(shared_tiny_model, tmp_path, capsys):
    calls = [0]

    def flaky(completions, **_):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("the grader fell over")
        return [len(c) / 50 for c in completions]

    register_reward("test_async_flaky", flaky, overwrite=True)
    code = cli.main(
        [
            "train",
            "--config",
            TINY_CI,
            f"model.path={shared_tiny_model}",
            *FAST,
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=4",
            "train.save_every=1",
            "rollout.async=on",
            "rewards=[{name: test_async_flaky}]",
        ]
    )
    err = one_error_line(code, capsys)
    assert "the rollout producer failed sampling the batch of step 3" in err, err
    assert "test_async_flaky" in err and "the grader fell over" in err, err
    # what was saved before stays: the checkpoint of step 2
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000002"


def test_a_producer_that_hangs_stops_the_trainer_at_the_timeout(
    shared_tiny_model, tmp_path, capsys
):
    release = [False]
    calls = [0]

    def stuck(completions, **_):
        calls[0] += 1
        while calls[0] == 2 and not release[0]:  # never returns on its own
            time.sleep(0.01)
        return [len(c) / 50 for c in completions]

    register_reward("test_async_stuck", stuck, overwrite=True)
    t0 = time.perf_counter()
    try:
        code = cli.main(
            [
                "train",
                "--config",
                TINY_CI,
                f"model.path={shared_tiny_model}",
                *FAST,
                f"train.output_dir={tmp_path / 'run'}",
                "train.max_steps=4",
                "rollout.async=on",
                "rollout.max_staleness=0",
                "rollout.async_timeout_s=2",
                "rewards=[{name: test_async_stuck}]",
            ]
        )
    finally:
        release[0] = True
    elapsed = time.perf_counter() - t0
    err = one_error_line(code, capsys)
    assert "sent no batch for step 2 within rollout.async_timeout_s=2 s" in err, err
    assert elapsed < 30, elapsed


def test_async_settings_are_checked_up_front(shared_tiny_model, tmp_path):
    from grpo.config import ConfigError
    from grpo.train.grpo import train_grpo

    with pytest.raises(ConfigError, match="rollout.ranks: 1 producer ranks need rollout.async"):
        config(shared_tiny_model, tmp_path, "rollout.ranks=1")
    with pytest.raises(ConfigError, match="rollout.async: 'on' cannot run under train.parallel"):
        config(shared_tiny_model, tmp_path, "rollout.async=on", "train.parallel=fsdp").check_grpo()
    with pytest.raises(ConfigError, match="rollout.max_staleness: must be >= 0"):
        config(shared_tiny_model, tmp_path, "rollout.max_staleness=-1")
    cfg = config(shared_tiny_model, tmp_path / "run", "rollout.async=on", "rollout.ranks=1")
    with pytest.raises(GrpoError, match="rollout.ranks=1 in a job of 1 rank.*launch with torchrun"):
        train_grpo(cfg)
    assert not (tmp_path / "run").exists()  # nothing written


KILLER = """
import os, signal
from pathlib import Path
calls = [0]
def length(completions, **_):
    calls[0] += 1
    d = os.environ.get("KILL_DIR")
    if d and calls[0] == int(os.environ["KILL_AT"]) and Path(d, "run/checkpoints/latest").exists():
        os.kill(os.getpid(), signal.SIGKILL)
    return [len(c) / 50 for c in completions]
"""


@pytest.mark.process
def test_kill_9_then_resume_consumes_each_batch_once(shared_tiny_model, tmp_path, monkeypatch):
    """kill -9 while the producer is a batch ahead; --resume restarts from the last checkpoint,
    and the data position after every step is that of a run never killed (no batch consumed
    twice, none skipped); the batches the dead producer had sampled ahead are sampled again
    (by the resumed policy: staleness 0 on the first step after the resume)."""
    (tmp_path / "killer.py").write_text(KILLER)
    args = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        *FAST,
        "train.max_steps=5",
        "train.save_every=1",
        "train.keep_last=10",
        "loss.num_iterations=1",
        "rollout.async=on",
        "rollout.max_staleness=1",
        "rewards=[{name: 'killer:length'}]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "grpo", *args, "train.output_dir=run"],
        cwd=tmp_path,
        env={**env, "KILL_DIR": str(tmp_path), "KILL_AT": "4"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    run = tmp_path / "run"
    saved = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 1 <= saved < 5
    # the resume and the run never killed: through the CLI in this process (no KILL_DIR here)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KILL_DIR", raising=False)
    assert cli.main([*args, "train.output_dir=run", "--resume"]) == 0
    assert cli.main([*args, "train.output_dir=straight"]) == 0

    def positions(d):
        out = {}
        for c in sorted((d / "checkpoints").glob("step_*")):
            s = json.loads((c / "state.json").read_text())["train_state"]
            out[s["step"]] = (s["epoch"], s["data_index"])
        return out

    assert positions(run) == positions(tmp_path / "straight")
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 6))
    stale = [r["async/staleness"] for r in rows]
    assert stale == [0] + [1] * (saved - 1) + [0] + [1] * (4 - saved), stale
    # not bitwise (docs/async.md, docs/safety.md): the batch after the resume is sampled by the
    # resumed policy, one step newer than the dead producer's; the weights stay close
    name = "adapter_model.safetensors"
    a, b = load_file(run / "final" / name), load_file(tmp_path / "straight" / "final" / name)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"kill -9 at step 4, resumed from step {saved}: max |weight diff| {diff:.3g}")
    assert 0 < diff < 1e-2, diff


# ----------------------------------------------------------------- producer ranks (torchrun)


def torchrun(n: int, cwd: Path, *args, env=None, timeout=300):
    return subprocess.run(
        [*TORCHRUN, f"--nproc_per_node={n}", "-m", "grpo", "train", "--config", TINY_CI, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.mark.process
def test_producer_rank_staleness_zero_is_the_synchronous_run_bitwise(shared_tiny_model, tmp_path):
    """1 producer rank + 1 trainer rank with max_staleness 0: bitwise the weights and metrics
    of the synchronous run (in this process with one thread, as each torchrun rank has).
    (max_staleness 1 under torchrun: test_producer_rank_faults.)"""
    r = torchrun(
        2,
        tmp_path,
        f"model.path={shared_tiny_model}",
        *FAST,
        REWARD_MODULE,
        REWARD,
        "train.max_steps=3",
        "train.output_dir=async0",
        "rollout.async=on",
        "rollout.ranks=1",
        "rollout.max_staleness=0",
        env={"PYTHONPATH": str(REPO / "tests")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rollout producer done: 3 batches sampled" in r.stdout, r.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums as a rank's
    try:
        sync = train(shared_tiny_model, tmp_path / "sync", "train.max_steps=3")
    finally:
        torch.set_num_threads(threads)
    final = tmp_path / "async0" / "final" / "adapter_model.safetensors"
    async0 = (load_file(final), read_metrics(tmp_path / "async0" / "metrics.jsonl"))
    same_run(sync, async0)
    assert [r["async/staleness"] for r in async0[1]] == [0, 0, 0]


SLOW_OR_BROKEN = """
import os, time
def length(completions, **_):
    if os.environ.get("RANK") == os.environ.get("FAIL_RANK"):
        raise ValueError("grader down on the producer")
    time.sleep(float(os.environ.get("REWARD_SLEEP", "0")))
    return [len(c) / 50 for c in completions]
"""


@pytest.mark.process
def test_producer_rank_faults(shared_tiny_model, tmp_path):
    """A producer rank whose reward raises: the job fails, its line says why and the
    trainer's line names the producer rank. SIGTERM to the job: the trainer checkpoints, the
    producer hands over what it sampled ahead, one line says how to resume, and the printed
    command (the whole job: 2 ranks) finishes the run."""
    (tmp_path / "slow_or_broken.py").write_text(SLOW_OR_BROKEN)
    common = [
        f"model.path={shared_tiny_model}",
        *FAST,
        "rollout.async=on",
        "rollout.ranks=1",
        "rewards=[{name: 'slow_or_broken:length'}]",
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    r = torchrun(2, tmp_path, *common, "train.output_dir=broken", env={**env, "FAIL_RANK": "1"})
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("grpo train:")]
    assert any("grader down on the producer" in x for x in lines), r.stderr[-3000:]
    # the trainer's line names the producer rank and the step, whichever way it learned of the
    # failure first: its receive failed, or the failure agreement reached it
    named = re.compile(
        r"rollout producer rank 1 sent no batch for step 1|"
        r"stopped: rank 1 failed \(rollout, step 1\)"
    )
    assert any(named.search(x) for x in lines), lines

    p = subprocess.Popen(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            "-m",
            "grpo",
            "train",
            "--config",
            TINY_CI,
            *common,
            "train.output_dir=run",
            "train.max_steps=5",
            "rollout.max_staleness=1",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env, "REWARD_SLEEP": "0.3"},
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=240)
    ours = [x for x in err.splitlines() if x.startswith("grpo train:")]
    assert len(ours) == 1 and "interrupted by SIGTERM at step" in ours[0], err[-3000:]
    resume = ours[0].split("resume with: ")[1]
    assert resume.startswith("torchrun --standalone --nproc_per_node=2 -m grpo train"), resume
    step = int(ours[0].split("at step ")[1].split(":")[0])
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{step:06d}"
    r = subprocess.run(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            "-m",
            "grpo",
            "train",
            "--config",
            "run/config.yaml",
            "--resume",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(metrics)
    assert [x["step"] for x in rows] == list(range(1, 6))
    # batch j is min(j - start, 1) updates old, start = 0, then the resumed step
    assert [x["async/staleness"] for x in rows] == [0] + [1] * (step - 1) + [0] + [1] * (4 - step)


def test_memory_estimate_counts_the_producer(shared_tiny_model, tmp_path):
    """Colocated: sampling runs alongside training, on a copy of the trainable weights plus up
    to k + 1 snapshots; trainer ranks of a job with producer ranks do not sample."""
    from grpo.models.config import ModelConfig
    from grpo.run.memory import estimate_memory

    mc = ModelConfig.from_hf(shared_tiny_model)
    sync = estimate_memory(config(shared_tiny_model, tmp_path), mc, "grpo")
    n_train = sync.optimizer // 16  # LoRA: float32 weights, gradients, two moments
    for k in (0, 2):
        colocated = estimate_memory(
            config(shared_tiny_model, tmp_path, "rollout.async=on", f"rollout.max_staleness={k}"),
            mc,
            "grpo",
        )
        assert colocated.rollout == 0 and sync.rollout > 0
        assert colocated.producer == sync.rollout + n_train * 4 * (k + 2)
        assert colocated.total == sync.total - max(
            sync.rollout, sync.training, sync.evaluation
        ) + colocated.producer + max(sync.training, sync.evaluation)
    ranks = estimate_memory(
        config(shared_tiny_model, tmp_path, "rollout.async=on", "rollout.ranks=1"), mc, "grpo"
    )
    assert (ranks.rollout, ranks.producer) == (0, 0)
