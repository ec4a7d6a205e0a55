"""A failure on one rank of a 2-rank torchrun job (gloo, CPU) is one `grpo train: error:` line
per rank that reports it: the rank that failed, its phase and step, and the cause as that rank
saw it (the reward's exception, the NaN, the exit, the timeout). Every rank stops, the job
exits non-zero, no traceback comes from grpo's code, and torchrun's summary carries our lines
(grpo/run/failures.py, docs/distributed.md#when-a-rank-fails)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
FAST = ["train.progress=false", "data.eval_samples=0", "data.max_samples=16"]

# each fault happens on rank 1 only, in its first reward call (the rollout phase of step 1)
FAULTS = """
import os, time

def _rank1():
    return os.environ.get("RANK") == "1"

def raises(completions, **columns):
    if _rank1():
        raise ValueError("boom on rank 1")
    return [0.0] * len(completions)

def nan(completions, **columns):
    return [float("nan") if _rank1() else 0.0 for _ in completions]

def exits(completions, **columns):
    if _rank1():
        os._exit(3)
    return [0.0] * len(completions)

def hangs(completions, **columns):
    if _rank1():
        time.sleep(3600)  # line 22
    return [0.0] * len(completions)
"""


def launch(tmp_path: Path, model: Path, *args: str, timeout: float = 120):
    """`grpo train` on 2 ranks under torchrun: (exit code, stderr, seconds)."""
    (tmp_path / "faults.py").write_text(FAULTS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    start = time.monotonic()
    r = subprocess.run(
        [
            *TORCHRUN,
            "-m",
            "grpo",
            "train",
            "--config",
            TINY_CI,
            f"model.path={model}",
            "train.output_dir=out",
            *FAST,
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return r.returncode, r.stderr, time.monotonic() - start


def our_lines(stderr: str) -> dict[int, list[str]]:
    """Our error lines on the terminal (not torchrun's summary), by the rank that printed
    them."""
    out: dict[int, list[str]] = {}
    for line in stderr.splitlines():
        m = re.match(r"grpo train: error: rank (\d+)\b", line)
        if m:
            out.setdefault(int(m.group(1)), []).append(line)
    return out


def root_cause(stderr: str) -> str:
    """torchrun's "Root Cause (first observed failure)" section."""
    return stderr.split("Root Cause (first observed failure):", 1)[1]


def check_clean(stderr: str) -> None:
    """No traceback from grpo's code: the one traceback left is torchrun's own."""
    assert not re.search(r'File "[^"]*[/\\]grpo[/\\]', stderr), stderr[-3000:]
    assert stderr.count("Traceback (most recent call last)") <= 1, stderr[-3000:]


@pytest.mark.parametrize(
    "reward, cause",
    [
        ("raises", "reward function 'raises' raised ValueError: boom on rank 1"),
        pytest.param(
            "nan", "reward function 'nan' returned nan at row 0 (", marks=pytest.mark.process
        ),
    ],
    ids=["raises", "nan"],
)
def test_rank_whose_reward_fails_names_itself_and_the_other_rank_relays_it(
    shared_tiny_model, tmp_path, reward, cause
):
    code, err, _ = launch(tmp_path, shared_tiny_model, f"rewards=[{{name: 'faults:{reward}'}}]")
    assert code != 0
    lines = our_lines(err)
    assert sorted(lines) == [0, 1] and all(len(v) == 1 for v in lines.values()), err[-3000:]
    own, relayed = lines[1][0], lines[0][0]
    assert own.startswith(f"grpo train: error: rank 1 (rollout, step 1): {cause}"), own
    mine = own.removeprefix("grpo train: error: rank 1 (rollout, step 1): ")
    assert relayed == f"grpo train: error: rank 0: stopped: rank 1 failed (rollout, step 1): {mine}"
    assert "Connection closed by peer" not in err
    assert f"traceback : {own}" in root_cause(err)  # torchrun's summary: rank 1 failed first
    check_clean(err)


@pytest.mark.process
def test_rank_that_exits_without_a_word_is_named_by_the_other(shared_tiny_model, tmp_path):
    code, err, _ = launch(tmp_path, shared_tiny_model, "rewards=[{name: 'faults:exits'}]")
    assert code != 0
    assert our_lines(err) == {
        0: [
            "grpo train: error: rank 0 (rollout, step 1): stopped: rank 1 left the job without a "
            "report (killed, os._exit or a crash; torchrun's summary gives its exit code)"
        ],
    }, err[-3000:]
    root = root_cause(err)
    assert re.search(r"rank +: 1 \(local_rank: 1\)\s+exitcode +: 3 ", root), root
    check_clean(err)


@pytest.mark.process
def test_hung_rank_is_named_by_the_rank_that_timed_out_and_says_where_it_hung(
    shared_tiny_model, tmp_path
):
    """Rank 1 sleeps in its reward for ever; rank 0 gives up after train.dist_timeout_s=4 and
    names it; torchrun's SIGTERM then stops rank 1 at once (not after torchrun's 30 s grace)
    with a line saying where it was."""
    code, err, seconds = launch(
        tmp_path, shared_tiny_model, "train.dist_timeout_s=4", "rewards=[{name: 'faults:hangs'}]"
    )
    assert code != 0
    assert our_lines(err) == {
        0: [
            "grpo train: error: rank 0 (rollout, step 1): stopped: rank 1 did not reach this "
            "collective within train.dist_timeout_s=4 s (hung or too slow)"
        ],
        1: [
            "grpo train: error: rank 1 (rollout, step 1): stopped at faults.py:22 in hangs(): "
            "rank 0 timed out waiting for it (train.dist_timeout_s=4)"
        ],
    }, err[-3000:]
    assert "traceback : grpo train: error: rank 1 (rollout, step 1)" in root_cause(err)
    assert "SIGKILL" not in err and "stopping after this step" not in err, err[-3000:]
    check_clean(err)
    assert seconds < 60, seconds


@pytest.mark.process
def test_checkpoint_of_one_rank_resumed_on_two_is_one_line(shared_tiny_model, tmp_path, capsys):
    """Saved by one process, resumed by 2 ranks: refused before the model loads, one line
    naming both world sizes, every rank exits non-zero."""
    from grpo.apps import cli

    args = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        *FAST,
        f"train.output_dir={tmp_path / 'out'}",
        "train.max_steps=1",
        "rollout.max_new_tokens=4",
    ]
    assert cli.main(args) == 0, capsys.readouterr().err[-3000:]
    code, err, _ = launch(tmp_path, shared_tiny_model, "train.max_steps=2", "--resume")
    assert code != 0
    ours = [x for x in err.splitlines() if x.startswith("grpo train:")]
    assert ours == [
        "grpo train: error: --resume: checkpoint out/checkpoints/step_000001 was saved by a job "
        "of 1 rank, this job has 2: it resumes on at most 1 rank (it holds one RNG state per "
        "rank); relaunch with --nproc_per_node=1 or without torchrun, or start afresh in "
        "another train.output_dir"
    ], err[-3000:]
    assert len(re.findall(r"exitcode +: 2 ", err)) == 2, err[-3000:]  # both ranks, our code
    assert "precision:" not in err  # no model was loaded
    check_clean(err)


# ----------------------------------------------------- the lines, in-process (a store of dicts)


class DictStore:
    """What `Failures` uses of a TCPStore."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


def rank_of(rank: int, store: DictStore, world: int = 3, phase: str = "update", step: int = 2):
    from grpo.distributed import Dist, Where
    from grpo.run.failures import Failures

    f = Failures(Dist(rank, world), Where(phase, step), "grpo train")
    f.store = store  # no process group here: the store is given
    return f


def test_lines_name_the_rank_that_failed_first_else_the_silent_one(monkeypatch):
    """3 ranks: a published failure wins over silence; without one, the rank that published
    nothing is named (after the others said they stopped), or all the silent ones; a backend
    error that is no lost peer nor timeout is this rank's own, in the backend's words."""
    from grpo.distributed import collective_failure
    from grpo.run import failures

    monkeypatch.setattr(failures, "NARROW_S", 0.2)
    store = DictStore()
    rank_of(2, store, phase="rollout", step=5)._publish(True, "ValueError: bad row 7")
    assert rank_of(0, store)._stopped("lost", 600, "Connection closed by peer") == (
        "rank 0: stopped: rank 2 failed (rollout, step 5): ValueError: bad row 7"
    )
    store = DictStore()  # rank 2 hangs: rank 1 times out first, rank 0 then finds 2 silent
    assert rank_of(1, store)._stopped("timeout", 4, "Timed out") == (
        "rank 1 (update, step 2): stopped: one of ranks 0, 2 did not reach this collective "
        "within train.dist_timeout_s=4 s (hung or too slow)"
    )
    assert rank_of(0, store)._stopped("timeout", 4, "Timed out") == (
        "rank 0 (update, step 2): stopped: rank 2 did not reach this collective within "
        "train.dist_timeout_s=4 s (hung or too slow)"
    )
    nccl = RuntimeError("[/x/ProcessGroupNCCL.cpp:3:] NCCL error: unhandled cuda error\nmore")
    assert collective_failure(nccl) == "failed"
    assert collective_failure(RuntimeError("[p.cc:553] Connection closed by peer")) == "lost"
    assert collective_failure(ValueError("timed out")) is None
    assert rank_of(1, DictStore())._stopped("failed", 4, failures._backend_line(nccl)) == (
        "rank 1 (update, step 2): a collective failed: NCCL error: unhandled cuda error"
    )


def test_signal_after_a_peer_reported_prints_where_this_rank_was_and_exits(
    monkeypatch, capfd, tmp_path
):
    """The rank others timed out on gets SIGTERM: one line with where it was stuck, exit 2;
    torchrun's error file holds it in the format torchrun reads (its own ProcessFailure)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from grpo.run import failures

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(failures.os, "_exit", exit_)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    store = DictStore()
    rank_of(0, store, world=2)._publish(False, "rank 1 did not reach ...", blames=(1,), waited=4)
    hung = rank_of(1, store, world=2, phase="rollout", step=3)
    here = f"test_rank_failures.py:{sys._getframe().f_lineno + 2}"  # the call below
    with pytest.raises(SystemExit) as stop:
        hung.on_signal(15, sys._getframe())
    line = capfd.readouterr().err.strip()
    assert stop.value.code == 2 and line == (
        f"grpo train: error: rank 1 (rollout, step 3): stopped at {here} in "
        "test_signal_after_a_peer_reported_prints_where_this_rank_was_and_exits(): rank 0 "
        "timed out waiting for it (train.dist_timeout_s=4)"
    )
    seen = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    assert seen.message["message"] == line and abs(seen.timestamp - time.time()) < 5
    assert hung.on_signal(15, None) is True  # leaving already: further signals are ignored
