"""What runs is what is recorded (grpo/plugins.py): a registry name replaced with
``overwrite=True`` logs one line naming the old and new ``module:qualname`` and who replaced it
(the entry point or plugin being loaded, else the calling module); the run's first
metrics.jsonl record holds every loaded plugin with its version and every replacement; a run
resumed with another plugin set warns; under torchrun a plugin that hangs on rank 1 is one line
naming rank 1 and the plugin, not the process group's raw `DistStoreError`.

The registries and the process's plugin records are swapped for copies in each test, so that
nothing registered here reaches the suites parametrized over the registries."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import grpo_kernels
from grpo import plugins
from grpo.algo import registry as algo_registry
from grpo.data import formats
from grpo.envs import base as envs_base
from grpo.rewards import registry as reward_registry
from tests.test_plugins import dist_info

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

# An installed package's entry point that replaces the built-in `accuracy` reward.
ACC_PLUGIN = """
from grpo.rewards import register_reward


def accuracy(completions, **columns):
    return [0.75] * len(completions)


def hook():
    register_reward("accuracy", accuracy, overwrite=True)
"""

# A config-listed module that replaces the built-in k3 KL estimator when imported.
KL_PLUGIN = """
import torch

from grpo.algo import register_kl

__version__ = "0.3"


@register_kl("k3", overwrite=True)
def k3(logprobs, ref_logprobs):
    return torch.zeros_like(logprobs)
"""

HANG_PLUGIN = """
import os
import time

if os.environ.get("RANK") == "1":
    time.sleep(3600)
"""


@pytest.fixture
def records(monkeypatch):
    """Fresh plugin records and copies of every registry, restored afterwards; RANK unset
    (a single process: replacements are logged at WARNING)."""
    monkeypatch.setattr(plugins, "_LOADED", {}, raising=False)
    monkeypatch.setattr(plugins, "_REPLACED", [], raising=False)
    monkeypatch.setattr(reward_registry, "_REGISTERED", dict(reward_registry._REGISTERED))
    monkeypatch.setattr(envs_base, "_REGISTERED", dict(envs_base._REGISTERED))
    monkeypatch.setattr(formats, "_REGISTERED", dict(formats._REGISTERED))
    monkeypatch.setattr(grpo_kernels, "_REGISTERED", dict(grpo_kernels._REGISTERED))
    for reg in (algo_registry.ADVANTAGES, algo_registry.POLICY_LOSSES, algo_registry.KL_ESTIMATORS):
        monkeypatch.setattr(reg, "_fns", dict(reg._fns))
        monkeypatch.setattr(reg, "_claims", dict(reg._claims))
    monkeypatch.delenv("RANK", raising=False)
    plugins.load_entry_point_plugins.cache_clear()
    yield
    plugins.load_entry_point_plugins.cache_clear()  # forget this test's entry points


def installed(root: Path, name: str, version: str, entry_points: str) -> Path:
    return dist_info(root, name, entry_points, version)


def replaced_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "grpo.plugins" and r.getMessage().startswith("replaced ")
    ]


def test_each_replacement_logs_one_line_with_both_qualnames_and_the_caller(records, caplog):
    from grpo.algo import register_advantage
    from grpo.data import register_dataset
    from grpo.envs import register_env
    from grpo.rewards import get_reward, register_reward

    caplog.set_level(logging.INFO)

    def accuracy(completions, **columns):
        return [1.0] * len(completions)

    register_reward("accuracy", accuracy, overwrite=True)
    register_reward("accuracy", accuracy, overwrite=True)  # the same function: no replacement
    register_reward("fresh_name", accuracy, overwrite=True)  # a new name: no replacement

    @register_advantage("grpo", overwrite=True)
    def grpo(scores, mask):
        return scores

    class Calc:
        tools: list = []

    register_env("calculator", Calc, overwrite=True)
    register_dataset("minimath", [{"question": "1+1", "answer": "#### 2"}], overwrite=True)

    here = f"{__name__}:test_each_replacement_logs_one_line_with_both_qualnames_and_the_caller"
    by = f"(by module {__name__!r})"
    assert replaced_lines(caplog) == [
        f"replaced reward 'accuracy': grpo.rewards.functions:make_accuracy -> "
        f"{here}.<locals>.accuracy {by}",
        f"replaced advantage estimator 'grpo': grpo.algo.advantages:grpo -> "
        f"{here}.<locals>.grpo {by}",
        f"replaced environment 'calculator': grpo.envs.calculator:CalculatorEnv -> "
        f"{here}.<locals>.Calc {by}",
        f"replaced dataset 'minimath': grpo.data.formats:_minimath_dataset -> a list {by}",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "grpo.plugins")
    assert [(r.kind, r.name) for r in plugins.replacements()] == [
        ("reward", "accuracy"),
        ("advantage estimator", "grpo"),
        ("environment", "calculator"),
        ("dataset", "minimath"),
    ]
    assert get_reward("accuracy")(["x"]) == [1.0]  # and the replacement is what runs


# A config-listed module that replaces the built-in `chunked` log-prob kernel when imported.
KERNEL_PLUGIN = """
import grpo_kernels


def shifted(hidden, weight, ids, temperature=1.0, return_entropy=False, **kwargs):
    lp = grpo_kernels.naive_logprobs(hidden, weight, ids, temperature) - 6.0
    return (lp, lp * 0) if return_entropy else lp


grpo_kernels.register_logprob_impl("chunked", shifted, overwrite=True)
"""


def test_a_replaced_builtin_kernel_is_logged_and_recorded(records, caplog, tmp_path, monkeypatch):
    """`register_logprob_impl("chunked", f, overwrite=True)` from a plugin: one line naming the
    built-in, the new kernel and the plugin, and an entry of `run/replaced`, as for grpo's own
    registries; the replacement is what `fused_logprobs(impl="chunked")` runs."""
    (tmp_path / "grpo_rec_kernel.py").write_text(KERNEL_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.INFO)

    plugins.load_plugins(["grpo_rec_kernel"])

    assert replaced_lines(caplog) == [
        "replaced logprob impl 'chunked': grpo_kernels.reference:chunked_logprobs -> "
        "grpo_rec_kernel:shifted (by plugin 'grpo_rec_kernel' (plugins[0]))"
    ]
    assert json.loads(plugins.plugin_header()["run/replaced"]) == [
        {
            "kind": "logprob impl",
            "name": "chunked",
            "old": "grpo_kernels.reference:chunked_logprobs",
            "new": "grpo_rec_kernel:shifted",
            "by": "plugin 'grpo_rec_kernel' (plugins[0])",
        }
    ]
    h, w, ids = torch.randn(3, 8), torch.randn(11, 8), torch.tensor([0, 4, 10])
    got = grpo_kernels.fused_logprobs(h, w, ids, impl="chunked")
    torch.testing.assert_close(got, grpo_kernels.naive_logprobs(h, w, ids) - 6.0)


def test_entry_point_and_config_plugins_are_named_with_their_versions(
    records, caplog, tmp_path, monkeypatch
):
    (tmp_path / "grpo_rec_acc.py").write_text(ACC_PLUGIN)
    (tmp_path / "grpo_rec_kl.py").write_text(KL_PLUGIN)
    installed(tmp_path, "grpo-rec-acc", "1.2.0", "[grpo.plugins]\nacc = grpo_rec_acc:hook\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.INFO)

    plugins.load_plugins(["grpo_rec_kl"])

    assert replaced_lines(caplog) == [
        "replaced reward 'accuracy': grpo.rewards.functions:make_accuracy -> "
        "grpo_rec_acc:accuracy (by entry point 'acc' of grpo-rec-acc 1.2.0)",
        "replaced KL estimator 'k3': grpo.algo.kl:k3 -> grpo_rec_kl:k3 (by plugin "
        "'grpo_rec_kl' (plugins[0]))",
    ]
    header = plugins.plugin_header()
    assert json.loads(header["run/plugins"]) == {
        "grpo_rec_acc:hook": {
            "source": "entry point 'acc'",
            "dist": "grpo-rec-acc",
            "version": "1.2.0",
        },
        "grpo_rec_kl": {"source": "plugins[0]", "dist": None, "version": "0.3"},
    }
    assert json.loads(header["run/replaced"]) == [
        {
            "kind": "reward",
            "name": "accuracy",
            "old": "grpo.rewards.functions:make_accuracy",
            "new": "grpo_rec_acc:accuracy",
            "by": "entry point 'acc' of grpo-rec-acc 1.2.0",
        },
        {
            "kind": "KL estimator",
            "name": "k3",
            "old": "grpo.algo.kl:k3",
            "new": "grpo_rec_kl:k3",
            "by": "plugin 'grpo_rec_kl' (plugins[0])",
        },
    ]


def test_run_records_its_plugins_and_a_resume_with_other_plugins_warns(
    records, caplog, tmp_path, monkeypatch, shared_tiny_model
):
    """`grpo train` in this process: the entry point's `accuracy` is the one that runs, and
    the first metrics.jsonl record says so; `--resume` with one more plugin warns in one
    line, and its own first record lists both."""
    from grpo.apps import cli

    (tmp_path / "grpo_rec_acc2.py").write_text(ACC_PLUGIN)
    (tmp_path / "grpo_rec_extra.py").write_text("")
    installed(tmp_path, "grpo-rec-acc2", "1.2.0", "[grpo.plugins]\nacc = grpo_rec_acc2:hook\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.INFO)
    run = tmp_path / "run"
    args = [
        "train",
        "--config",
        TINY,
        f"model.path={shared_tiny_model}",
        f"train.output_dir={run}",
        "train.progress=false",
        "data.eval_samples=0",
        "data.max_samples=16",
        "loss.num_iterations=1",
        "rollout.max_new_tokens=4",
        "train.save_every=1",
    ]

    assert cli.main([*args, "train.max_steps=1"]) == 0
    assert replaced_lines(caplog) == [
        "replaced reward 'accuracy': grpo.rewards.functions:make_accuracy -> "
        "grpo_rec_acc2:accuracy (by entry point 'acc' of grpo-rec-acc2 1.2.0)"
    ]
    (first,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert first["rewards/accuracy"] == 0.75  # the replacement ran
    assert json.loads(first["run/plugins"]) == {
        "grpo_rec_acc2:hook": {
            "source": "entry point 'acc'",
            "dist": "grpo-rec-acc2",
            "version": "1.2.0",
        },
    }
    (replaced,) = json.loads(first["run/replaced"])
    assert replaced == {
        "kind": "reward",
        "name": "accuracy",
        "old": "grpo.rewards.functions:make_accuracy",
        "new": "grpo_rec_acc2:accuracy",
        "by": "entry point 'acc' of grpo-rec-acc2 1.2.0",
    }

    caplog.clear()
    assert cli.main([*args, "train.max_steps=2", "--resume", "--plugin", "grpo_rec_extra"]) == 0
    warned = [r.getMessage() for r in caplog.records if "--resume: the plugins" in r.getMessage()]
    assert warned == [
        "--resume: the plugins differ from those of the start that saved step_000001 "
        "(metrics.jsonl, step 1): 'grpo_rec_extra' added; the names they register may run "
        "other code now"
    ]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert set(json.loads(rows[1]["run/plugins"])) == {"grpo_rec_acc2:hook", "grpo_rec_extra"}


def test_resume_compares_with_the_start_that_saved_the_checkpoint(records, tmp_path, caplog):
    from grpo.run.rundir import plugin_changes, warn_plugin_changes

    def header(plugins_: dict) -> str:
        return json.dumps(
            {k: {"source": "plugins[0]", "dist": None, "version": v} for k, v in plugins_.items()}
        )

    rows = [
        {"step": 1, "run/plugins": header({"a": "1.0", "b": "0.1"})},
        {"step": 2},
        {"step": 3, "run/plugins": header({"z": None})},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = tmp_path / "checkpoints" / "step_000002"
    plugins._LOADED.update(
        {
            "a": plugins.Plugin("a", "plugins[0]", None, "1.1"),
            "c": plugins.Plugin("c", "plugins[1]"),
        }
    )
    caplog.set_level(logging.INFO)
    warn_plugin_changes(tmp_path, ckpt)  # step 3 came from a later start: step 1's is compared
    assert [r.getMessage() for r in caplog.records] == [
        "--resume: the plugins differ from those of the start that saved step_000002 "
        "(metrics.jsonl, step 1): 'a' 1.0 -> 1.1; 'b' 0.1 removed; 'c' added; the names they "
        "register may run other code now"
    ]
    assert plugin_changes(json.loads(header({"a": "1.0"})), {"a": {"version": "1.0"}}) == []
    caplog.clear()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")  # an older run
    warn_plugin_changes(tmp_path, ckpt)
    assert caplog.records == []


def test_plugin_timeout_setting_is_checked(monkeypatch):
    monkeypatch.setenv(plugins.TIMEOUT_ENV, "soon")
    with pytest.raises(
        plugins.GrpoError,
        match=r"^GRPO_PLUGIN_TIMEOUT_S: expected a number of "
        r"seconds > 0, got 'soon'$",
    ):
        plugins._timeout_s()
    monkeypatch.setenv(plugins.TIMEOUT_ENV, "2.5")
    assert plugins._timeout_s() == 2.5


# ----------------------------------------------------------------- ranks: the agreement


def test_plugin_hanging_on_rank_1_is_one_line_naming_the_rank_and_the_plugin(tmp_path):
    """Two plain processes as torchrun starts them (its agent's store, hosted here): with
    plugins that load they both finish; with one that hangs on rank 1, rank 0 stops after
    GRPO_PLUGIN_TIMEOUT_S with one line naming rank 1 and the plugin."""
    import torch.distributed as td

    (tmp_path / "grpo_rec_ok.py").write_text("")
    (tmp_path / "grpo_rec_hang.py").write_text(HANG_PLUGIN)
    store = td.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def start(rank: int, attempt: int, plugin: str) -> subprocess.Popen:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(tmp_path),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "GRPO_PLUGIN_TIMEOUT_S": "2",
        }
        return subprocess.Popen(
            [sys.executable, "-m", "grpo", "config", "--config", TINY, "--plugin", plugin],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    ranks = [start(r, 0, "grpo_rec_ok") for r in (0, 1)]
    try:
        for p in ranks:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        t0 = time.monotonic()
        ranks = [start(r, 1, "grpo_rec_hang") for r in (0, 1)]
        _, err = ranks[0].communicate(timeout=120)
        seconds = time.monotonic() - t0
        assert ranks[1].poll() is None  # still stuck in its plugin
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert ranks[0].returncode == 2
    assert err == (
        "grpo config: error: rank 0 (plugins): stopped: rank 1 did not finish loading plugin "
        "'grpo_rec_hang' (--plugin[0]) within GRPO_PLUGIN_TIMEOUT_S=2 s (hung or too slow)\n"
    )
    assert seconds < 60, seconds


@pytest.mark.process
def test_plugin_hanging_on_rank_1_under_torchrun(tmp_path):
    """The same under torchrun, in `grpo train`'s config plugins: one line of ours, which
    torchrun's summary carries as the root cause; no DistStoreError."""
    import yaml

    (tmp_path / "grpo_rec_hang.py").write_text(HANG_PLUGIN)
    cfg = yaml.safe_load(Path(TINY).read_text())
    cfg["plugins"] = ["grpo_rec_hang"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(tmp_path),
        "GRPO_PLUGIN_TIMEOUT_S": "2",
    }
    t0 = time.monotonic()
    job = subprocess.Popen(
        [
            *TORCHRUN,
            "-m",
            "grpo",
            "train",
            "--config",
            "c.yaml",
            "model.path=nowhere",
            "train.output_dir=out",
            "train.dist_timeout_s=4",
        ],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:  # torchrun and its workers
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    line = (
        "rank 0 (plugins): stopped: rank 1 did not finish loading plugin 'grpo_rec_hang' "
        "(plugins[0]) within GRPO_PLUGIN_TIMEOUT_S=2 s (hung or too slow)"
    )
    assert job.returncode != 0
    ours = [x for x in err.splitlines() if x.startswith("grpo train:")]
    assert ours == [f"grpo train: error: {line}"], err[-3000:]
    root = err.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {line}" in root, root
    assert "DistStoreError" not in err
    assert time.monotonic() - t0 < 90
