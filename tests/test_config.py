"""Config loading: YAML + dotted overrides, strict keys, validation naming the field, round trip."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import pytest

from grpo.checks import check_config
from grpo.config import config_to_dict, load_config, save_config
from grpo.settings import (
    ConfigError,
    FieldError,
    between,
    build_settings,
    check_fields,
    check_value,
    non_empty,
    one_of,
    only,
    setting,
)

BASE = """\
model:
  path: some/model
rollout:
  group_size: 4
train:
  batch_size: 8
rewards:
  - name: accuracy
    weight: 1.0
  - name: length_penalty
    weight: 0.5
    kwargs: {target: 200, alpha: 0.001}
"""


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(BASE)
    return p


def test_load_and_overrides(cfg_file):
    cfg = load_config(cfg_file, ["optim.lr=3e-4", "lora.targets=[q_proj, v_proj]", "loss.beta=0"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.lora.targets == ("q_proj", "v_proj")
    assert cfg.loss.beta == 0.0
    assert cfg.rewards[1].name == "length_penalty" and cfg.rewards[1].kwargs["target"] == 200
    assert cfg.model.path == "some/model"


def test_round_trip(cfg_file, tmp_path):
    cfg = load_config(cfg_file, ["rollout.temperature=0.7", "eval.max_samples=null"])
    out = save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(out) == cfg
    assert load_config(base=config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("optim.lrr=1", r"optim.lrr: unknown key; valid keys of optim: .*\blr\b"),
        ("optimizer.lr=1", r"optimizer.lr: unknown key; valid keys: .*optim"),
        ("optim.lr=-1", r"optim.lr: must be > 0"),
        ("optim.lr=fast", r"optim.lr: expected a number"),
        ("rollout.group_size=1", r"rollout.group_size: must be >= 2"),
        ("loss.epsilon_low=0", r"loss.epsilon_low: must be > 0"),
        ("loss.kl_estimator=k4", r"loss.kl_estimator: unknown KL estimator 'k4'; registered: k1"),
        ("train.max_steps=2.5", r"train.max_steps: expected an integer"),
        ("lora.enabled=yesplease", r"lora.enabled: expected true/false"),
        ("optim.lr", r"must look like section.key=value"),
        ("log.kl_every=-1", r"log.kl_every: must be >= 0"),
        # no silent changes: a reward is never guessed, a run never writes into . or /
        ("rewards=[{weight: 2}]", r"rewards\[0\].name: is required"),
        ("rewards=[{name: accuracy}, {weigth: 2}]", r"rewards\[1\].weigth: unknown key"),
        ("train.output_dir=''", r"train.output_dir: must name a directory of its own"),
        ("train.output_dir=.", r"train.output_dir: must name a directory of its own"),
        ("train.output_dir=/", r"train.output_dir: must name a directory of its own"),
        # settings that cannot work: no update stays finite, no hang is bounded
        ("optim.lr=1e30", r"optim.lr: must be <= 1 \(AdamW moves every weight by about lr"),
        ("rollout.env_timeout_s=0", r"rollout.env_timeout_s: must be > 0 and at most 604800"),
        # every limit has bounds: a huge number is a typo, not a setting
        ("rollout.env_timeout_s=1e30", r"rollout.env_timeout_s: must be > 0 and at most 604800"),
        ("rollout.async_timeout_s=1e9", r"rollout.async_timeout_s: must be > 0 and at most"),
        ("train.dist_timeout_s=1e12", r"train.dist_timeout_s: must be > 0 and at most 604800"),
        ("rewards=[{name: accuracy, timeout_s: 1e30}]", r"rewards\[\]\.timeout_s: must be > 0"),
    ],
)
def test_bad_values_name_the_field(cfg_file, override, pattern):
    # load_config checks types and ranges; check_config, which every command runs next, the
    # names in their registries (loss.kl_estimator)
    with pytest.raises(ConfigError, match=pattern):
        check_config(load_config(cfg_file, [override]))


def test_rewards_and_environments_have_a_time_limit_by_default(cfg_file):
    """No hang by default: a reward call may take 300 s, an environment call 60 s; null turns
    a limit off (the call then runs in the caller's thread)."""
    cfg = load_config(cfg_file)
    assert cfg.rollout.env_timeout_s == 60.0
    assert [r.timeout_s for r in cfg.rewards] == [300.0, 300.0]
    off = load_config(
        cfg_file, ["rollout.env_timeout_s=null", "rewards=[{name: accuracy, timeout_s: null}]"]
    )
    assert off.rollout.env_timeout_s is None and off.rewards[0].timeout_s is None
    assert load_config(base=config_to_dict(off)) == off  # null survives the saved config


def test_whole_groups_is_a_grpo_rule_only(cfg_file, tmp_path):
    cfg = load_config(cfg_file, ["rollout.group_size=3"])  # fine for SFT
    assert cfg.train.batch_size % 3 != 0
    with pytest.raises(
        ConfigError, match=r"train.batch_size: .*not divisible by rollout.group_size"
    ):
        cfg.check_grpo()
    from grpo.train.grpo import train_grpo

    bad = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, output_dir=str(tmp_path / "r"))
    )
    with pytest.raises(ConfigError, match="not divisible"):
        train_grpo(bad)
    assert not (tmp_path / "r").exists()  # failed before writing anything


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {path: m}\ntrain: {max_step: 3}\n")
    with pytest.raises(ConfigError, match=r"train.max_step: unknown key.*max_steps"):
        load_config(p)


def test_missing_required_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="model: is required"):
        load_config(base={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_typo_one_line_nonzero(cfg_file):
    r = subprocess.run(
        [sys.executable, "-m", "grpo", "config", "--config", str(cfg_file), "optim.lrr=1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "optim.lrr" in lines[0] and "lr, max_grad_norm" in lines[0]
    assert "Traceback" not in r.stderr


# -- build_settings: the one reader of untrusted mappings (configs, tool JSON, HTTP bodies) ----


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Inner:
    share: float = setting(0.5, check=between(0, 1))
    name: str = setting(MISSING, check=non_empty)

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Outer:
    count: int = setting(1, check=between(1))
    limit: int | None = setting(100, check=between(1))  # None is a value: no limit
    inner: _Inner | None = None
    parts: tuple[_Inner, ...] = ()
    label: str | tuple[str, ...] = "a"
    fn: Callable | None = None
    anything: Any = None

    def __post_init__(self):
        check_fields(self)


@pytest.mark.parametrize(
    "data, field, message",
    [
        ({"count": 0}, "count", "count: must be >= 1, got 0"),
        ({"count": True}, "count", "count: expected an integer, got True"),
        ({"cuont": 2}, "cuont", "cuont: unknown key; valid keys: anything, count, fn, inner,"),
        ({"inner": {}}, "inner.name", "inner.name: is required"),
        ({"inner": {"name": " "}}, "inner.name", "inner.name: must not be empty"),
        ({"inner": {"name": "x", "share": 2}}, "inner.share", "inner.share: must be in [0, 1]"),
        (
            {"parts": [{"name": "x"}, {"name": "y", "share": -1}]},
            "parts[1].share",
            "parts[1].share: must be in [0, 1], got -1.0",
        ),
        (
            {"parts": [{"name": "x", "nope": 1}]},
            "parts[0].nope",
            "parts[0].nope: unknown key; valid keys of parts[0]: name, share",
        ),
        ({"label": 5}, "label", "label: expected a string or a list, got 5"),
        ({"label": ["a", 5]}, "label[1]", "label[1]: expected a string, got 5"),  # the deeper one
        ({"fn": 5}, "fn", "fn: expected a function, got 5"),
        ({"inner": {"name": "x", "share": 10**400}}, "inner.share", "inner.share: beyond a float"),
        ({"count": "x" * 500}, "count", "count: expected an integer, got 'xxxxx"),
    ],
)
def test_build_settings_errors_name_the_dotted_field(data, field, message):
    with pytest.raises(ConfigError) as e:
        build_settings(_Outer, data)
    assert e.value.field == field and str(e.value).startswith(message)
    assert e.value.problem == str(e.value)[len(field) + 2 :]
    assert len(str(e.value)) < 200  # a long value is cut short, never echoed whole


def test_build_settings_values_and_nulls():
    s = build_settings(_Outer, {"parts": [{"name": "x"}], "label": ["a", "b"], "fn": len})
    assert s.parts == (_Inner(name="x"),) and s.label == ("a", "b") and s.fn is len
    assert build_settings(_Outer, {"inner": {"name": "x", "share": 1}}).inner.share == 1.0
    # a null: a type error by default; with null_is_default the default where the type has no
    # None, and the value None where it has (limit: None means "no limit")
    with pytest.raises(ConfigError, match="count: expected an integer, got None"):
        build_settings(_Outer, {"count": None})
    s = build_settings(_Outer, {"count": None, "limit": None}, null_is_default=True)
    assert (s.count, s.limit) == (1, None)
    nested = {"inner": {"name": "x", "share": None}, "parts": [{"name": "y", "share": None}]}
    s = build_settings(_Outer, nested, null_is_default=True)  # at every level
    assert s.inner.share == s.parts[0].share == 0.5
    # checks run on direct construction too, and check_value on plain arguments
    with pytest.raises(FieldError, match=r"^count: must be >= 1, got 0$"):
        _Outer(count=0)
    with pytest.raises(FieldError, match=r"^rows: must be in \(0, 1\), got 1$"):
        check_value("rows", 1, between(0, 1, lo_open=True, hi_open=True))
    assert one_of({"a", "b"})("c") == "must be one of ['a', 'b'], got 'c'"
    assert only(0)(0.0) is None and only(0)(0.5) == "not supported (only 0)"


def test_extending_settings_example_runs_as_written(capsys):
    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = text.split("## Settings of your own application")[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(block, "extending.md", "exec", dont_inherit=True), {"__name__": "doc_example"})
    expected = re.search(r"# (job\.temperature \| .*)", block).group(1)
    assert capsys.readouterr().out.strip() == expected


def test_command_line_max_steps_wins_over_config_epochs(caplog):
    """configs/gsm8k_qwen3_0.6b_sft.yaml sets train.epochs: 3 (2,803 steps); a command-line
    train.max_steps is what the user asked for (as in Hugging Face's Trainer), said in one line.
    Both on the command line: epochs decides, as before."""
    path = Path(__file__).resolve().parents[1] / "configs" / "gsm8k_qwen3_0.6b_sft.yaml"
    assert load_config(path).train.epochs == 3
    with caplog.at_level(logging.WARNING, logger="grpo.config"):
        cfg = load_config(path, ["train.max_steps=1"])
    assert cfg.train.max_steps == 1 and cfg.train.epochs is None
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.config"]
    assert lines == ["train.max_steps=1 (command line) wins over the config's train.epochs=3"]
    both = load_config(path, ["train.max_steps=1", "train.epochs=2"])
    assert both.train.epochs == 2


def test_moved_keys_load_under_their_old_names_once_each(caplog):
    """`grpo.config.RENAMED`: an old key (a file's, a base dict's or an override's, a pipeline
    stage's prefix included) carries its value to the new key with one line saying so; both
    set at once is one error naming both."""
    from grpo.config import RENAMED, _moved_key
    from grpo.settings import ConfigError

    base = {
        "model": {"path": "m"},
        "loss": {"gamma": 0.9, "dynamic_sampling": True, "max_sampling_rounds": 5},
        "rollout": {"gamma": 0.8},
    }
    with caplog.at_level(logging.WARNING, logger="grpo.config"):
        cfg = load_config(base=base)
    assert cfg.loss.token_discount == 0.9 and cfg.rollout.turn_discount == 0.8
    assert cfg.rollout.dynamic_sampling and cfg.rollout.max_sampling_rounds == 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all("is now" in m and "renamed" in m for m in lines), lines
    cfg = load_config(base={"model": {"path": "m"}}, overrides=["loss.gamma=0.7"])
    assert cfg.loss.token_discount == 0.7
    assert _moved_key("grpo.loss.dynamic_sampling") == "grpo.rollout.dynamic_sampling"
    assert set(RENAMED) == {
        "loss.dynamic_sampling",
        "loss.max_sampling_rounds",
        "loss.gamma",
        "rollout.gamma",
    }
    with pytest.raises(ConfigError, match="loss.gamma and loss.token_discount are both set"):
        load_config(base={"model": {"path": "m"}, "loss": {"gamma": 0.9, "token_discount": 1}})


@pytest.mark.process
def test_a_run_directory_saved_with_the_old_keys_resumes_and_evaluates(
    shared_tiny_model, tmp_path, monkeypatch
):
    """A run written before the keys moved (its config.yaml holds loss.gamma,
    loss.dynamic_sampling, loss.max_sampling_rounds and rollout.gamma, non-null, as every run
    directory saved them): `grpo train --config run/config.yaml --resume` continues it, the
    run's model resolves through that config (`resolve_trained`, as `grpo serve` and the tool
    do) and `grpo eval` evaluates it."""
    import json

    import yaml
    from conftest import LENGTH_REWARD, tiny_train_argv, write_package

    from grpo.apps import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_package(tmp_path, {"rewards.py": LENGTH_REWARD})
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        monkeypatch.delitem(sys.modules, name)
    argv = tiny_train_argv(
        shared_tiny_model, "train.max_steps=1", "train.output_dir=run", "train.save_every=1"
    )
    assert cli.main(argv) == 0
    saved = tmp_path / "run" / "config.yaml"
    data = yaml.safe_load(saved.read_text())
    # what the code before the move wrote
    data["loss"]["gamma"] = data["loss"].pop("token_discount")
    data["rollout"]["gamma"] = data["rollout"].pop("turn_discount")
    data["loss"]["dynamic_sampling"] = data["rollout"].pop("dynamic_sampling")
    data["loss"]["max_sampling_rounds"] = data["rollout"].pop("max_sampling_rounds")
    saved.write_text(yaml.safe_dump(data, sort_keys=False))
    resume = [
        "train",
        "--config",
        str(saved),
        "train.max_steps=2",
        "train.progress=false",
        "--resume",
    ]
    assert cli.main(resume) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    from grpo.loading import resolve_trained

    spec = resolve_trained(tmp_path / "run")  # through run/config.yaml, the old keys in it
    assert spec.adapters and Path(spec.adapters[-1]).name == "final"
    out = tmp_path / "eval.json"
    args = [
        "eval",
        "--model",
        spec.path,
        "--adapter",
        spec.adapters[-1],
        "--max-samples",
        "2",
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
    ]
    assert cli.main(args) == 0 and json.loads(out.read_text())
