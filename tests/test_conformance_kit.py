"""The conformance kit (`grpo.testing`) from outside the package: docs/extending.md's worked
example runs as documented from a temporary directory (its estimator and loss pass every check,
two ranks included) and a broken copy fails naming the check; the functions name the failed
check for a broken loss, estimator and environment; the kit is optional (the core never loads
it, and it loads pytest only from its plugin)."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.algo import broadcast
from grpo.envs import Step
from grpo.testing import (
    BUILTIN_REFERENCES,
    ConformanceError,
    check_advantage,
    check_environment,
    check_policy_loss,
    policy_loss_checks,
)

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Checking your own variants: the conformance kit"


def doc_example() -> tuple[dict[str, str], list[str]]:
    """The section's files (python blocks whose first line is ``# <path>``) and its command."""
    text = (REPO / "docs" / "extending.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        first, _, rest = block.partition("\n")
        if re.fullmatch(r"# [\w/]+\.py", first):
            files[first[2:]] = rest
    (command,) = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert set(files) == {"myalgo/ext.py"}, files
    return files, shlex.split(command)


def run_documented(tmp_path: Path, files: dict[str, str], command: list[str], *extra: str):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert command[:3] == ["python", "-m", "pytest"], command
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, *command[1:], "-v", "-p", "no:cacheprovider", *extra]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)


def outcomes(stdout: str) -> dict[str, str]:
    """test id -> PASSED / FAILED from `pytest -v` lines."""
    return dict(re.findall(r"::(test_\S+) (PASSED|FAILED|ERROR)", stdout))


def test_doc_example_passes_from_outside(tmp_path):
    files, command = doc_example()
    r = run_documented(tmp_path, files, command)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    got = outcomes(r.stdout)
    assert set(got.values()) == {"PASSED"}
    assert {
        "test_two_ranks[advantage-my_rloo]",
        "test_two_ranks[policy_loss-my_cispo]",
        "test_advantage[my_rloo-shift_invariant]",
        "test_advantage[my_rloo-group_zero_sum]",
        "test_policy_loss[my_cispo-gradient:token_mean]",
        "test_policy_loss[my_cispo-masked_garbage]",
    } <= set(got)
    assert {
        "test_policy_loss[my_cispo-gradient:token_mean@asymmetric]",
        "test_policy_loss[my_cispo-padding_columns@dual_clip]",
    } <= set(got)
    assert not any("[clip-" in t or "[grpo-" in t for t in got)  # only the plugin's entries
    # 5 estimator checks, 6 loss checks x 3 settings (given, asymmetric, dual clip), 2 two-rank
    assert len(got) == 5 + 18 + 2, sorted(got)


def test_broken_loss_fails_naming_the_check(tmp_path):
    files, command = doc_example()
    good = "clamp(max=1 + epsilon_high)"
    assert good in files["myalgo/ext.py"]
    broken = {
        "myalgo/ext.py": files["myalgo/ext.py"].replace(good, "clamp(max=1 + 2 * epsilon_high)")
    }
    r = run_documented(tmp_path, broken, command, "-k", "not two_ranks")
    assert r.returncode == 1, r.stdout[-3000:]
    failed = sorted(t for t, o in outcomes(r.stdout).items() if o != "PASSED")
    aggregations = ("seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean")
    assert failed == sorted(
        f"test_policy_loss[my_cispo-gradient:{a}{v}]"
        for a in aggregations
        for v in ("", "@asymmetric", "@dual_clip")
    )
    assert "policy loss 'my_cispo': gradient:token_mean failed: loss " in r.stdout


def test_the_functions_name_the_failed_check():
    def nan_loss(logprobs, advantages):  # log of a negative advantage: NaN on counted tokens
        return -torch.log(advantages) * logprobs

    with pytest.raises(
        ConformanceError,
        match=r"policy loss 'test_the_.*nan_loss': "
        r"masked_garbage failed: .*non-finite value at row",
    ):
        check_policy_loss(nan_loss, BUILTIN_REFERENCES["clip"], checks=["masked_garbage"])

    def batch_normalized(logprobs, advantages):  # a batch statistic: micro-batches differ
        return -advantages / advantages.abs().mean() * logprobs

    with pytest.raises(ConformanceError, match="micro_batches failed"):
        check_policy_loss(batch_normalized, None, checks=["micro_batches"])
    with pytest.raises(ConformanceError, match="gradient:token_mean failed: no float64 reference"):
        check_policy_loss("clip", None, checks=["gradient:token_mean"])

    def pad_dependent(scores, mask, *, group_size):  # divides by the padded width T_c
        r = scores.view(-1, group_size)
        return broadcast((r - r.mean(1, keepdim=True)).view(-1) / mask.shape[1], mask)

    check_advantage(pad_dependent, checks=["shape_and_equal_groups"])
    with pytest.raises(ConformanceError, match="masked_rows_and_padding failed"):
        check_advantage(pad_dependent)


class _Env:
    tools: list = []

    def __init__(self, broken: str = ""):
        self.broken = broken

    def start(self, row):
        if self.broken == "start":  # a prompt of its own: the group would not share one
            return [{"role": "user", "content": secrets.token_hex(4)}]
        return None

    def step(self, text, token_ids):
        if self.broken == "step" and "tool_call" in text:
            return {"observation": "not a Step"}
        return Step(observation=None, done=True, info={"tool_calls": 0})


def test_environment_checks():
    check_environment(_Env)
    with pytest.raises(ConformanceError, match="environment '_Env': start failed: .* differs"):
        check_environment(_Env, kwargs={"broken": "start"})
    with pytest.raises(ConformanceError, match="steps failed: .*returned dict, expected"):
        check_environment(_Env, kwargs={"broken": "step"})


def test_the_kit_is_optional():
    # importing the kit needs no pytest; the core (everything but grpo.testing) never loads it
    code = (
        "import sys, grpo.testing, grpo.testing.two_ranks_worker\n"
        "assert 'pytest' not in sys.modules, 'grpo.testing imports pytest'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


# three mistakes researchers make, seeded into otherwise correct losses


def flipped_sign(log_ratio, advantages, *, epsilon_low=0.2, epsilon_high=0.2):
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return torch.minimum(ratio * advantages, clipped * advantages)  # the minus sign dropped


def ratio_over_padding(log_ratio, advantages, mask, *, epsilon_low=0.2, epsilon_high=0.2):
    seq = log_ratio.mean(-1, keepdim=True).expand_as(log_ratio)  # mean over every column
    ratio = torch.exp(seq)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def swapped_eps(log_ratio, advantages, *, epsilon_low=0.2, epsilon_high=0.2):
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_high, 1 + epsilon_low)  # the bounds swapped
    return -torch.minimum(ratio * advantages, clipped * advantages)


@pytest.mark.parametrize(
    "loss, reference, first, cause",
    [
        (
            flipped_sign,
            "clip",
            "gradient:token_mean",
            "is the negative of its reference's (a flipped sign)",
        ),
        (ratio_over_padding, "gspo", "gradient:token_mean", "it reads padding"),
        (
            swapped_eps,
            "clip",
            "gradient:token_mean@asymmetric",
            "it equals the reference with epsilon_low and epsilon_high swapped",
        ),
    ],
)
def test_seeded_bugs_are_caught_naming_the_cause(loss, reference, first, cause):
    """Each mistake fails its first check with a message that names it, with the numbers and
    the settings; the swapped clip bounds pass at the default symmetric settings (what the kit
    alone checked before) and fail at the asymmetric pair. The references are given by path."""
    with pytest.raises(ConformanceError) as e:
        check_policy_loss(loss, BUILTIN_REFERENCES[reference])
    message = str(e.value)
    assert f": {first} failed: loss " in message and cause in message, message
    if loss is swapped_eps:
        assert "(at epsilon_low=0.2, epsilon_high=0.28)" in message
        check_policy_loss(
            loss,
            BUILTIN_REFERENCES["clip"],
            checks=[c for c in policy_loss_checks() if "@" not in c],
        )


def test_settings_reach_the_loss_and_its_reference_and_paths_resolve(tmp_path, monkeypatch):
    """`settings=` sets any loss.* field for both; a reference may be a module path; an
    unknown setting or check is named."""
    (tmp_path / "myref.py").write_text(
        "from grpo.testing.references import BUILTIN_REFERENCES\n"
        "clip_ref = BUILTIN_REFERENCES['clip']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check_policy_loss("clip", "myref:clip_ref", settings={"epsilon_high": 0.35, "dual_clip": 2.5})
    with pytest.raises(ConformanceError, match="swapped"):
        check_policy_loss(
            swapped_eps,
            "myref:clip_ref",
            settings={"epsilon_high": 0.35},
            checks=["gradient:token_mean"],
        )
    with pytest.raises(ValueError, match="'epsilon_hi'.*not loss settings"):
        check_policy_loss(
            "clip",
            BUILTIN_REFERENCES["clip"],
            settings={"epsilon_hi": 0.3},
            checks=["gradient:token_mean"],
        )
    with pytest.raises(ValueError, match="unknown policy loss check 'gradient:token_mean@nope'"):
        check_policy_loss("clip", BUILTIN_REFERENCES["clip"], checks=["gradient:token_mean@nope"])


def test_group_zero_sum_names_the_group_and_its_sum():
    def off_by_one_group(scores, mask, *, group_size):
        r = scores.view(-1, group_size)
        a = r - r.mean(1, keepdim=True)
        a[1] += 0.5  # group 1 no longer sums to 0
        return broadcast(a.view(-1), mask)

    with pytest.raises(
        ConformanceError,
        match=r"group_zero_sum failed: group 1 of 4 rows sums "
        r"to 2 \(tolerance 1e-05\); 1 of 4 groups miss it",
    ):
        check_advantage(off_by_one_group, checks=["group_zero_sum"])
