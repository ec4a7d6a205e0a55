"""Two gloo ranks equal one process: advantage estimators and policy losses run under torchrun
(CPU) on the conformance batch split over two ranks, compared with one process on the whole
batch.

Each rank holds half of the rows and only as many completion columns as its own longest row (so
ranks differ in T_c); estimators go through the trainer's `global_advantages`, losses through
`policy_loss` with the all-reduced normalizer. Every worker loads the plugins first, so
entries registered by a researcher's own module resolve by name in every rank.

    result = run_two_ranks(advantages=["my_rloo"], losses=["my_cispo"], plugins=["myalgo.ext"])
    check_two_ranks("policy_loss", "my_cispo", result)

The job is ``torchrun --nproc_per_node=2 -m grpo.testing.two_ranks_worker SPEC.json OUT.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from grpo.algo import compute_advantages, policy_loss
from grpo.plugins import load_plugins
from grpo.testing.conformance import (
    BUILTIN_EXTRAS,
    G,
    T,
    checking,
    close,
    expect,
    kit_rollout,
    label,
    loss_inputs,
    loss_settings,
    make_inputs,
)

KINDS = {"advantage": "advantage estimator", "policy_loss": "policy loss"}


def _entries(entries: Iterable[str] | Mapping[str, Mapping]) -> dict[str, dict]:
    """names, or {name: kwargs} -> {name: kwargs}."""
    if isinstance(entries, Mapping):
        return {n: dict(kw or {}) for n, kw in entries.items()}
    return {n: {} for n in entries}


def run_two_ranks(
    *,
    advantages: Iterable[str] | Mapping[str, Mapping] = (),
    losses: Iterable[str] | Mapping[str, Mapping] = (),
    plugins: Iterable[str] = (),
    timeout_s: float = 300.0,
) -> dict:
    """Run the entries on two gloo ranks (one torchrun job for all of them).

    Args:
        advantages, losses: registered names or ``package.module:function`` paths, or a
            mapping name -> kwargs (``loss.advantage_kwargs`` / ``loss.policy_loss_kwargs``).
        plugins: plugins every rank loads (`grpo.plugins.load_plugins`) before looking the
            names up.
        timeout_s: the job's wall-clock limit.

    Returns:
        the ranks' results (gathered advantages and gradients, summed losses, reduced stats),
        for `check_two_ranks`.

    Raises:
        RuntimeError: the job failed (its stderr's tail included).
    """
    spec = two_ranks_spec(advantages, losses, plugins)
    with tempfile.TemporaryDirectory(prefix="grpo_two_ranks_") as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "grpo.testing.two_ranks_worker",
            str(spec_path),
            str(out),
        ]
        # the workers see what this process imports from: its sys.path ("" = the cwd) first
        prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})  # theirs already
        paths = [os.path.abspath(p or os.curdir) for p in sys.path if not p.startswith(prefixes)]
        old = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
        }
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"two-rank job failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        return with_kwargs(json.loads(out.read_text()), spec)


def two_ranks_spec(
    advantages: Iterable[str] | Mapping[str, Mapping] = (),
    losses: Iterable[str] | Mapping[str, Mapping] = (),
    plugins: Iterable[str] = (),
) -> dict:
    """What every rank runs (`two_ranks_worker.run_rank`, as `run_two_ranks` takes them): the
    plugins to load first and each entry's kwargs."""
    return {
        "plugins": list(plugins),
        "advantages": _entries(advantages),
        "losses": _entries(losses),
    }


def with_kwargs(result: dict, spec: dict) -> dict:
    """Rank 0's result of `spec` as `check_two_ranks` reads it: with each entry's kwargs."""
    return {**result, "kwargs": {"advantage": spec["advantages"], "policy_loss": spec["losses"]}}


def check_two_ranks(
    kind: str,
    name: str,
    result: dict | None = None,
    *,
    plugins: Iterable[str] = (),
    kwargs: Mapping | None = None,
) -> None:
    """Two ranks equal one process for the advantage estimator or policy loss `name`.

    Args:
        kind: "advantage" or "policy_loss".
        name: registered name or ``package.module:function`` path (imported here too).
        result: from `run_two_ranks` (one job for many entries); None runs one for `name`.
        plugins: plugins to load (here and in the ranks) when `result` is None.
        kwargs: the entry's kwargs when `result` is None (else those it was run with).

    Raises:
        ConformanceError: the ranks disagree with one process (advantages within 1e-6; loss
            1e-6, gradient 1e-7, reduced stats rel 1e-6 / abs 1e-7), naming the check.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    load_plugins(list(plugins), "plugins")
    if result is None:
        entry = {name: dict(kwargs or {})}
        result = run_two_ranks(
            plugins=plugins, **{"advantages" if kind == "advantage" else "losses": entry}
        )
    with checking(label(KINDS[kind], name), "two_ranks"):
        kw = result["kwargs"][kind].get(name)
        expect(kw is not None, "the two-rank job did not run this entry")
        x = make_inputs()
        if kind == "advantage":
            rollout = kit_rollout(name, x["mask"], BUILTIN_EXTRAS.get(name, ()))
            want = compute_advantages(
                name, x["token_rewards"], x["mask"], group_size=G, params=kw, rollout=rollout
            )
            got = torch.tensor(result["advantages"][name])
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            return
        lp = x["logprobs"].clone().requires_grad_(True)
        loss, st = policy_loss(
            lp,
            x["old_logprobs"],
            x["ref_logprobs"],
            x["advantages"],
            x["mask"],
            loss_settings(name, kw),
            max_new_tokens=T,
            **loss_inputs(x),
        )
        (grad,) = torch.autograd.grad(loss, lp)
        got_loss, want_loss = result["losses"][name], loss.item()
        expect(
            close(got_loss, want_loss, atol=1e-6),
            f"loss {got_loss:.8g} on two ranks, {want_loss:.8g} in one process",
        )
        torch.testing.assert_close(torch.tensor(result["grads"][name]), grad, rtol=0, atol=1e-7)
        want_stats, got_stats = reduced_stats(st), result["stats"][name]
        expect(
            got_stats.keys() == want_stats.keys(),
            f"stats {sorted(got_stats)} on two ranks, {sorted(want_stats)} in one",
        )
        for k, v in want_stats.items():
            expect(
                close(got_stats[k], v, rtol=1e-6, atol=1e-7),
                f"stat {k}: {got_stats[k]!r} on two ranks, {v!r} in one process",
            )


def reduced_stats(stats: dict, dist=None) -> dict[str, float]:
    """The trainer's reduction of one batch's stats (token-weighted, over ranks)."""
    from grpo.distributed import SINGLE
    from grpo.run.stats import StatSums

    sums = StatSums()
    sums.add(stats)
    return sums.reduce(SINGLE if dist is None else dist)
