"""Log-prob kernels by name (`model.logprob_impl`, `grpo_kernels.register_logprob_impl`,
`bench_logprobs --impl`) and the kernel conformance check (`grpo.testing.check_logprob_impl`):
docs/extending.md's kernel, as a user writes it, passes the check, trains (the trainer calls
it, and it agrees with the sampler) and is benchmarked beside the built-ins; seeded kernel bugs
are caught naming the check and the numbers."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import LENGTH_REWARD, docs_example, write_package

import grpo_kernels
from benchmarks import bench_logprobs
from grpo.apps import cli
from grpo.checks import check_config
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.settings import ConfigError
from grpo.testing import ConformanceError, check_logprob_impl

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")

# the docs' kernel, counting its calls into a file (which process called it, how many rows)
COUNTING = """
import os
from my_pkg.kernel import logprobs as inner

def logprobs(hidden, weight, ids, *args, **kwargs):
    with open(os.environ["KERNEL_CALLS"], "a") as f:
        f.write(f"{hidden.shape[0]}\\n")
    return inner(hidden, weight, ids, *args, **kwargs)
"""


@pytest.fixture()
def my_pkg(tmp_path, monkeypatch):
    write_package(
        tmp_path,
        {
            "kernel.py": docs_example("# my_pkg/kernel.py"),
            "counting.py": COUNTING,
            "rewards.py": LENGTH_REWARD,
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        monkeypatch.delitem(sys.modules, name)  # another test's my_pkg: import this one
    return tmp_path


def test_the_docs_kernel_passes_the_check_by_path_and_by_name(my_pkg):
    check_logprob_impl("my_pkg.kernel:logprobs")  # float32 and bfloat16, every check
    from my_pkg.kernel import logprobs

    grpo_kernels.register_logprob_impl("test_docs_kernel", logprobs, overwrite=True)
    assert "test_docs_kernel" in grpo_kernels.available_impls()
    check_logprob_impl("test_docs_kernel", checks=["forward", "backward"])
    h, w = torch.randn(5, 8), torch.randn(30, 8)
    ids = torch.tensor([0, 3, 29, 7, 7])
    got = grpo_kernels.fused_logprobs(h, w, ids, 0.9, impl="test_docs_kernel")
    torch.testing.assert_close(got, grpo_kernels.fused_logprobs(h, w, ids, 0.9, impl="naive"))
    with pytest.raises(ValueError, match="ids must lie in"):  # checked before the kernel runs
        grpo_kernels.fused_logprobs(h, w, torch.tensor([0, 1, 2, 3, 30]), impl="test_docs_kernel")


def forgets_temperature(
    hidden, weight, ids, temperature=1.0, return_entropy=False, *, entropy_grad=False, tf32=False
):
    return grpo_kernels.chunked_logprobs(
        hidden, weight, ids, 1.0, return_entropy, entropy_grad=entropy_grad
    )


def logits_in_bf16(
    hidden, weight, ids, temperature=1.0, return_entropy=False, *, entropy_grad=False, tf32=False
):
    z = (hidden @ weight.t()) / temperature  # the input dtype: bf16 logits, bf16 logsumexp
    out = (z.gather(1, ids[:, None])[:, 0] - torch.logsumexp(z, 1)).float()
    if not return_entropy:
        return out
    zf = z.float()
    entropy = torch.logsumexp(zf, 1) - (zf.softmax(1) * zf).sum(1)
    return out, entropy if entropy_grad else entropy.detach()


def no_entropy_gradient(
    hidden, weight, ids, temperature=1.0, return_entropy=False, *, entropy_grad=False, tf32=False
):
    out = grpo_kernels.naive_logprobs(hidden, weight, ids, temperature, return_entropy)
    return (out[0], out[1].detach()) if return_entropy else out  # entropy_grad ignored


@pytest.mark.parametrize(
    "kernel, check, detail",
    [
        (forgets_temperature, "temperature", "log-probs: max error"),
        (logits_in_bf16, "forward", "(bfloat16, N=37 C=64 V=1003)"),
        (no_entropy_gradient, "entropy_grad", "d hidden: max error"),
    ],
)
def test_seeded_kernel_bugs_are_caught(kernel, check, detail):
    with pytest.raises(ConformanceError) as e:
        check_logprob_impl(kernel)
    message = str(e.value)
    assert f": {check} failed: " in message and detail in message, message
    assert "the same-dtype torch reference's" in message or "allowed" in message


def test_training_calls_the_configured_kernel(my_pkg, shared_tiny_model, monkeypatch, capsys):
    calls = my_pkg / "calls.txt"
    monkeypatch.setenv("KERNEL_CALLS", str(calls))
    monkeypatch.chdir(my_pkg)
    code = cli.main(
        [
            "train",
            "--config",
            TINY,
            f"model.path={shared_tiny_model}",
            "train.progress=false",
            "data.eval_samples=0",
            "rollout.compile=off",
            "train.log_every=1",
            "train.max_steps=2",
            "train.output_dir=run",
            "rewards=[{name: my_pkg.rewards:length}]",
            "model.logprob_impl=my_pkg.counting:logprobs",
        ]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(x) for x in (my_pkg / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "log-probs my_pkg.counting:logprobs" in rows[0]["run/precision"]
    steps = [m for m in rows if "rollout/logprob_diff_max" in m]
    assert len(steps) == 2
    for m in steps:  # the kernel's log-probs are the sampler's: the first pass is on-policy
        assert m["rollout/logprob_diff_max"] <= 1e-4
    n = calls.read_text().split()
    # every pass of each step: reference (beta > 0) and two update passes, each micro-batch
    assert len(n) >= 2 * 3 and all(int(x) > 0 for x in n)


# kernels that train silently wrong today: no log-sum-exp (log-probs off by log Z, ~6 nats on
# the tiny model) and NaN log-probs (which the non-finite guard blamed on the learning rate)
BROKEN = """
import torch


def no_lse(hidden, weight, ids, temperature=1.0, return_entropy=False, *, entropy_grad=False,
           tf32=False):
    z = (hidden.float() @ weight.float().t()) / temperature
    out = z.gather(1, ids[:, None].long())[:, 0]  # - torch.logsumexp(z, -1) forgotten
    if not return_entropy:
        return out
    lse = torch.logsumexp(z, dim=-1)
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return out, entropy if entropy_grad else entropy.detach()


def nan(hidden, weight, ids, temperature=1.0, return_entropy=False, **kwargs):
    out = no_lse(hidden, weight, ids, temperature, return_entropy, **kwargs)
    first = out[0] if return_entropy else out
    bad = first - torch.logsumexp((hidden.float() @ weight.float().t()) / temperature, -1)
    bad = torch.where(torch.arange(len(bad)) == 0, float("nan"), bad)
    return (bad, out[1]) if return_entropy else bad
"""


def train_with_kernel(my_pkg, model, impl: str, *overrides: str) -> int:
    (my_pkg / "my_pkg" / "broken.py").write_text(BROKEN)
    return cli.main(
        [
            "train",
            "--config",
            TINY,
            f"model.path={model}",
            "train.progress=false",
            "data.eval_samples=0",
            "rollout.compile=off",
            "train.max_steps=1",
            "train.output_dir=run",
            "rewards=[{name: my_pkg.rewards:length}]",
            f"model.logprob_impl={impl}",
            *overrides,
        ]
    )


def test_a_kernel_without_the_log_sum_exp_is_refused_before_any_update(
    my_pkg, shared_tiny_model, monkeypatch, capsys
):
    """The first pass of a step scores the tokens with the policy that sampled them, so its
    gap to the sampler's log-probs is numeric only: a kernel missing the log-sum-exp (a gap of
    nats) stops the run at step 1, naming the kernel and the gap, before any update; the gap a
    correct kernel leaves is far below train.max_logprob_gap (tests/test_on_policy.py), and 0
    turns the check off."""
    monkeypatch.chdir(my_pkg)
    code = train_with_kernel(my_pkg, shared_tiny_model, "my_pkg.broken:no_lse")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert (
        "step 1: the trainer's log-probs (model.logprob_impl='my_pkg.broken:no_lse') differ "
        "from the sampler's (its float32 log_softmax) by "
    ) in err
    assert "above train.max_logprob_gap=0.5" in err
    gap = float(err.split(" by ")[1].split(" nats")[0])
    assert gap > 1.0, err  # log Z of a 256-token vocabulary, not a rounding
    assert not (my_pkg / "run" / "checkpoints").exists() and not (my_pkg / "run" / "final").exists()
    code = train_with_kernel(
        my_pkg, shared_tiny_model, "my_pkg.broken:no_lse", "train.max_logprob_gap=0", "--overwrite"
    )
    assert code == 0, capsys.readouterr().err[-3000:]


def test_nan_log_probs_from_a_kernel_name_the_kernel(
    my_pkg, shared_tiny_model, monkeypatch, capsys
):
    """A kernel whose log-probs are NaN where the sampler's are finite (the same policy, before
    any update) is named at its first step, not a skipped update that the non-finite guard
    later blames on optim.lr."""
    monkeypatch.chdir(my_pkg)
    code = train_with_kernel(my_pkg, shared_tiny_model, "my_pkg.broken:nan")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert (
        "step 1: the trainer's log-probs (model.logprob_impl='my_pkg.broken:nan') are not "
        "finite at "
    ) in err
    assert "the log-prob kernel (or the model's training forward) made them" in err
    assert "optim.lr" not in err


def test_a_replaced_kernel_is_named_with_its_replacement(monkeypatch):
    """A built-in name that a plug-in replaced (recorded in run/replaced) is named with the
    function it now means, as the message's kernel."""
    from grpo import plugins
    from grpo.run.stats import check_first_pass

    replaced = plugins.Replacement("logprob impl", "chunked", "a:old", "my_pkg.k:fast", "plug X")
    monkeypatch.setattr(plugins, "_REPLACED", [replaced])
    # 8 counted tokens, |diff| summing to 48: 6 nats per token (max 6.5)
    with pytest.raises(GrpoError) as e:
        check_first_pass([48.0, 8.0, 6.5, 0.0, 0.0], 3, "default", "chunked", 0.5)
    assert str(e.value).startswith(
        "step 3: the trainer's log-probs (model.logprob_impl='chunked', replaced by "
        "my_pkg.k:fast (plug X)) differ from the sampler's (its float32 log_softmax) by 6 nats "
        "per counted token on average (max 6.5) before any update"
    ), str(e.value)
    check_first_pass([3.9, 8.0, 2.0, 0.0, 0.0], 3, "default", "chunked", 0.5)  # 0.4875 passes
    check_first_pass([48.0, 8.0, 6.5, 0.0, 0.0], 3, "default", "chunked", None)  # not checked


def test_config_names_a_bad_kernel(shared_tiny_model):
    def checked(impl: str):
        return check_config(
            load_config(TINY, [f"model.path={shared_tiny_model}", f"model.logprob_impl={impl}"])
        )

    with pytest.raises(ConfigError, match="model.logprob_impl: unknown log-prob impl 'nope'"):
        checked("nope")
    with pytest.raises(ConfigError, match="model.logprob_impl: log-prob impl 'no_such.mod:f'"):
        checked("no_such.mod:f")


def test_the_benchmark_times_an_outside_kernel_beside_the_built_ins(my_pkg, tmp_path):
    (my_pkg / "my_pkg" / "broken.py").write_text(
        "import grpo_kernels\n"
        "def logprobs(h, w, ids, temperature=1.0, return_entropy=False, **kw):\n"
        "    return grpo_kernels.naive_logprobs(h, w, ids, temperature) + 0.01\n"
    )
    argv = [
        "--quick",
        "--shapes",
        "64x32x300",
        "--impls",
        "naive,chunked",
        "--repeats",
        "1",
        "--impl",
        "my_pkg.kernel:logprobs",
        "--impl",
        "my_pkg.broken:logprobs",
        "--out-dir",
        str(tmp_path / "out"),
        "--name",
        "mine",
    ]
    bench_logprobs.main(argv)
    result = json.loads((tmp_path / "out" / "mine.json").read_text())
    rows = result["rows"]
    mine = [r for r in rows if r["impl"] == "my_pkg.kernel:logprobs"]
    assert {r["mode"] for r in mine} == {"fwd", "fwd_bwd", "fwd_bwd_frozen", "bwd"}
    for r in rows:
        if r.get("median_ms") and r["mode"] != "bwd":
            assert r["lp_err"] <= 1e-5 and r["tok_per_s"] > 0 and r["gb_per_s"] > 0
        if "pct_roofline" in r:
            assert 0 < r["pct_roofline"] <= 100 + 1e-9
        assert r["dtype"] == "float32"
    broken = [r for r in rows if r["impl"] == "my_pkg.broken:logprobs"]
    assert broken and all(r["note"].startswith("MISMATCH vs float64") for r in broken)
    assert all("median_ms" not in r for r in broken)
    # the stored command reproduces the run, the outside kernels included
    assert result["meta"]["command"] == "python -m benchmarks.bench_logprobs " + shlex.join(argv)
    with pytest.raises(SystemExit) as e:
        bench_logprobs.main(["--quick", "--impl", "no_such.mod:f"])
    assert e.value.code == 2
