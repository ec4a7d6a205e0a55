"""Log-prob kernels by name (`model.logprob_impl`, `grpo_kernels.register_logprob_impl`,
`bench_logprobs --impl`) and the kernel conformance check (`grpo.testing.check_logprob_impl`):
docs/extending.md's kernel, as a user writes it, passes the check, trains (the trainer calls
it, and it agrees with the sampler) and is benchmarked beside the built-ins; seeded kernel bugs
are caught naming the check and the numbers."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
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


def entropy_ignores_temperature(
    hidden, weight, ids, temperature=1.0, return_entropy=False, *, entropy_grad=False, tf32=False
):
    lp = grpo_kernels.chunked_logprobs(hidden, weight, ids, temperature)
    if not (return_entropy or entropy_grad):
        return lp
    _, ent = grpo_kernels.chunked_logprobs(
        hidden, weight, ids, 1.0, True, entropy_grad=entropy_grad
    )
    return lp, ent  # the entropy of softmax(z), not of softmax(z / T)


def test_an_entropy_that_ignores_the_temperature_is_caught():
    with pytest.raises(ConformanceError) as e:
        check_logprob_impl(
            entropy_ignores_temperature, dtypes=(torch.float32,), checks=["temperature"]
        )
    message = str(e.value)
    assert ": temperature failed: entropy: max error" in message and "T=0.7" in message, message
    assert "\n" not in message


class RowChunks(torch.autograd.Function):
    """Log-probs whose backward runs 16 rows at a time and accumulates d weight in the weight's
    dtype (as Liger's fused linear cross entropy does in bfloat16); `leak`: rows with a zero
    upstream gradient count with this one in d weight (a masking bug)."""

    @staticmethod
    def forward(ctx, h, w, ids, temperature, leak):
        ctx.save_for_backward(h, w, ids)
        ctx.temperature, ctx.leak = temperature, leak
        z = (h.float() @ w.float().t()) / temperature
        return z.gather(1, ids[:, None])[:, 0] - torch.logsumexp(z, 1)

    @staticmethod
    def backward(ctx, g):
        h, w, ids = ctx.saved_tensors
        masked = g == 0
        d_h, d_w = torch.empty_like(h), torch.zeros_like(w)
        for s in range(0, h.shape[0], 16):
            rows = slice(s, s + 16)
            hs = h[rows].float()
            p = (hs @ w.float().t() / ctx.temperature).softmax(1)
            onehot = torch.nn.functional.one_hot(ids[rows], w.shape[0]).float()
            gs = torch.where(masked[rows], ctx.leak, g[rows])
            dz = (onehot - p) * gs[:, None] / ctx.temperature
            d_h[rows] = torch.where(masked[rows, None], 0.0, dz @ w.float()).to(h.dtype)
            d_w += (dz.t() @ hs).to(w.dtype)
        return d_h, d_w, None, None, None


def row_chunks(leak: float):
    def logprobs(hidden, weight, ids, temperature=1.0, return_entropy=False, **kw):
        return RowChunks.apply(hidden, weight, ids, temperature, leak)

    return logprobs


def test_ignored_rows_holds_a_kernel_to_its_dtypes_budget():
    # bfloat16 rounding over another row order is within bfloat16's budget (float32's
    # tolerances failed it)
    check_logprob_impl(row_chunks(0.0), dtypes=(torch.bfloat16,), checks=["ignored_rows"])
    with pytest.raises(ConformanceError) as e:  # masked rows leaking into d weight: caught
        check_logprob_impl(row_chunks(0.05), dtypes=(torch.bfloat16,), checks=["ignored_rows"])
    message = str(e.value)
    assert ": ignored_rows failed: d weight: " in message and "\n" not in message, message


REGISTERS = """
import grpo_kernels
from my_pkg.kernel import logprobs


def broken(hidden, weight, ids, temperature=1.0, return_entropy=False, **kw):
    lp = grpo_kernels.chunked_logprobs(hidden, weight, ids, temperature)
    if not return_entropy:
        return lp
    return lp, grpo_kernels.chunked_logprobs(hidden, weight, ids, 1.0, True)[1]  # T ignored


grpo_kernels.register_logprob_impl("my_kernel", logprobs)
grpo_kernels.register_logprob_impl("my_broken_kernel", broken)
"""


def test_the_pytest_entry_finds_a_plugins_kernels(my_pkg):
    from grpo.testing import registered_by

    (my_pkg / "my_pkg" / "registers.py").write_text(REGISTERS)
    entries = registered_by(["my_pkg.registers"])
    assert entries.logprob_impls == ("my_broken_kernel", "my_kernel") and entries


@pytest.mark.process
def test_the_pytest_entry_checks_a_plugins_kernels(my_pkg):
    (my_pkg / "my_pkg" / "registers.py").write_text(REGISTERS)
    path = [str(my_pkg), str(REPO), str(REPO / "kernels")]  # this checkout's grpo
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-m", "pytest", "-p", "grpo.testing.plugin", "--pyargs", "grpo.testing"]
    cmd += ["--grpo-plugin", "my_pkg.registers", "-k", "logprob_impl and temperature"]
    cmd += ["-v", "-p", "no:cacheprovider"]
    r = subprocess.run(cmd, cwd=my_pkg, capture_output=True, text=True, env=env, timeout=300)
    got = dict(re.findall(r"::(test_logprob_impl\S+) (PASSED|FAILED)", r.stdout))
    assert got == {
        "test_logprob_impl[my_broken_kernel-temperature]": "FAILED",
        "test_logprob_impl[my_kernel-temperature]": "PASSED",
    }, r.stdout[-3000:] + r.stderr[-2000:]
    assert "my_broken_kernel': temperature failed: entropy: max error" in r.stdout


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


def raises(hidden, weight, ids, temperature=1.0, return_entropy=False, **kwargs):
    raise RuntimeError("shared memory exceeded\\n  (a second line of detail)")
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


def test_an_error_in_a_kernel_is_one_line_naming_it(my_pkg, shared_tiny_model, monkeypatch, capsys):
    """A plug-in kernel that raises stops the run with one line naming it (as a registry's
    plug-in does), not a 25-60-line traceback through the trainer."""
    monkeypatch.chdir(my_pkg)
    code = train_with_kernel(my_pkg, shared_tiny_model, "my_pkg.broken:raises")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert (
        "log-prob kernel 'my_pkg.broken:raises' raised RuntimeError: shared memory exceeded "
        "(a second line of detail)"
    ) in err


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
    modes = {"fwd", "fwd_bwd", "fwd_bwd_entropy", "fwd_bwd_frozen", "bwd"}
    assert {r["mode"] for r in mine} == modes
    (trainers,) = [r for r in mine if r["mode"] == "fwd_bwd_entropy"]  # the trainer's call
    assert trainers["ent_err"] <= 1e-5 and trainers["median_ms"] > 0
    for r in rows:
        if r.get("median_ms") and r["mode"] != "bwd":
            assert r["lp_err"] <= 1e-5 and r["tok_per_s"] > 0 and r["gb_per_s"] > 0
        if "pct_roofline" in r:
            assert 0 < r["pct_roofline"] <= 100 + 1e-9
        assert r["dtype"] == "float32"
    broken = [r for r in rows if r["impl"] == "my_pkg.broken:logprobs"]
    assert broken and all(
        r["note"].startswith("MISMATCH vs float64")
        for r in broken
        if r["mode"] not in ("fwd_bwd_entropy", "bwd")
    )
    (entropy,) = [r for r in broken if r["mode"] == "fwd_bwd_entropy"]  # it returns none
    assert entropy["note"] == (
        "error: TypeError: asked for the entropy (return_entropy=True), it returned none"
    )
    assert all("median_ms" not in r for r in broken)
    # the stored command reproduces the run, the outside kernels included
    assert result["meta"]["command"] == "python -m benchmarks.bench_logprobs " + shlex.join(argv)
    kernel = result["meta"]["outside_kernels"]["my_pkg.kernel:logprobs"]
    source = (my_pkg / "my_pkg" / "kernel.py").read_bytes()
    assert kernel["sha256"] == hashlib.sha256(source).hexdigest()[:16]
    assert (
        kernel["function"] == "my_pkg.kernel:logprobs"
        and result["meta"]["triton_interpret"] is None
    )
    with pytest.raises(SystemExit) as e:
        bench_logprobs.main(["--quick", "--impl", "no_such.mod:f"])
    assert e.value.code == 2


def test_grpo_bench_logprobs_runs_from_the_package(my_pkg, monkeypatch, capsys):
    """`grpo bench logprobs` (the installed package's, not benchmarks/): a tiny CPU shape, the
    stored command with TRITON_INTERPRET, the outside kernel's hash; results under
    ./bench_results outside a checkout is `RESULTS_DIR`'s default (here: --out-dir)."""
    monkeypatch.chdir(my_pkg)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--quick", "--shapes", "16x8x50", "--impls", "chunked", "--repeats", "1"]
    args += ["--modes", "fwd_bwd_entropy", "--impl", "my_pkg.kernel:logprobs"]
    args += ["--out-dir", "out", "--name", "b"]
    assert cli.main(["bench", "logprobs", *args]) == 0
    meta = json.loads((my_pkg / "out" / "b.json").read_text())["meta"]
    assert meta["command"] == "TRITON_INTERPRET=1 grpo bench logprobs " + shlex.join(args)
    assert meta["triton_interpret"] == "1"
    digest = hashlib.sha256((my_pkg / "my_pkg" / "kernel.py").read_bytes()).hexdigest()[:16]
    assert meta["outside_kernels"]["my_pkg.kernel:logprobs"]["sha256"] == digest
    rows = json.loads((my_pkg / "out" / "b.json").read_text())["rows"]
    assert {r["impl"] for r in rows if r.get("median_ms", 0) > 0} == {
        "chunked",
        "my_pkg.kernel:logprobs",
    }
    assert "grpo.apps.bench" in sys.modules and "benchmarks.bench_logprobs" not in str(
        sys.modules["grpo.apps.bench.logprobs"].__file__
    )


def test_a_negative_derived_backward_time_is_noted():
    from grpo.apps.bench.logprobs import derived_rows

    medians = {("fwd_bwd", "a"): 1.0, ("fwd", "a"): 1.5, ("fwd_bwd", "b"): 3.0, ("fwd", "b"): 1.0}
    neg, pos = derived_rows(medians, ["a", "b", "c"], "1x2x3", "float32")
    assert neg["median_ms"] == -0.5 and "is negative (fwd_bwd timed faster than fwd)" in neg["note"]
    assert pos["median_ms"] == 2.0 and pos["note"] == "derived: fwd_bwd - fwd"
