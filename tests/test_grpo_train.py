"""The GRPO trainer: sampler log-probs = training recompute, micro-batching = full batch, the
clipping path is live, and `grpo train` runs end to end and resumes."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import live_lora, update_batch

from grpo.algo.logprobs import completion_logprobs
from grpo.apps import cli
from grpo.config import load_config
from grpo.models import load_model
from grpo.policy import Policy
from grpo.rollout import sample
from grpo.run.optim import build_optimizer, build_scheduler
from grpo.train.grpo import update_phase

REPO = Path(__file__).resolve().parents[1]


def make_cfg(tmp_path, *overrides):
    base = {"model": {"path": str(tmp_path)}, "train": {"batch_size": 8}}
    return load_config(base=base, overrides=list(overrides))


def rollout_batch(model, G=4, T=12, seed=0):
    prompts = [[5, 17, 33, 9], [101, 7]]
    r = sample(
        model,
        prompts,
        group_size=G,
        max_new_tokens=T,
        temperature=1.0,
        stop_ids=[3],
        seed=seed,
        pad_id=0,
    )
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(r.ids.shape[0], generator=g)
    # what the update reads, before the config gives its micro-batch plan (`as_update`)
    return SimpleNamespace(
        rollout=r, advantages=adv, counted_mask=r.completion_mask.clone(), ref_logprobs=None
    )


def as_update(cfg, batch):
    return update_batch(
        cfg, batch.rollout, batch.advantages, batch.counted_mask, batch.ref_logprobs
    )


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_training_recompute(tiny_checkpoints, lora, temperature):
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, ["q_proj", "v_proj", "lm_head"], std=0.05, seed=0)
    r = sample(
        model,
        [[5, 17, 33, 9], [101, 7]],
        group_size=3,
        max_new_tokens=10,
        temperature=temperature,
        stop_ids=[3],
        seed=1,
        pad_id=0,
    )
    model.train()  # the training path: train mode (no dropout configured)
    recomputed = completion_logprobs(
        model, r.ids, r.attention_mask(), r.prompt_width, r.completion_mask, temperature
    )
    diff = (recomputed - r.logprobs)[r.completion_mask].abs().max().item()
    assert diff <= 1e-5
    ratio = torch.exp(recomputed - r.logprobs)[r.completion_mask]
    assert (ratio - 1).abs().max().item() <= 1e-5


def run_update(tmp_path, model, batch, *overrides):
    cfg = make_cfg(tmp_path, *overrides)
    policy = Policy(model, None, [3], None, tmp_path, lora=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, 10, cfg.optim)
    return update_phase(cfg, policy, as_update(cfg, batch), opt, sched, params)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_equal_full_batch_update(tiny_checkpoints, tmp_path, aggregation):
    base = load_model(tiny_checkpoints("qwen3"))
    batch = rollout_batch(base)
    common = ["optim.lr=1e-3", f"loss.aggregation={aggregation}", "loss.beta=0"]
    # full rows (shared prefix off) cut anywhere, and the default shared prefix with
    # micro-batches of whole groups (G = 4)
    for mode, small in (("off", 2), ("auto", 4)):
        models = [copy.deepcopy(base), copy.deepcopy(base)]
        pin = f"train.shared_prefix={mode}"
        run_update(tmp_path, models[0], batch, *common, pin, "train.micro_batch_size=8")
        run_update(tmp_path, models[1], batch, *common, pin, f"train.micro_batch_size={small}")
        pairs = zip(base.parameters(), models[0].parameters())
        moved = max((a - b).abs().max().item() for a, b in pairs)
        assert moved > 1e-4  # the update really changed the weights
        # the accumulated (clipped) gradients, which the optimizer stepped with, agree to
        # float32 precision (Adam's first step, ~lr * sign(g), would amplify rounding in
        # near-zero entries: compare what the optimizer was given)
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            scale = a.grad.abs().max().clamp(min=1e-12)
            assert ((a.grad - b.grad).abs().max() / scale).item() <= 1e-5, mode


def test_clipping_path_is_live_with_mu_2(tiny_checkpoints, tmp_path):
    model = load_model(tiny_checkpoints("qwen3"))
    batch = rollout_batch(model)
    stats = run_update(
        tmp_path,
        model,
        batch,
        "optim.lr=0.05",
        "loss.num_iterations=2",
        "loss.beta=0",
        "optim.max_grad_norm=null",
    )
    assert stats["train/clip_frac_low"] + stats["train/clip_frac_high"] > 0
    assert stats["train/ratio_max"] > 1.2


# ------------------------------------------------- the step's statistics: read once per step

STEP = [
    "optim.lr=0.05",
    "loss.num_iterations=2",
    "loss.beta=0.04",
    "loss.tis_cap=2.0",
    "train.shared_prefix=off",
]


def stat_batch(model):
    """`rollout_batch` with reference log-probs, so that every stat (kl too) is live."""
    batch = rollout_batch(model)
    g = torch.Generator().manual_seed(1)
    noise = 0.2 * torch.randn(batch.rollout.logprobs.shape, generator=g)
    batch.ref_logprobs = torch.where(batch.counted_mask, batch.rollout.logprobs + noise, 0.0)
    return batch


def float_accumulation(records, grad_norms, passes):
    """What update_phase computed when it read every micro-batch's stats as floats (a copy of
    that code): `records` holds (loss.item(), {name: float}) per micro-batch, pass by pass."""
    sums, extremes, tokens, share, totals = {}, {}, 0.0, 0.0, []
    per_pass = len(records) // passes
    for p in range(passes):
        total = 0.0
        for loss, st in records[p * per_pass : (p + 1) * per_pass]:
            total += loss
            share += st["policy_loss"]
            w = st["tokens"]
            tokens += w
            for k, v in st.items():
                if k in ("tokens", "policy_loss"):
                    continue
                if k.endswith("_max") or k.endswith("_min"):
                    pick = max if k.endswith("_max") else min
                    extremes[k] = pick(extremes.get(k, v), v)
                else:
                    sums[k] = sums.get(k, 0.0) + v * w
        totals.append(total)
    out = {f"train/{k}": v / max(tokens, 1.0) for k, v in sums.items()}
    out.update({f"train/{k}": v for k, v in extremes.items()})
    out["train/loss"] = sum(totals) / passes
    out["train/policy_loss"] = share / passes
    out["train/grad_norm"] = sum(grad_norms) / passes
    return out


@pytest.mark.parametrize("micro", [8, 2])
def test_step_stats_equal_the_per_micro_batch_float_reads(
    tiny_checkpoints, tmp_path, monkeypatch, micro
):
    """The stats summed on the device equal, to 1e-12, the old per-micro-batch float sums of
    the same step (mu = 2 passes, 1 or 4 micro-batches, kl, entropy, clip and TIS stats)."""
    import grpo.train.grpo as trainer

    model = load_model(tiny_checkpoints("qwen3"))
    records, grad_norms = [], []
    real_loss, real_clip = trainer.policy_loss_on_device, torch.nn.utils.clip_grad_norm_

    def loss_spy(*args, **kwargs):
        loss, st, bad = real_loss(*args, **kwargs)
        records.append((loss.item(), {k: float(v) for k, v in st.items()}))
        return loss, st, bad

    def clip_spy(*args, **kwargs):
        norm = real_clip(*args, **kwargs)
        grad_norms.append(float(norm))
        return norm

    monkeypatch.setattr(trainer, "policy_loss_on_device", loss_spy)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_spy)
    stats = run_update(tmp_path, model, stat_batch(model), *STEP, f"train.micro_batch_size={micro}")
    assert len(records) == 2 * (8 // micro) and len(grad_norms) == 2
    want = float_accumulation(records, grad_norms, passes=2)
    assert {"train/kl", "train/entropy", "train/tis_weight_mean", "train/ratio_max"} <= set(want)
    assert stats["train/clip_frac_low"] + stats["train/clip_frac_high"] > 0  # pass 2 moved
    for k, v in want.items():
        assert stats[k] == pytest.approx(v, rel=1e-12, abs=0), k
        assert isinstance(stats[k], float), k


def test_stat_sums_of_tensors_equal_those_of_floats():
    """0-d tensors (float32 stats, int64 tokens), floats, or a mix: the same numbers, NaN
    handling of max / min included (Python's max(prev, v) keeps prev unless v is larger)."""
    from grpo.distributed import SINGLE
    from grpo.train.grpo import StatSums

    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(5):
        x = torch.rand(3, generator=g).tolist()
        records.append(
            {
                "kl": x[0],
                "ratio_max": x[1] if i != 2 else math.nan,
                "ratio_min": x[2] if i else math.nan,
                "policy_loss": -x[0],
                "tokens": float(7 + i),
            }
        )

    def as_tensor(k, v):
        dtype = torch.long if k == "tokens" else torch.float32
        return torch.tensor(v, dtype=dtype)

    floats = [{k: float(as_tensor(k, v)) for k, v in r.items()} for r in records]
    tensors = [{k: as_tensor(k, v) for k, v in r.items()} for r in records]
    mixed = [t if i % 2 else f for i, (f, t) in enumerate(zip(floats, tensors))]
    results = []
    for stats in (floats, tensors, mixed):
        sums = StatSums()
        for st in stats:
            sums.add(st)
        results.append(sums.reduce(SINGLE))
    want = results[0]
    assert math.isnan(want["train/ratio_min"])  # the first NaN sticks, a later one does not
    assert want["train/ratio_max"] == max(r["ratio_max"] for i, r in enumerate(floats) if i != 2)
    for got in results[1:]:
        assert got.keys() == want.keys()
        for k, v in got.items():
            assert isinstance(v, float), k
            assert v == want[k] or (math.isnan(v) and math.isnan(want[k])), k


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def count_host_reads(monkeypatch):
    """Counts of the tensor-to-host conversions while `counts["on"]` is set, but for those of
    the fused log-prob pass (`grpo_kernels`: its ids' range check reads the host once per forward,
    the forward's cost, not the statistics')."""
    counts = {"on": False, **dict.fromkeys(HOST_READS, 0)}
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            counts[_name] += counts["on"] and f"{os.sep}kernels{os.sep}" not in caller
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def test_update_phase_host_reads_do_not_grow_with_micro_batches(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """A host read per micro-batch stalls the GPU queue: the step reads its stats once per pass
    and once after the loop, so 4 micro-batches read the host as often as 1."""
    import grpo.train.grpo as trainer

    reads = {}
    for micro in (8, 2):
        model = load_model(tiny_checkpoints("qwen3"))
        batch = stat_batch(model)
        cfg = make_cfg(tmp_path, *STEP, f"train.micro_batch_size={micro}")
        policy = Policy(model, None, [3], None, tmp_path, lora=False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(params, cfg.optim)
        sched = build_scheduler(opt, 10, cfg.optim)
        counts = count_host_reads(monkeypatch)
        counts["on"] = True
        trainer.update_phase(cfg, policy, as_update(cfg, batch), opt, sched, params)
        counts["on"] = False
        monkeypatch.undo()
        reads[micro] = {k: counts[k] for k in HOST_READS}
    assert reads[2] == reads[8], reads
    assert sum(reads[8].values()) > 0  # the counting works (the step does read, per pass)


def test_update_phase_names_the_loss_and_the_batch_row(tiny_checkpoints, tmp_path):
    """A loss that returns inf from finite inputs is named with the step and its row of the
    batch, read after the pass (row 5 is in the third micro-batch of 2 rows)."""
    from grpo.algo import register_policy_loss
    from grpo.errors import GrpoError

    @register_policy_loss("test_inf_at_sentinel", overwrite=True)
    def inf_at_sentinel(log_ratio, advantages):
        return log_ratio + torch.where(advantages == 123.0, math.inf, 0.0)

    model = load_model(tiny_checkpoints("qwen3"))
    batch = rollout_batch(model)
    assert batch.counted_mask[5].any()
    batch.advantages[5] = 123.0
    cfg = make_cfg(
        tmp_path, "loss.policy_loss=test_inf_at_sentinel", "loss.beta=0", "train.micro_batch_size=2"
    )
    policy = Policy(model, None, [3], None, tmp_path, lora=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)
    before = [p.detach().clone() for p in params]
    sched = build_scheduler(opt, 10, cfg.optim)
    want = r"^step 7: policy loss 'test_inf_at_sentinel' returned a non-finite value at row 5 "
    with pytest.raises(GrpoError, match=want + "from finite inputs$"):
        update_phase(cfg, policy, as_update(cfg, batch), opt, sched, params, step=7)
    assert all(torch.equal(a, b) for a, b in zip(before, params))  # no update was taken


DESIGN_METRICS = [
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/frac_zero_std_groups",
    "rollout/completion_len_mean",
    "rollout/completion_len_min",
    "rollout/completion_len_max",
    "rollout/truncated_frac",
    "rewards/accuracy",
    "rewards/format",
    "train/loss",
    "train/policy_loss",
    "train/kl",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/ratio_max",
    "train/entropy",
    "train/grad_norm",
    "train/lr",
    "perf/step_s",
    "perf/rollout_s",
    "perf/logprob_s",
    "perf/update_s",
    "perf/tokens_per_s",
    "perf/peak_mem_mib",
]


def grpo_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "grpo", *args], cwd=cwd, capture_output=True, text=True
    )


def test_tiny_ci_end_to_end_and_resume(tmp_path):
    r = grpo_cli("tiny-model", "--out", "runs/tiny-model", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = str(REPO / "configs" / "tiny_ci.yaml")
    r = grpo_cli("train", "--config", cfg, "train.progress=false", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    # the command logs to stderr, a line per event (the in-process tests read caplog)
    assert re.search(
        r"^\d\d:\d\d:\d\d INFO grpo\.run\.loop: run: advantage grpo \|", r.stderr, re.M
    ), r.stderr[-2000:]
    run = tmp_path / "runs" / "tiny-ci"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    missing = [m for m in DESIGN_METRICS if m not in rows[-1]]
    assert not missing, missing
    assert "eval/accuracy" in rows[-1]
    assert (run / "config.yaml").is_file() and (run / "final" / "adapter_config.json").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    # Resume with a longer schedule: continues at step 4, does not restart.
    r = grpo_cli(
        "train",
        "--config",
        cfg,
        "train.max_steps=4",
        "train.progress=false",
        "--resume",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]


def test_resume_without_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["tiny-model", "--out", "m"]) == 0
    cfg = str(REPO / "configs" / "tiny_ci.yaml")
    code = cli.main(
        ["train", "--config", cfg, "model.path=m", "train.output_dir=empty", "--resume"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "no checkpoint" in err and "Traceback" not in err


@pytest.mark.parametrize("lora", [True, False])
def test_kl_monitoring_without_beta_leaves_the_update_alone(shared_tiny_model, tmp_path, lora):
    """beta = 0 with log.kl_every: KL to the reference is measured on those steps only (0 at
    step 1, where policy = reference; > 0 after updates) and the weights are bitwise those of
    a run that never measures it."""
    from safetensors.torch import load_file

    from grpo.metrics import read_metrics
    from grpo.rewards import register_reward
    from grpo.train.grpo import train_grpo

    def reply_length(completions, **_):
        return [len(c) / 50 for c in completions]

    register_reward("test_reply_length", reply_length, overwrite=True)

    def run(name: str, kl_every: int):
        cfg = load_config(
            REPO / "configs" / "tiny_ci.yaml",
            [
                f"model.path={shared_tiny_model}",
                f"train.output_dir={tmp_path / name}",
                f"lora.enabled={str(lora).lower()}",
                "loss.beta=0",
                f"log.kl_every={kl_every}",
                "train.max_steps=4",
                "train.save_every=0",
                "train.log_every=1",
                "data.eval_samples=0",
                "train.progress=false",
                "loss.num_iterations=1",
                "rewards=[{name: test_reply_length}]",  # random-init replies are never right
            ],
        )
        final = Path(train_grpo(cfg)["final"])
        weights = load_file(final / ("adapter_model.safetensors" if lora else "model.safetensors"))
        return read_metrics(tmp_path / name / "metrics.jsonl"), weights

    plain_rows, plain = run("plain", 0)
    every1_rows, every1 = run("every1", 1)
    every2_rows, every2 = run("every2", 2)
    assert all("train/kl" not in r for r in plain_rows)
    assert [("train/kl" in r) for r in every2_rows] == [False, True, False, True]
    kls = [r["train/kl"] for r in every1_rows]
    assert kls[0] < 1e-6 and all(k > 1e-7 for k in kls[1:]), kls
    assert kls[1] == pytest.approx(every2_rows[1]["train/kl"], rel=1e-5)
    for weights in (every1, every2):
        assert weights.keys() == plain.keys()
        assert all(torch.equal(weights[k], plain[k]) for k in plain)
