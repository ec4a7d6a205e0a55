"""PPO's critic: a value model trained beside the policy, a trained module (grpo.modules).

    modules:
      - name: critic                 # this factory
        kwargs: {value_clip: 0.2}    # its options (`critic` below)
        optim: {lr: 1.0e-5}          # its own AdamW and schedule
    loss: {advantage: gae, gae_lambda: 0.95}

The value model is our decoder with a scalar head on every position (`score`, one output):
V(s_t), the value of the state before completion token t, is read at the position that
predicts token t, as the policy's log-prob of t is. Each step, after the rollout, `attach`
puts the values of every completion token into the batch's extras (``values``, no grad); the
`gae` estimator (grpo.algo.advantages) turns the token rewards and those values into
advantages; after the policy's update, `loss` fits the values to the returns R = A + V_old
(GAE's lambda-returns, recomputed here from the same token rewards, before any whitening):

    L_V = coef * 1/2 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

per counted token (`value_clip` c; unclipped: 1/2 (V - R)^2), aggregated as loss.aggregation
aggregates the policy loss over the global batch (the normalizer summed over ranks).

Initialisation: the policy's base by default (with model.adapter folded in); with LoRA, the
critic shares the policy's frozen base weights in memory (its own adapter and head on top), so
a critic costs an adapter, a head and their optimizer states, not a second model (not under
train.parallel: fsdp, where the policy's weights are sharded: the critic then loads its own
copy, replicated on every rank). `init` names any checkpoint instead: a reward model from
`grpo rm` (its score head becomes the value head) or a causal LM (a new zero head). The critic
reads the policy's token ids as they are (it does not re-encode the text), so `init` must have
the policy's tokenizer (`grpo.tokenizer.check_same_vocabulary`; the `reward_model` reward, by
contrast, re-renders and re-encodes each completion with its own tokenizer).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from grpo.algo.advantages import gae_returns
from grpo.algo.kl import reward_minus_kl
from grpo.algo.losses import aggregate, loss_normalizer, value_loss
from grpo.distributed import all_reduce_sum
from grpo.errors import GrpoError
from grpo.lora import apply_lora, load_adapter, unwrap_lora
from grpo.models import Decoder, load_model
from grpo.models.decoder import meta_decoder, rope_inv_freq
from grpo.modules.base import TrainedModule, register_trained_module
from grpo.tokenizer import check_same_vocabulary

if TYPE_CHECKING:
    from grpo.policy import Policy

log = logging.getLogger(__name__)


class Critic(TrainedModule):
    """A value model (module docstring): `model` is a `Decoder` with a one-output `score` head.

    Args:
        model: the value model.
        cfg: the run's config (loss.token_discount, loss.gae_lambda, loss.aggregation, ...).
        dist: the trainer ranks (the loss's normalizer is summed over them).
        value_clip: c of the clipped value loss; None: unclipped.
        coef: the value loss's coefficient.
        micro_batch_size: rows per forward (default: train.micro_batch_size).
        lora: whether the model trains LoRA factors (checkpoints then hold only what trains).
        updates: optimizer steps per training step on the step's batch (PPO's epochs).
    """

    def __init__(
        self,
        model: Decoder,
        cfg,
        dist,
        value_clip: float | None,
        coef: float,
        micro_batch_size: int,
        lora: bool,
        updates: int = 1,
    ):
        super().__init__()
        self.updates = updates
        self.model = model
        self.cfg, self.dist = cfg, dist
        self.value_clip, self.coef = value_clip, coef
        self.micro_batch_size = micro_batch_size
        self.lora = lora

    def values(self, rollout, rows: slice) -> torch.Tensor:
        """(mb, T_c) float32 V at the completion tokens of `rows` (0 off the completion)."""
        ids = rollout.ids[rows]
        mask = rollout.attention_mask()[rows]
        T_p, T_c = rollout.prompt_width, rollout.completion_ids.shape[1]
        hidden = self.model(ids, attention_mask=mask, return_hidden=True)  # (mb, T, C)
        h = hidden[:, T_p - 1 : T_p - 1 + T_c]  # the positions predicting the completion
        head = self.model.score.weight  # (1, C), float32 (trained)
        with torch.autocast(h.device.type, enabled=False):  # the head in float32
            v = torch.nn.functional.linear(h.float(), head.float())[..., 0]
        return torch.where(rollout.completion_mask[rows], v, 0.0)

    def _slices(self, B: int):
        for lo in range(0, B, self.micro_batch_size):
            yield slice(lo, min(lo + self.micro_batch_size, B))

    @torch.no_grad()
    def attach(self, batch) -> dict[str, torch.Tensor]:
        r = batch.rollout
        parts = [self.values(r, sl) for sl in self._slices(batch.size)]
        return {"values": torch.where(r.generated_mask, torch.cat(parts), 0.0)}

    def returns(self, batch, update) -> torch.Tensor:
        """(B, T_c) the value targets: GAE's lambda-returns over the step's token rewards (the
        KL in them under loss.kl_in_reward), as the `gae` estimator computed them."""
        loss = self.cfg.loss
        r = batch.rollout
        rewards = reward_minus_kl(
            batch.token_rewards, r.logprobs, update.ref_logprobs, r.generated_mask, loss
        )
        _, ret = gae_returns(
            rewards.float(),
            batch.extras["values"],
            r.generated_mask,
            loss.token_discount,
            loss.gae_lambda,
        )
        return ret

    def loss(self, batch, update):
        """One loss per micro-batch (a generator: `ModuleSet.step` backpropagates each)."""
        if "values" not in batch.extras:
            raise GrpoError("the critic's loss needs the values it attached (extras['values'])")
        cfg, dist = self.cfg, self.dist
        old = batch.extras["values"]
        target = self.returns(batch, update)
        mask = update.counted_mask
        agg = cfg.loss.aggregation
        norm = all_reduce_sum(loss_normalizer(mask, agg, cfg.rollout.max_new_tokens), dist)
        norm = max(norm, 1.0)
        n_tokens = max(all_reduce_sum(float(mask.sum()), dist), 1.0)
        # each rank's share of the global loss; ModuleSet averages gradients over ranks
        scale = self.coef * dist.world_size
        clipped = torch.zeros((), device=mask.device)  # on the device: one host read
        slices = list(self._slices(batch.size))
        for i, sl in enumerate(slices):
            m = mask[sl]
            v = self.values(batch.rollout, sl)
            per_token, was_clipped = value_loss(v, old[sl], target[sl], self.value_clip)
            clipped = clipped + (was_clipped & m).sum()
            part = scale * aggregate(per_token, m, agg, norm)
            if i < len(slices) - 1:
                yield part
                continue
            # this rank's share of the fraction of tokens clipped: their mean over ranks is
            # the global batch's (as the loss's)
            yield part, {"clip_frac": float(clipped) * dist.world_size / n_tokens}

    # checkpoints: with LoRA, what trains (adapter and head); the shared base is the policy's
    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        if not self.lora:
            return self.state_dict()
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor]) -> None:
        if not self.lora:
            self.load_state_dict(weights)
            return
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        if set(weights) != set(params):
            missing = sorted(set(params) - set(weights))[:3]
            unexpected = sorted(set(weights) - set(params))[:3]
            raise RuntimeError(
                f"critic state does not fit: missing {missing}, unexpected {unexpected}"
            )
        with torch.no_grad():
            for n, p in params.items():
                if p.shape != weights[n].shape:
                    raise RuntimeError(
                        f"critic state does not fit: {n} has shape "
                        f"{tuple(weights[n].shape)}, expected {tuple(p.shape)}"
                    )
                p.copy_(weights[n])


def value_model_on(source: Decoder) -> Decoder:
    """A value model over `source`'s weights, shared (not copied): its embedding, blocks and
    final norm (a LoRA-wrapped linear contributes its frozen base weight only), and a new zero
    one-output `score` head in float32."""
    cfg = source.config
    vcfg = dataclasses.replace(cfg, num_labels=1)
    model = meta_decoder(vcfg)
    theirs = dict(source.named_parameters())
    for name, _ in list(model.named_parameters()):
        if name == "score.weight":
            continue
        if name not in theirs:
            raise GrpoError(f"the policy has no weight {name!r} to share with the critic")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, theirs[name])
    device = source.device
    model.score = torch.nn.Linear(cfg.hidden_size, 1, bias=False, device=device)
    with torch.no_grad():
        model.score.weight.zero_()  # every value 0 at the start
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


@register_trained_module("critic")
def critic(
    config,
    dist,
    policy: Policy,
    *,
    init: str | None = None,
    lora: bool | dict | None = None,
    value_clip: float | None = 0.2,
    coef: float = 1.0,
    micro_batch_size: int | None = None,
    share_base: bool = True,
    updates: int | None = None,
) -> Critic:
    """The PPO critic (module docstring).

    Args:
        init: the checkpoint to start from; None: the policy's base (model.path with
            model.adapter folded in).
        lora: LoRA settings of the critic: null = the policy's `lora` section, false = full
            fine-tuning, true or a mapping of `lora` keys (rank, alpha, targets) over the
            policy's.
        value_clip: c of the clipped value loss (null: unclipped). coef: its coefficient.
        micro_batch_size: rows per critic forward (default train.micro_batch_size).
        share_base: with LoRA and init null, use the policy's frozen weights in place (one
            copy of the base in memory); false loads a copy.
        updates: optimizer steps per training step on its batch (default loss.num_iterations,
            as many as the policy's; from the second on the value clip can act).
    """
    cfg = config
    given = {"value_clip": value_clip, "coef": coef, "lora": lora, "updates": updates}
    check_critic_kwargs({**given, "micro_batch_size": micro_batch_size}, "modules[critic].kwargs")
    lcfg = _lora_settings(cfg.lora, lora)
    device, dtype = policy.device, cfg.model.dtype
    sharded = cfg.train.parallel == "fsdp" and dist.enabled
    if init is not None:  # it reads the policy's token ids: they must mean the same tokens
        check_same_vocabulary(init, policy.tokenizer, "modules[critic].kwargs.init")
        model = load_model(init, dtype=dtype, device=device, num_labels=1)
        if "score.weight" in dict(model.named_parameters()):
            with torch.no_grad():  # the head trains in float32
                model.score.weight.data = model.score.weight.data.float()
    elif share_base and policy.lora and lcfg.enabled and not sharded:
        model = value_model_on(policy.model)
    else:
        source = load_model(cfg.model.path, dtype=dtype, device=device)  # the policy's base
        if cfg.model.adapter:  # folded in, as the policy's (grpo.loading.load_trained_model)
            load_adapter(source, cfg.model.adapter)
            unwrap_lora(source)
        model = value_model_on(source)
    if lcfg.enabled:
        apply_lora(
            model,
            rank=lcfg.rank,
            alpha=lcfg.alpha,
            dropout=lcfg.dropout,
            targets=lcfg.targets,
            seed=cfg.train.seed + 1,
        )
        model.score.weight.requires_grad_(True)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    model.gradient_checkpointing = cfg.model.gradient_checkpointing
    policy.precision.prepare(model)  # what trains in float32
    mb = micro_batch_size or cfg.train.micro_batch_size or cfg.train.batch_size
    n = cfg.loss.num_iterations if updates is None else updates
    return Critic(model, cfg, dist, value_clip, coef, mb, lcfg.enabled, n)


def check_critic_kwargs(kwargs: dict, field: str) -> None:
    """The critic's kwargs that cannot work, from the config alone (the factory's
    `check_kwargs`: `grpo config` and `check_config` run it before anything loads; the
    keyword types are checked from the signature first, `check_trained_module`).

    Args:
        kwargs: the critic's kwargs, those given (the factory passes all of its own).
        field: the dotted field they sit at, e.g. "modules[0].kwargs".

    Raises:
        GrpoError: one line naming `field`.key.
    """
    value_clip = kwargs.get("value_clip")
    if isinstance(value_clip, (int, float)) and not value_clip > 0:
        raise GrpoError(f"{field}.value_clip must be > 0 or null, got {value_clip}")
    coef = kwargs.get("coef", 1.0)
    if isinstance(coef, (int, float)) and not coef > 0:
        raise GrpoError(f"{field}.coef must be > 0, got {coef}")
    for key in ("micro_batch_size", "updates"):  # null: the run's own setting
        n = kwargs.get(key)
        if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise GrpoError(f"{field}.{key} must be an integer >= 1 or null, got {n!r}")
    lora = kwargs.get("lora")
    if lora is None or isinstance(lora, bool):
        return
    if not isinstance(lora, dict):
        raise GrpoError(f"{field}.lora must be null, a bool or a mapping, got {lora!r}")
    known = {"enabled", "rank", "alpha", "dropout", "targets"}
    unknown = sorted(set(lora) - known)
    if unknown:
        raise GrpoError(
            f"{field}.lora: unknown key {unknown[0]!r}; valid: {', '.join(sorted(known))}"
        )


def _lora_settings(policy_lora, lora):
    """The critic's LoRA: the policy's section, overridden as `lora` says (checked by
    `check_critic_kwargs`)."""
    if lora is None:
        return policy_lora
    if lora is False:
        return dataclasses.replace(policy_lora, enabled=False)
    if lora is True:
        return dataclasses.replace(policy_lora, enabled=True)
    settings = dict(lora)
    if "targets" in settings:
        settings["targets"] = tuple(settings["targets"])
    return dataclasses.replace(policy_lora, **{"enabled": True, **settings})


critic.check_kwargs = check_critic_kwargs  # run by `check_trained_module` before anything loads
