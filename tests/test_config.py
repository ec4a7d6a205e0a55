"""Config loading: YAML + dotted overrides, strict keys, validation naming the field, round trip."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from grpo.config import ConfigError, config_to_dict, load_config, save_config

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
        ("optim.lrr=1", r"unknown config key 'optim.lrr'; valid keys of optim: .*\blr\b"),
        ("optimizer.lr=1", r"unknown config key 'optimizer.lr'; valid keys: .*optim"),
        ("optim.lr=-1", r"optim.lr: must be > 0"),
        ("optim.lr=fast", r"optim.lr: expected a number"),
        ("rollout.group_size=1", r"rollout.group_size: must be >= 2"),
        ("loss.epsilon_low=0", r"loss.epsilon_low: must be > 0"),
        ("loss.kl_estimator=k4", r"loss.kl_estimator: unknown KL estimator 'k4'; registered: k1"),
        ("train.max_steps=2.5", r"train.max_steps: expected an integer"),
        ("lora.enabled=yesplease", r"lora.enabled: expected true/false"),
        ("optim.lr", r"must look like section.key=value"),
        ("log.kl_every=-1", r"log.kl_every: must be >= 0"),
    ],
)
def test_bad_values_name_the_field(cfg_file, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(cfg_file, [override])


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
    with pytest.raises(ConfigError, match=r"unknown config key train.'max_step'.*max_steps"):
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
