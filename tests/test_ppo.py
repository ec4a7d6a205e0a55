"""PPO with a critic: GAE and the value loss against float64 hand computations (gamma = lambda
= 1 giving returns-to-go minus values, a masked multi-turn row), the `gae` estimator through
the conformance kit with a float64 twin, the critic's values at the right positions whatever
the padding, its weights shared with a LoRA policy's frozen base, its start from a reward
model, `grpo train` with the critic (warm-up freezing the policy, checkpoints holding what
trains, a killed run resuming bitwise), and the config refusals. DDP and FSDP with the critic
equal one process in tests/test_distributed.py (ddp_worker's PPO case)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import LENGTH_REWARD, tiny_train, tiny_train_here, write_package
from safetensors.torch import load_file

from grpo.algo.advantages import EstimatorRollout, compute_advantages, gae_returns
from grpo.algo.losses import value_loss
from grpo.checks import check_config
from grpo.config import load_config
from grpo.distributed import SINGLE
from grpo.errors import GrpoError
from grpo.settings import ConfigError
from grpo.testing.conformance import check_advantage

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")


def gae_by_hand(rewards, values, mask, gamma, lam):
    """float64, one row at a time, over the row's counted tokens only: A_i = sum_l (gamma
    lam)^l delta_{i+l}, delta_i = r_i + gamma V_{i+1} - V_i (V after the last = 0)."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        cols = [t for t in range(T) if mask[b][t]]
        r = [float(rewards[b][t]) for t in cols]
        v = [float(values[b][t]) for t in cols] + [0.0]
        delta = [r[i] + gamma * v[i + 1] - v[i] for i in range(len(cols))]
        for i, t in enumerate(cols):
            adv[b][t] = sum((gamma * lam) ** k * delta[i + k] for k in range(len(cols) - i))
    return adv


def random_batch(seed=0, B=6, T=7, holes=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    if holes:  # observation stretches inside rows
        mask[:, 2:4] = False
        mask[:, 0] = True
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    return rewards, values, mask


@pytest.mark.parametrize(
    "gamma, lam, holes",
    [(0.9, 0.8, False), (1.0, 0.95, True), (0.99, 0.0, True), (0.7, 1.0, False)],
)
def test_gae_equals_the_float64_sum_of_discounted_deltas(gamma, lam, holes):
    rewards, values, mask = random_batch(1, holes=holes)
    adv, ret = gae_returns(rewards, values, mask, gamma, lam)
    want = torch.tensor(
        gae_by_hand(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam),
        dtype=torch.float64,
    )
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, want + values, 0.0), rtol=0, atol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_with_gamma_and_lambda_one_is_returns_to_go_minus_values():
    rewards, values, mask = random_batch(2)
    adv, ret = gae_returns(rewards, values, mask, 1.0, 1.0)
    r = torch.where(mask, rewards, 0.0)
    to_go = r.flip(1).cumsum(1).flip(1)  # sum of the row's rewards from t on
    torch.testing.assert_close(adv, torch.where(mask, to_go - values, 0.0), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, to_go, 0.0), rtol=0, atol=1e-12)


def test_gae_skips_observation_tokens_of_a_multi_turn_row():
    """Actions a0 a1 | observation o o | a2: a step reward 0.5 on a1 (its turn's last token),
    the outcome 1 on a2; the observation tokens' rewards and values (9) are never read.
    gamma 0.9, lambda 0.5, by hand:
        delta(a2) = 1 - 0.4 = 0.6                      A(a2) = 0.6
        delta(a1) = 0.5 + 0.9 * 0.4 - 0.2 = 0.66       A(a1) = 0.66 + 0.45 * 0.6 = 0.93
        delta(a0) = 0 + 0.9 * 0.2 - 0.1 = 0.08         A(a0) = 0.08 + 0.45 * 0.93 = 0.4985
    """
    mask = torch.tensor([[True, True, False, False, True]])
    rewards = torch.tensor([[0.0, 0.5, 9.0, 9.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4]], dtype=torch.float64)
    adv, ret = gae_returns(rewards, values, mask, 0.9, 0.5)
    want = torch.tensor([[0.4985, 0.93, 0.0, 0.0, 0.6]], dtype=torch.float64)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        ret, torch.tensor([[0.5985, 1.13, 0.0, 0.0, 1.0]], dtype=torch.float64), rtol=0, atol=1e-12
    )


def rollout_with(values, mask):
    return EstimatorRollout(
        completion_ids=torch.where(mask, 7, 0),
        completion_mask=mask,
        generated_mask=mask,
        turn_ids=torch.where(mask, 0, -1),
        logprobs=torch.zeros(mask.shape),
        prompt_lens=torch.ones(mask.shape[0], dtype=torch.long),
        extras={"values": values},
    )


def test_the_gae_estimator_whitens_over_the_batch_and_reports_the_critic():
    rewards, values, mask = random_batch(3, B=8)
    reported: dict = {}
    adv = compute_advantages(
        "gae",
        rewards.float(),
        mask,
        group_size=4,
        eps=1e-4,
        gamma=0.95,
        gae_lambda=0.9,
        rollout=rollout_with(values.float(), mask),
        metrics=reported,
    )
    raw = torch.tensor(
        gae_by_hand(
            rewards.float().double().tolist(),
            values.float().double().tolist(),
            mask.tolist(),
            0.95,
            0.9,
        ),
        dtype=torch.float64,
    )
    x = raw[mask]
    want = torch.where(mask, (raw - x.mean()) / (x.std() + 1e-4), 0.0)  # unbiased std
    torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-5)
    ret = (raw + values.float().double())[mask]
    v = values.float().double()[mask]
    ev = 1 - float((ret - v).var() / ret.var())
    assert math.isclose(reported["advantage/explained_variance"], ev, rel_tol=1e-5)
    assert math.isclose(reported["advantage/return_mean"], float(ret.mean()), rel_tol=1e-5)
    assert math.isclose(reported["advantage/value_mean"], float(v.mean()), rel_tol=1e-5)
    plain = compute_advantages(
        "gae",
        rewards.float(),
        mask,
        group_size=4,
        gamma=0.95,
        gae_lambda=0.9,
        params={"whiten": False},
        rollout=rollout_with(values.float(), mask),
    )
    torch.testing.assert_close(plain.double(), raw, rtol=1e-5, atol=1e-5)


def gae_twin(token_rewards, mask, rollout, *, gamma, gae_lambda, eps, whiten=True):
    """The `gae` estimator in float64 loops, for the conformance kit's reference check."""
    values = rollout.extras["values"].double()
    raw = torch.tensor(
        gae_by_hand(
            token_rewards.double().tolist(), values.tolist(), mask.tolist(), gamma, gae_lambda
        ),
        dtype=torch.float64,
    )
    if not whiten:
        return raw
    x = raw[mask]
    return torch.where(mask, (raw - x.mean()) / (x.std() + eps), 0.0)


@pytest.mark.parametrize("kwargs", [{}, {"whiten": False}])
def test_the_gae_estimator_passes_the_conformance_kit(kwargs):
    check_advantage("gae", reference=gae_twin, kwargs=kwargs, extras=("values",))


def test_the_gae_estimator_without_values_names_the_critic():
    rewards, _, mask = random_batch(4)
    with pytest.raises(GrpoError, match=r"modules: \[\{name: critic\}\]"):
        compute_advantages("gae", rewards.float(), mask, group_size=2)


def test_the_value_loss_equals_a_hand_computation():
    """V = (1.0, 0.5, -0.2), V_old = (0.8, 0.9, 0.0), R = (1.5, 0.0, 0.3), c = 0.2:
    unclipped 1/2 (V - R)^2 = (0.125, 0.125, 0.125); clipped V_old + clip(V - V_old) =
    (1.0, 0.7, -0.2), 1/2 (. - R)^2 = (0.125, 0.245, 0.125); the max picks the clipped value
    of the second token only (where moving V further from V_old would have helped)."""
    v = torch.tensor([1.0, 0.5, -0.2], dtype=torch.float64)
    old = torch.tensor([0.8, 0.9, 0.0], dtype=torch.float64)
    ret = torch.tensor([1.5, 0.0, 0.3], dtype=torch.float64)
    loss, clipped = value_loss(v, old, ret, 0.2)
    torch.testing.assert_close(
        loss, torch.tensor([0.125, 0.245, 0.125], dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert clipped.tolist() == [False, True, False]
    loss, clipped = value_loss(v, old, ret, None)
    torch.testing.assert_close(
        loss, torch.full((3,), 0.125, dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert not clipped.any()
    # its gradient: (V - R) where unclipped wins, 0 where the clipped branch is flat
    vg = v.clone().requires_grad_(True)
    value_loss(vg, old, ret, 0.2)[0].sum().backward()
    torch.testing.assert_close(
        vg.grad, torch.tensor([-0.5, 0.0, -0.5], dtype=torch.float64), rtol=0, atol=1e-12
    )


# ------------------------------------------------------------------------------- the critic


def tiny_cfg(model, *over, modules="[{name: critic}]"):
    return load_config(
        TINY, [f"model.path={model}", "loss.advantage=gae", f"modules={modules}", *over]
    )


def build(cfg):
    from grpo.modules.module_set import ModuleSet
    from grpo.policy import build_policy

    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    modules = ModuleSet(cfg.check_grpo(), policy, SINGLE, torch.device("cpu"), 3)
    return policy, modules.items[0].module


def test_a_lora_critic_shares_the_policy_base_and_trains_only_adapter_and_head(
    shared_tiny_model,
):
    policy, critic = build(tiny_cfg(shared_tiny_model))
    ours = critic.model.layers[0].self_attn.q_proj
    theirs = policy.model.layers[0].self_attn.q_proj
    assert ours.weight is theirs.weight  # one frozen base in memory
    assert critic.model.embed_tokens.weight is policy.model.embed_tokens.weight
    assert ours.lora_a is not theirs.lora_a  # its own adapter
    trained = set(critic.checkpoint_state())
    assert trained and all("lora_" in k or k == "model.score.weight" for k in trained)
    assert float(critic.model.score.weight.detach().abs().max()) == 0.0  # a new head: V = 0
    _, full = build(tiny_cfg(shared_tiny_model, "lora.enabled=false", "loss.beta=0"))
    assert all(p.requires_grad for p in full.parameters())
    assert set(full.checkpoint_state()) == set(full.state_dict())


def test_critic_values_sit_at_the_positions_that_predict_each_token(shared_tiny_model):
    """Left-padded prompts and right-padded completions of a sampled batch: each value equals
    the head on the hidden state, computed row by row without any padding, of the position
    just before that completion token."""
    from grpo.rollout import sample

    policy, critic = build(tiny_cfg(shared_tiny_model))
    with torch.no_grad():
        critic.model.score.weight.normal_(0, 1.0)  # values that differ
    r = sample(
        policy.model,
        [[5, 17, 33, 9, 21], [101, 7]],
        group_size=2,
        max_new_tokens=6,
        temperature=1.0,
        stop_ids=[3],
        seed=0,
        pad_id=0,
    )
    with torch.no_grad():
        got = critic.values(r, slice(0, 4))
        for b in range(4):
            prompt = r.ids[b, r.prompt_width - int(r.prompt_lens[b]) : r.prompt_width]
            n = int(r.completion_mask[b].sum())
            row = torch.cat([prompt, r.completion_ids[b, :n]])[None]
            h = critic.model(row, return_hidden=True)[0]
            want = h[len(prompt) - 1 : len(prompt) - 1 + n] @ critic.model.score.weight[0]
            torch.testing.assert_close(got[b, :n], want, rtol=1e-5, atol=1e-5)
            assert (got[b, n:] == 0).all()


def test_a_critic_starts_from_a_reward_model_head(shared_tiny_model, tmp_path):
    from grpo.models import load_model, save_pretrained

    rm = load_model(shared_tiny_model, num_labels=1, pad_token_id=0)
    with torch.no_grad():
        rm.score.weight.normal_(0, 0.5)
    save_pretrained(rm, tmp_path / "rm")
    _, critic = build(
        tiny_cfg(
            shared_tiny_model, modules=f"[{{name: critic, kwargs: {{init: {tmp_path / 'rm'}}}}}]"
        )
    )
    torch.testing.assert_close(critic.model.score.weight.float(), rm.score.weight.float())
    assert critic.model.score.weight.requires_grad


def critic_on_two_ranks(dist, model: str) -> tuple[list[str], float]:
    """On each rank of the pool: a LoRA critic's ModuleSet (its start-up broadcast) and a
    backward through the critic's trained tensors; (the warnings seen, a sum of its state)."""
    import warnings

    from grpo.modules.module_set import ModuleSet
    from grpo.policy import build_policy

    cfg = tiny_cfg(model)
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        modules = ModuleSet(cfg.check_grpo(), policy, dist, torch.device("cpu"), 3)
        state = modules.items[0].module.checkpoint_state()
        loss = sum((t.double() ** 2).sum() for t in state.values())
        loss.backward()
    return [str(w.message) for w in seen], float(loss)


def test_two_ranks_start_a_lora_critic_without_broadcast_warnings(rank_pool, shared_tiny_model):
    """The ranks' start-up broadcast of a LoRA critic's parameters (trainable tensors) ran
    under autograd: c10d's broadcast_, which has no backward, warned "may lead to silently
    incorrect behavior" at every rank's first backward (issue 64). Under no_grad it is gone,
    and the ranks start from the same weights."""
    replies = rank_pool.run("test_ppo:critic_on_two_ranks", str(shared_tiny_model))
    for said, _ in replies:
        assert not [w for w in said if "broadcast" in w], said
    assert replies[0][1] == replies[1][1]


def test_a_critic_beside_an_estimator_that_reads_no_values_is_said_once(shared_tiny_model):
    from grpo.run.notices import start_notices

    said = start_notices(tiny_cfg(shared_tiny_model, "loss.advantage=grpo"), "grpo")
    assert any("the critic trains beside loss.advantage='grpo'" in line for line in said), said
    assert not any("critic" in line for line in start_notices(tiny_cfg(shared_tiny_model)))


def test_a_critic_from_a_checkpoint_of_another_tokenizer_is_refused(shared_tiny_model, tmp_path):
    """The critic reads the policy's token ids as they are: an `init` whose tokenizer maps
    tokens to other ids (one token more here), or whose vocabulary without tokenizer files is
    too small for them, is an error naming modules[critic].kwargs.init, not a critic that
    trains on the wrong tokens (or crashes in an embedding lookup)."""
    import shutil

    from grpo.models import Decoder, ModelConfig, save_pretrained
    from grpo.tokenizer import load_tokenizer

    other = tmp_path / "other_tokenizer"
    shutil.copytree(shared_tiny_model, other)
    tok = load_tokenizer(other)
    tok.add_tokens(["<an_extra_token>"])
    tok.save_pretrained(other)
    with pytest.raises(GrpoError, match=r"modules\[critic\].kwargs.init: .* another tokenizer"):
        build(tiny_cfg(shared_tiny_model, modules=f"[{{name: critic, kwargs: {{init: {other}}}}}]"))

    mc = ModelConfig.from_hf(json.loads((shared_tiny_model / "config.json").read_text()))
    small = tmp_path / "small_vocab"
    save_pretrained(Decoder(ModelConfig(**{**mc.__dict__, "vocab_size": 40})), small)
    with pytest.raises(GrpoError, match=r"vocabulary of 40 tokens and no tokenizer files"):
        build(tiny_cfg(shared_tiny_model, modules=f"[{{name: critic, kwargs: {{init: {small}}}}}]"))


@pytest.mark.parametrize(
    "over, field",
    [
        (["modules=[]"], "loss.advantage"),
        (["rollout.turn_discount=0.9", "rollout.env=calculator"], "rollout.turn_discount"),
        (
            ["loss.advantage=grpo", "modules=[]", "train.critic_warmup_steps=2"],
            "train.critic_warmup_steps",
        ),
        (["modules=[{name: critic, kwargs: {valu_clip: 0.2}}]"], "modules[0].kwargs"),
        (["train.critic_warmup_steps=4", "train.max_steps=4"], "must be below train.max_steps"),
        (["loss.gae_lambda=1.5"], "loss.gae_lambda"),
    ],
)
def test_ppo_settings_that_cannot_work_are_named(shared_tiny_model, over, field):
    with pytest.raises(ConfigError) as e:
        cfg = load_config(
            TINY,
            [
                f"model.path={shared_tiny_model}",
                "loss.advantage=gae",
                "modules=[{name: critic}]",
                *over,
            ],
        )
        check_config(cfg, "grpo")
    assert field in str(e.value)


# --------------------------------------------------------------------------- grpo train


# the critic, killing its own process (SIGKILL) at a policy version, for the resume test
KILLER = """
import os, signal
from grpo.modules.critic import Critic, critic
from grpo.modules.module_set import register_trained_module

class KilledCritic(Critic):
    def attach(self, batch):
        if str(batch.policy_version) == os.environ.get("KILL_AT_VERSION"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().attach(batch)

@register_trained_module("killed_critic")
def killed_critic(config, dist, policy, model_config, tokenizer, scoring, **kwargs):
    made = critic(config, dist, policy, **kwargs)
    made.__class__ = KilledCritic
    return made
"""


@pytest.fixture()
def my_pkg(tmp_path):
    return write_package(tmp_path, {"rewards.py": LENGTH_REWARD, "killer.py": KILLER})


def grpo_train(cwd, model, *args, env=None):
    return tiny_train(
        cwd,
        model,
        "loss.advantage=gae",
        "loss.kl_in_reward=0.05",
        "plugins=[my_pkg.killer]",
        *args,
        env=env,
    )


def step_rows(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [r for r in rows if "module/critic/loss" in r]


def test_ppo_trains_with_its_critic_and_warms_the_critic_up_first(
    my_pkg, shared_tiny_model, monkeypatch, capsys
):
    code = tiny_train_here(
        monkeypatch,
        my_pkg,
        shared_tiny_model,
        "loss.advantage=gae",
        "loss.kl_in_reward=0.05",
        "train.output_dir=run",
        "train.max_steps=3",
        "train.critic_warmup_steps=2",
        "train.save_every=2",
        "modules=[{name: critic, optim: {lr: 0.01}}]",
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = step_rows(my_pkg / "run" / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert [m.get("train/policy_frozen") for m in rows] == [1.0, 1.0, None]
    assert "train/policy_loss" in rows[2] and "train/policy_loss" not in rows[0]
    for m in rows:
        assert m["module/critic/loss"] >= 0 and m["module/critic/grad_norm"] > 0
        assert 0 <= m["module/critic/clip_frac"] <= 1
        assert "advantage/return_mean" in m and "advantage/value_mean" in m
    assert rows[0]["advantage/value_mean"] == 0.0  # a new head
    assert rows[1]["advantage/value_mean"] != 0.0  # one critic update later
    # the warm-up steps did not move the policy: its adapter is still the initial (B = 0) one
    ckpt = my_pkg / "run" / "checkpoints" / "step_000002"
    adapter = load_file(ckpt / "trainable.safetensors")
    assert all(float(v.abs().max()) == 0 for k, v in adapter.items() if "lora_b" in k)
    critic = load_file(ckpt / "modules" / "critic" / "weights.safetensors")
    assert all("lora_" in k or k == "model.score.weight" for k in critic)  # not the base
    final = load_file(my_pkg / "run" / "final" / "adapter_model.safetensors")
    assert any(float(v.abs().max()) > 0 for k, v in final.items() if "lora_B" in k)


@pytest.mark.process
def test_a_killed_ppo_run_resumes_bitwise(my_pkg, shared_tiny_model):
    """SIGKILL at step 3 (after the step-2 checkpoint); `--resume` ends where the run never
    stopped ends: the policy's adapter and the critic (adapter and head), bitwise."""
    common = [
        "train.max_steps=4",
        "train.save_every=2",
        "loss.num_iterations=2",
        "modules=[{name: killed_critic, label: critic, optim: {lr: 0.01}}]",
    ]
    whole = grpo_train(my_pkg, shared_tiny_model, "train.output_dir=whole", *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = grpo_train(
        my_pkg, shared_tiny_model, "train.output_dir=cut", *common, env={"KILL_AT_VERSION": "2"}
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = grpo_train(my_pkg, shared_tiny_model, "train.output_dir=cut", *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rel in ("adapter_model.safetensors", "modules/critic/weights.safetensors"):
        a = load_file(my_pkg / "whole" / "final" / rel)
        b = load_file(my_pkg / "cut" / "final" / rel)
        assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a), rel
    want = step_rows(my_pkg / "whole" / "metrics.jsonl")
    got = step_rows(my_pkg / "cut" / "metrics.jsonl")
    keys = ("module/critic/loss", "advantage/explained_variance", "train/policy_loss")
    assert [[m.get(k) for k in keys] for m in got] == [[m.get(k) for k in keys] for m in want]
