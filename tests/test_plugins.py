"""Plugins reach every command and every rank: a module named by a config's `plugins:`, by
`--plugin` or by an installed package's `grpo.plugins` entry point is imported before the config
is checked, so the advantage estimator, policy loss, KL estimator, reward and environment it
registers work in `grpo train` (one process and two torchrun ranks), `grpo eval` and
`grpo config`; a plugin that fails is one line naming it (exit 2). `grpo config` checks what
`grpo train` checks before the model loads, and an error line never shares a line with a
progress bar.

Each command runs in this process as in a new one (`new_process`): no plugin loaded yet, the
plugin modules imported afresh, and copies of the registries that are dropped after the test,
so nothing registered here joins the registries tests/test_algo_conformance.py parametrizes
over."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo import plugins
from grpo.algo import registry as algo_registry
from grpo.apps import cli
from grpo.config import load_config
from grpo.data import formats
from grpo.envs import base as envs_base
from grpo.errors import GrpoError
from grpo.rewards import registry as reward_registry
from grpo.settings import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_ci.yaml"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

# One module registers one entry of every registry. Its markers reach metrics.jsonl: the
# estimator's constant advantages through the loss's `ext_adv` stat (so both ran), the KL
# estimator's constant through train/kl, the reward's constant, the environment's step reward.
PLUGIN = '''
import torch

from grpo.algo import broadcast, register_advantage, register_kl, register_policy_loss
from grpo.envs import Step, register_env
from grpo.rewards import register_reward


@register_advantage("ext_adv")
def ext_adv(scores, mask):
    return broadcast(torch.ones_like(scores), mask)  # (B, T_c) of 1


@register_policy_loss("ext_loss")
def ext_loss(log_ratio, advantages):
    return -torch.exp(log_ratio) * advantages, {"ext_adv": advantages}


@register_kl("ext_kl")
def ext_kl(logprobs, ref_logprobs):
    return torch.full_like(logprobs, 0.125)


register_reward("ext_reward", lambda completions, **columns: [0.25] * len(completions))


class ExtEnv:
    """Two turns: an observation after the first, then done with a step reward."""

    tools = []

    def __init__(self, bonus=0.5):
        self.bonus, self.turns = bonus, 0

    def start(self, row):
        return None

    def step(self, text, token_ids):
        self.turns += 1
        if self.turns == 1:
            return Step(observation="go on")
        return Step(reward=self.bonus, done=True)


register_env("ext_env", ExtEnv)


def hook():
    """The entry point's function: called once, with no arguments."""

    @register_advantage("ext_hooked")
    def ext_hooked(scores, mask):
        return broadcast(torch.full_like(scores, 2.0), mask)
'''

ALL_FIVE = [
    "loss.advantage=ext_adv",
    "loss.policy_loss=ext_loss",
    "loss.kl_estimator=ext_kl",
    "rewards=[{name: ext_reward}]",
    "rollout.env=ext_env",
    "rollout.env_kwargs={bonus: 0.5}",
    "rollout.max_turns=2",
]


def dist_info(root: Path, name: str, entry_points: str, version: str = "0.1") -> Path:
    """An installed distribution as importlib.metadata finds it on sys.path: a .dist-info
    directory with METADATA and entry_points.txt (no installer involved)."""
    d = root / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "entry_points.txt").write_text(entry_points)
    return root


@pytest.fixture(scope="module")
def plugin_paths(tmp_path_factory):
    """mods/ holds the plugin; ep/ an installed package declaring its hook as an entry point;
    bad_ep/ one whose entry point names a module that does not exist."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "mods").mkdir()
    (root / "mods" / "grpo_test_ext.py").write_text(PLUGIN)
    dist_info(root / "ep", "grpo_test_ep", "[grpo.plugins]\next = grpo_test_ext:hook\n")
    dist_info(root / "bad_ep", "grpo_test_bad", "[grpo.plugins]\nbad = grpo_test_missing\n")
    return {k: str(root / k) for k in ("mods", "ep", "bad_ep")}


def grpo(args, cwd, pythonpath, timeout=300, prefix=(sys.executable, "-m", "grpo")):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(pythonpath)}
    return subprocess.run(
        [*prefix, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture
def new_process(monkeypatch, tmp_path, caplog):
    """A function `run(argv, pythonpath) -> exit code`: `python -m grpo ARGV` with PYTHONPATH
    `pythonpath`, in this process as in a new one: in tmp_path, `pythonpath` first on sys.path
    (and no earlier command's), no plugin loaded (the process's plugin records and its
    once-per-process entry-point and plugin caches start empty; the plugin modules are imported
    afresh) and the registries as they were before the test (copies, dropped after it). Logs
    reach caplog at INFO, the level `python -m grpo` prints them to stderr at."""
    saved = {
        (reg, attr): getattr(reg, attr)
        for reg in (
            algo_registry.ADVANTAGES,
            algo_registry.POLICY_LOSSES,
            algo_registry.KL_ESTIMATORS,
        )
        for attr in ("_fns", "_claims")
    }
    for owner in (reward_registry, envs_base, formats):
        saved[owner, "_REGISTERED"] = owner._REGISTERED
    activate = plugins._activate.__wrapped__
    entry_points = plugins.load_entry_point_plugins.__wrapped__
    path = list(sys.path)
    ours = ("grpo_test_ext", "grpo_test_missing")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    caplog.set_level(logging.INFO)

    def run(argv: list[str], pythonpath: list[str]) -> int:
        for (owner, attr), value in saved.items():
            monkeypatch.setattr(owner, attr, dict(value))
        monkeypatch.setattr(plugins, "_LOADED", {})
        monkeypatch.setattr(plugins, "_REPLACED", [])
        monkeypatch.setattr(plugins, "_activate", functools.cache(activate))
        monkeypatch.setattr(plugins, "load_entry_point_plugins", functools.cache(entry_points))
        monkeypatch.setattr(sys, "path", [*pythonpath, *path])
        importlib.invalidate_caches()
        for name in ours:
            sys.modules.pop(name, None)
        return cli.main(argv)

    yield run
    for name in ours:
        sys.modules.pop(name, None)


def stderr(capsys, caplog) -> str:
    """What `python -m grpo` would have printed to stderr since the last call: its log lines
    (INFO and up), then what it wrote there."""
    logged = "".join(f"{r.levelname} {r.name}: {r.getMessage()}\n" for r in caplog.records)
    caplog.clear()
    return logged + capsys.readouterr().err


def train_args(model, *overrides, config=TINY):
    return [
        "train",
        "--config",
        str(config),
        f"model.path={model}",
        "train.output_dir=run",
        "train.max_steps=1",
        "train.progress=false",
        "data.eval_samples=0",
        "loss.num_iterations=1",
        *overrides,
    ]


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_config_plugins_train_and_the_saved_config_imports_them(
    plugin_paths, shared_tiny_model, tmp_path, new_process, capsys, caplog
):
    cfg = yaml.safe_load(TINY.read_text())
    cfg["plugins"] = ["grpo_test_ext"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    args = train_args(shared_tiny_model, *ALL_FIVE, config=tmp_path / "c.yaml")
    code = new_process(args, [plugin_paths["mods"]])
    assert code == 0, stderr(capsys, caplog)[-3000:]
    (row,) = metrics(tmp_path / "run")
    assert row["train/ext_adv"] == 1.0  # the estimator's advantages reached the loss
    assert row["train/kl"] == pytest.approx(0.125)
    assert row["rewards/ext_reward"] == 0.25
    assert row["env/turns_mean"] == 2.0 and row["env/step_reward_mean"] == 0.5
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["plugins"] == ["grpo_test_ext"]
    # the saved config is valid on its own: its plugins are imported again (no --plugin)
    stderr(capsys, caplog)
    code = new_process(["config", "--config", "run/config.yaml"], [plugin_paths["mods"]])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert yaml.safe_load(out)["loss"]["advantage"] == "ext_adv"
    # `grpo config` rejects the plugin environment's unknown kwargs, as `grpo train` does
    stderr(capsys, caplog)
    code = new_process(
        ["config", "--config", "run/config.yaml", "rollout.env_kwargs={bonsu: 1}"],
        [plugin_paths["mods"]],
    )
    assert code == 2
    assert stderr(capsys, caplog).strip() == (
        "grpo config: error: rollout.env_kwargs: got an unexpected keyword argument 'bonsu' "
        "(environment 'ext_env')"
    )


def test_entry_point_plugin_trains_and_its_function_is_called(
    plugin_paths, shared_tiny_model, tmp_path, new_process, capsys
):
    overrides = [o.replace("=ext_adv", "=ext_hooked") for o in ALL_FIVE]
    code = new_process(
        train_args(shared_tiny_model, *overrides), [plugin_paths["mods"], plugin_paths["ep"]]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    (row,) = metrics(tmp_path / "run")
    assert row["train/ext_adv"] == 2.0  # registered by the hook the entry point names
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["plugins"] == []
    # `grpo eval` of the trained adapter in episodes of the entry point's environment
    args = [
        "eval",
        "--model",
        str(shared_tiny_model),
        "--adapter",
        "run/final",
        "--env",
        "ext_env",
        "--max-turns",
        "2",
        "--max-samples",
        "2",
        "--max-new-tokens",
        "4",
        "--out",
        "eval.json",
    ]
    code = new_process(args, [plugin_paths["mods"], plugin_paths["ep"]])
    assert code == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((tmp_path / "eval.json").read_text())["models"]["model"]["summary"]
    assert summary["turns_mean"] == 2.0 and summary["step_reward_mean"] == 0.5


@pytest.mark.process
def test_two_ranks_train_with_a_cli_plugin(plugin_paths, shared_tiny_model, tmp_path):
    args = train_args(shared_tiny_model, "loss.advantage=ext_adv", "loss.policy_loss=ext_loss")
    r = grpo(
        [*args, "--plugin", "grpo_test_ext"],
        tmp_path,
        [plugin_paths["mods"]],
        prefix=(*TORCHRUN, "-m", "grpo"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = metrics(tmp_path / "run")  # one row: rank 0 logs
    assert row["train/ext_adv"] == 1.0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["plugins"] == ["grpo_test_ext"]  # --plugin kept for a resume or `grpo eval`


def test_failing_plugins_are_one_line(plugin_paths, new_process, capsys, caplog):
    code = new_process(["config", "--config", str(TINY)], [plugin_paths["bad_ep"]])
    assert code == 2
    assert stderr(capsys, caplog) == (
        "grpo config: error: entry point 'bad' of group 'grpo.plugins': cannot import "
        "'grpo_test_missing': ModuleNotFoundError: No module named 'grpo_test_missing'\n"
    )
    code = new_process(
        ["sft", "--config", str(TINY), "--plugin", "grpo_test_ext", "--plugin", "nope.mod"],
        [plugin_paths["mods"]],
    )
    assert code == 2
    assert stderr(capsys, caplog) == (
        "grpo sft: error: --plugin[1]: cannot import 'nope.mod': "
        "ModuleNotFoundError: No module named 'nope'\n"
    )


# -- in this process: plugins that register nothing -------------------------------------------


def test_config_plugins_are_imported_first_and_kept(tmp_path, monkeypatch, capsys):
    (tmp_path / "grpo_test_probe.py").write_text("CALLS = []\ndef hook():\n    CALLS.append(1)\n")
    (tmp_path / "grpo_test_broken.py").write_text("raise RuntimeError('broken\\non purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = {"model": {"path": "m"}, "plugins": ["grpo_test_probe:hook"]}
    cfg = load_config(base=base, plugins=["grpo_test_probe", "grpo_test_probe:hook"])
    assert cfg.plugins == ("grpo_test_probe:hook", "grpo_test_probe")
    load_config(base=base)
    import grpo_test_probe

    assert grpo_test_probe.CALLS == [1]  # a plugin's function runs once per process
    with pytest.raises(ConfigError, match=r"^plugins: expected a list, got 'grpo_test_probe'$"):
        load_config(base={"model": {"path": "m"}}, overrides=["plugins=grpo_test_probe"])
    bad = [
        (
            "plugins=[grpo_test_broken]",
            "plugins[0]: cannot import 'grpo_test_broken': RuntimeError: broken\non purpose",
        ),
        (
            "plugins=['grpo_test_probe:nope']",
            "plugins[0]: 'grpo_test_probe:nope': module 'grpo_test_probe' has no attribute 'nope'",
        ),
        (
            "plugins=['grpo_test_probe:CALLS']",
            "plugins[0]: 'grpo_test_probe:CALLS': 'CALLS' is a list, not a function",
        ),
    ]
    for override, message in bad:
        with pytest.raises(ConfigError) as e:
            load_config(base={"model": {"path": "m"}}, overrides=[override])
        assert str(e.value) == message
    rc = cli.main(["config", "--config", str(TINY), "plugins=[grpo_test_broken]"])
    assert rc == 2
    assert capsys.readouterr().err == (
        "grpo config: error: plugins[0]: cannot import 'grpo_test_broken': RuntimeError: "
        "broken on purpose\n"
    )


def test_pipeline_and_sweep_stages_keep_cli_plugins(tmp_path, monkeypatch):
    from grpo.apps.pipeline import load_pipeline_config
    from grpo.apps.sweep import SweepSetup

    (tmp_path / "grpo_test_probe2.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = load_pipeline_config(
        REPO / "configs" / "pipeline_tiny.yaml",
        [f"output_dir={tmp_path / 'p'}"],
        ["grpo_test_probe2"],
    )
    assert p.sft.plugins == p.grpo.plugins == ("grpo_test_probe2",)
    setup = SweepSetup(
        str(TINY), (), tmp_path, "eval/accuracy", "max", "grpo", ("grpo_test_probe2",)
    )
    assert setup.trial_config({"optim.lr": 1e-4}, tmp_path / "t").plugins == ("grpo_test_probe2",)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.env=nope"], "rollout.env: unknown environment 'nope'"),
        (["eval.env=nope"], "eval.env: unknown environment 'nope'"),
        (
            ["rollout.env=calculator", "rollout.env_kwargs={zz: 1}"],
            "rollout.env_kwargs: got an unexpected keyword argument 'zz'",
        ),
        (["rewards=[{name: nope}]"], "unknown reward 'nope'"),
        (["rewards=[{name: step, betta: 1}]"], "betta"),
        (["train.batch_size=6", "train.micro_batch_size=3"], "GRPO needs whole groups"),
        # the critic's kwargs (their types from its signature, then its own checks) and the
        # scorers' checkpoints, which the trainer read only after loading the policy
        (
            ["loss.advantage=gae", "modules=[{name: critic, kwargs: {micro_batch_size: x}}]"],
            "modules[0].kwargs.micro_batch_size: expected int or null, got str 'x'",
        ),
        (
            ["loss.advantage=gae", "modules=[{name: critic, kwargs: {coef: 0}}]"],
            "modules[0].kwargs.coef must be > 0, got 0",
        ),
        (
            ["loss.advantage=gae", "modules=[{name: critic, kwargs: {init: /nonexistent/c}}]"],
            "modules[0].kwargs.init: '/nonexistent/c' is not a checkpoint directory",
        ),
        (
            ["rewards=[{name: reward_model, kwargs: {path: /nonexistent/rm}}]"],
            "rewards[0].kwargs.path: '/nonexistent/rm' is not a checkpoint directory",
        ),
    ],
)
def test_config_checks_what_train_checks_before_the_model(overrides, message, capsys):
    """`grpo config` runs the checks `grpo train` runs before loading the model."""
    assert cli.main(["config", "--config", str(TINY), *overrides]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err


def test_config_preflight_reads_a_local_model_only(shared_tiny_model, tmp_path, capsys):
    """With model.path on this machine `grpo config` runs the preflight (token budgets against
    the checkpoint's context); a model it cannot see is not fetched; --trainer sft checks
    as `grpo sft` (dropout allowed)."""
    local = [
        "--config",
        str(TINY),
        f"model.path={shared_tiny_model}",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    assert cli.main(["config", *local, "rollout.max_new_tokens=4000"]) == 2
    assert "rollout.max_new_tokens: 4000 new tokens leave no room" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "config",
                "--config",
                str(TINY),
                "model.path=nobody/nothing",
                "rollout.max_new_tokens=4000",
            ]
        )
        == 0
    )
    assert cli.main(["config", *local, "lora.dropout=0.1"]) == 2
    assert "lora.dropout: must be 0 for GRPO" in capsys.readouterr().err
    assert cli.main(["config", *local, "lora.dropout=0.1", "--trainer", "sft"]) == 0
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_causal_lm_as_reward_model_is_refused_before_any_model_loads(
    shared_tiny_model, tmp_path, capsys, monkeypatch
):
    """A `reward_model` path that is a causal LM is named by `grpo config` and by `grpo train`
    from its config.json, before the policy loads (no weights read) and before anything is
    written; a reward model checkpoint (one output) passes."""
    import grpo.models
    from grpo.models import load_model, save_pretrained

    rm = tmp_path / "rm"
    save_pretrained(load_model(shared_tiny_model, num_labels=1, pad_token_id=0), rm)
    args = ["--config", str(TINY), f"model.path={shared_tiny_model}"]
    want = f"rewards[0].kwargs.path: '{shared_tiny_model}' is a causal LM"
    reward = f"rewards=[{{name: reward_model, kwargs: {{path: '{shared_tiny_model}'}}}}]"
    assert cli.main(["config", *args, reward]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and want in err, err

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo.models, "load_model", no_loading)
    run = tmp_path / "run"
    assert cli.main(["train", *args, f"train.output_dir={run}", reward]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and want in err, err
    assert not run.exists()
    assert cli.main(["config", *args, reward.replace(str(shared_tiny_model), str(rm))]) == 0


def test_error_line_never_glued_to_a_progress_bar(monkeypatch, capsys):
    """A failing command with a bar open: the bar ends its line before the error, and no
    stale bar is printed after it."""
    from tqdm.auto import tqdm

    def failing(args):
        bar = tqdm(total=3, desc="grpo")  # noqa: F841  (open, as in a training loop)
        raise GrpoError("bad\nthing")

    monkeypatch.setattr(cli, "cmd_plot", failing)
    assert cli.main(["plot", "somewhere"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("\ngrpo plot: error: bad thing\n"), repr(err)
    assert "0/3" in err  # the bar was there, and ended its line first
