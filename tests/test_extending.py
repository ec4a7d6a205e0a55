"""docs/extending.md's example runs as written: an estimator and a loss from a module outside
the package, selected from the command line; its stats reach metrics.jsonl. A broken variant
is named in one line with the step, exit 2, and the checkpoint already saved survives."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from grpo.apps import cli

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")


def doc_module() -> str:
    text = (REPO / "docs" / "extending.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "def my_adv" in block and "def my_loss" in block
    assert len(block.strip().splitlines()) <= 30  # the promise: at most 30 lines
    return block


def train(model, *overrides) -> int:
    """`grpo train` of tiny_ci in this process (in the `my_pkg` fixture's directory); the exit
    code."""
    return cli.main(
        [
            "train",
            "--config",
            TINY,
            f"model.path={model}",
            "train.progress=false",
            "data.eval_samples=0",
            *overrides,
        ]
    )


@pytest.fixture()
def my_pkg(tmp_path, monkeypatch):
    """tmp_path, the working directory, first on sys.path, holding the docs' module as
    my_pkg/my_mod.py (imported afresh: not another test's my_pkg)."""
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "my_mod.py").write_text(doc_module())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_extending_example_runs_end_to_end(my_pkg, shared_tiny_model, capsys):
    code = train(
        shared_tiny_model,
        "train.output_dir=run",
        "train.max_steps=2",
        "loss.advantage=my_pkg.my_mod:my_adv",
        "loss.policy_loss=my_pkg.my_mod:my_loss",
        "loss.policy_loss_kwargs={cap: 1.5}",
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    lines = (my_pkg / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 2
    for row in rows:
        assert 0 < row["train/weight_mean"] <= row["train/weight_max"] <= 1.5
    saved = (my_pkg / "run" / "config.yaml").read_text()
    assert "my_pkg.my_mod:my_adv" in saved and "cap: 1.5" in saved


def test_bad_kwarg_fails_before_anything_is_written(my_pkg, shared_tiny_model, capsys, caplog):
    caplog.set_level(logging.INFO)  # what `python -m grpo` logs to stderr
    code = train(
        shared_tiny_model,
        "train.output_dir=run",
        "loss.policy_loss=my_pkg.my_mod:my_loss",
        "loss.policy_loss_kwargs={kap: 1.5}",
    )
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "grpo train: error: loss.policy_loss_kwargs: 'kap' is not a parameter of policy loss "
        "'my_pkg.my_mod:my_loss' (parameters: logprobs, log_ratio, advantages, cap)"
    ]
    assert caplog.records == []  # the error line is all the user sees
    assert not (my_pkg / "run").exists()


def test_broken_estimator_named_with_step_and_checkpoint_kept(my_pkg, shared_tiny_model, capsys):
    # fine for two steps (a checkpoint is saved at step 2), then the wrong shape
    (my_pkg / "my_pkg" / "flaky.py").write_text(
        "from grpo.algo.advantages import grpo\n"
        "calls = []\n"
        "def adv(scores, mask, *, group_size, eps):\n"
        "    calls.append(1)\n"
        "    out = grpo(scores, mask, group_size=group_size, eps=eps)\n"
        "    return out if len(calls) <= 2 else out[:, :1]\n"
    )
    code = train(
        shared_tiny_model,
        "train.output_dir=run",
        "train.max_steps=4",
        "train.save_every=2",
        "loss.advantage=my_pkg.flaky:adv",
    )
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "grpo train: error: step 3: advantage estimator 'my_pkg.flaky:adv' "
        "returned shape (8, 1), expected (B, T_c) = (8, "
    ), last
    assert (my_pkg / "run" / "checkpoints" / "step_000002").is_dir()
