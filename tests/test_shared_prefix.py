"""The shared-prefix training forward (each group's prompt run once, its keys and values
repeated to the group's rows) gives the full-row forward's log-probs and gradients: LoRA and
full weights, left-padded prompts of different lengths, single and multi-turn rollouts."""

from __future__ import annotations

import pytest
import torch
from conftest import live_lora

from grpo.algo.logprobs import completion_logprobs
from grpo.lora import apply_lora
from grpo.models import load_model
from grpo.precision import Precision
from grpo.rollout import Sampler, sample
from grpo.rollout.multiturn import sample_turns
from grpo.rollout.sampler import Observation

PROMPTS = [[5, 17, 33, 9, 12, 40], [101, 7], [44, 45, 46]]  # different lengths: left padding


def rollout(model, G=3):
    return sample(
        model,
        PROMPTS,
        group_size=G,
        max_new_tokens=9,
        temperature=1.0,
        stop_ids=[3],
        seed=0,
        pad_id=0,
    )


def multiturn(model, G=2):
    def observe(b, ids, stopped):
        return Observation([], done=True) if b % 2 else Observation([200, 201][: b % 3 + 1])

    return sample_turns(
        Sampler(model),
        PROMPTS,
        group_size=G,
        observe=observe,
        max_new_tokens=5,
        max_turns=2,
        max_total_tokens=20,
        stop_ids=[3],
        turn_end_ids=list(range(4, 40)),
        seed=1,
        pad_id=0,
    )


def logprobs_and_grads(model, r, shared: bool, holes: bool = False):
    model.zero_grad(set_to_none=True)
    lp = completion_logprobs(
        model,
        r.ids,
        r.attention_mask(),
        r.prompt_width,
        r.generated_mask,
        0.7,
        has_holes=holes,
        group_size=r.group_size if shared else None,
    )
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)  # a loss touching every token
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("turns", ["single", "multi"])
def test_shared_prefix_equals_full_rows(tiny_checkpoints, lora, turns):
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, ["q_proj", "v_proj", "down_proj"], std=0.05, seed=0)
    r = rollout(model) if turns == "single" else multiturn(model)
    holes = turns == "multi"
    model.train()
    full_lp, full_g = logprobs_and_grads(model, r, shared=False, holes=holes)
    shared_lp, shared_g = logprobs_and_grads(model, r, shared=True, holes=holes)
    m = r.generated_mask
    assert (shared_lp - full_lp)[m].abs().max().item() <= 1e-5
    assert (shared_lp[~m] == 0).all()
    assert full_g.keys() == shared_g.keys() and full_g
    for n in full_g:
        scale = full_g[n].abs().max().clamp(min=1e-12)
        assert ((shared_g[n] - full_g[n]).abs().max() / scale).item() <= 1e-5, n


def test_rows_must_form_groups(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        completion_logprobs(
            model, r.ids, r.attention_mask(), r.prompt_width, r.completion_mask, group_size=4
        )


def test_update_with_shared_prefix_equals_full_rows(tiny_checkpoints, tmp_path):
    """A whole update (micro-batches of whole groups, mu 2, KL to the reference) moves the
    weights the same with train.shared_prefix on and off. AdamW's eps 1 makes the step
    linear in the gradient (eps 1e-8 turns float32 rounding of a near-zero gradient into a
    full lr-sized step either way)."""
    import copy

    from grpo.config import load_config
    from grpo.experience.batch import RolloutBatch, outcome_token_rewards
    from grpo.policy import Policy
    from grpo.run.optim import build_optimizer, build_scheduler
    from grpo.train.grpo import step_batch, update_phase

    base = load_model(tiny_checkpoints("qwen3"))
    apply_lora(base, rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=0)
    r = rollout(base)
    rewards = torch.randn(9, generator=torch.Generator().manual_seed(0))
    moved = {}
    for mode in ("off", "on"):
        model = copy.deepcopy(base)
        cfg = load_config(
            base={"model": {"path": str(tmp_path)}},
            overrides=[
                f"train.shared_prefix={mode}",
                "train.batch_size=9",
                "train.micro_batch_size=3",
                "rollout.group_size=3",
                "rollout.temperature=0.7",
                "loss.num_iterations=2",
                "loss.beta=0.04",
                "optim.lr=0.1",
                "optim.eps=1.0",
            ],
        )
        assert cfg.shared_prefix_groups == (3 if mode == "on" else None)
        policy = Policy(model, None, [3], None, tmp_path, lora=True)
        batch = RolloutBatch(
            rollout=r,
            rows=[{}] * 9,
            texts=[""] * 9,
            rewards=rewards,
            token_rewards=outcome_token_rewards(rewards, r.completion_mask),
            per_fn={},
            policy_version=0,
            frac_zero_std=0.0,
        )
        batch = step_batch(cfg, policy, batch, step=1)  # reference log-probs, advantages
        assert batch.ref_logprobs is not None
        params = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(params, cfg.optim)
        update_phase(cfg, policy, batch, opt, build_scheduler(opt, 10, cfg.optim), params)
        moved[mode] = {
            n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
        }
    start = dict(base.named_parameters())
    assert max((moved["off"][n] - start[n]).abs().max() for n in moved["off"]) > 1e-4
    for n in moved["off"]:
        diff = (moved["on"][n] - moved["off"][n]).abs().max().item()
        assert diff <= 1e-6, n


def test_on_needs_whole_groups_per_micro_batch(tmp_path):
    from grpo.config import load_config
    from grpo.settings import ConfigError

    cfg = load_config(
        base={"model": {"path": str(tmp_path)}},
        overrides=[
            "train.shared_prefix=on",
            "train.batch_size=8",
            "train.micro_batch_size=2",
            "rollout.group_size=4",
        ],
    )
    with pytest.raises(ConfigError, match="train.shared_prefix: 'on' needs micro-batches"):
        cfg.check_grpo()
    auto = load_config(
        base={"model": {"path": str(tmp_path)}},
        overrides=[
            "train.shared_prefix=auto",
            "train.batch_size=8",
            "train.micro_batch_size=2",
            "rollout.group_size=4",
        ],
    )
    assert auto.shared_prefix_groups is None  # auto falls back to full rows


def test_defaults_share_the_prefix_and_compile_where_supported(tmp_path):
    from grpo.config import load_config

    cfg = load_config(
        base={"model": {"path": str(tmp_path)}},
        overrides=["train.batch_size=8", "rollout.group_size=4"],
    )
    assert cfg.train.shared_prefix == "auto" and cfg.shared_prefix_groups == 4
    assert cfg.rollout.compile == "auto"
    ckpt = load_config(
        base={"model": {"path": str(tmp_path), "gradient_checkpointing": True}},
        overrides=["train.batch_size=8", "rollout.group_size=4"],
    )
    assert ckpt.shared_prefix_groups == 4  # the shared-prefix passes checkpoint too
    as_bool = load_config(
        base={"model": {"path": str(tmp_path)}},
        overrides=["rollout.compile=true", "train.shared_prefix=false"],
    )
    assert as_bool.rollout.compile == "on" and as_bool.train.shared_prefix == "off"


@pytest.mark.parametrize("turns", ["single", "multi"])
@pytest.mark.parametrize("shared", ["on", "off"])
def test_micro_batches_run_only_their_own_columns(tiny_checkpoints, tmp_path, turns, shared):
    """Each micro-batch (here one group) is trimmed to the columns its rows use; the trainer's
    log-probs equal a full-width forward's."""
    from grpo.config import load_config
    from grpo.experience.batch import column_bounds, micro_batch_plan
    from grpo.train.grpo import reference_phase

    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model, G=3) if turns == "single" else multiturn(model, G=3)
    B, T = r.ids.shape
    attn = r.attention_mask()
    bounds = column_bounds(attn, [slice(i, i + 3) for i in range(0, B, 3)], r.prompt_width)
    for i, (lo, hi) in enumerate(bounds):  # hand-checked: first and last real column
        real = attn[3 * i : 3 * i + 3].any(0).nonzero().flatten()
        assert (lo, hi) == (int(real[0]), max(int(real[-1]) + 1, r.prompt_width + 1))
    assert any(lo > 0 or hi < T for lo, hi in bounds)  # some micro-batch is trimmed
    cfg = load_config(
        base={"model": {"path": str(tmp_path)}},
        overrides=[
            "rollout.group_size=3",
            f"train.batch_size={B}",
            "train.micro_batch_size=3",
            f"train.shared_prefix={shared}",
            "loss.beta=0.1",
            "rollout.temperature=0.7",
        ],
    )
    plan = micro_batch_plan(r, cfg.train.micro_batch_size)
    assert [mb.cols for mb in plan] == bounds
    assert [mb.rows for mb in plan] == [slice(i, i + 3) for i in range(0, B, 3)]
    policy = type("P", (), {"model": model, "ref_model": None, "precision": Precision()})()
    ref = reference_phase(cfg, policy, r, r.generated_mask.clone(), plan, 1)
    with torch.no_grad():
        full = completion_logprobs(
            model, r.ids, attn, r.prompt_width, r.generated_mask, 0.7, has_holes=turns == "multi"
        )
    assert ref.shape == full.shape
    assert (ref - full).abs().max().item() <= 1e-5
