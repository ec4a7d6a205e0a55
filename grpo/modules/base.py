"""The base classes and registry of the modules beside the policy (grpo.modules.module_set
has the trainer's side: building, stepping, checkpoints): `TrainedModule`, trained with its own
optimizer, and `FrozenScorer`, which only attaches values (a teacher's log-probs). Kept apart
so that a built-in module (the PPO critic, the teacher) registers without importing the
trainer's side."""

from __future__ import annotations

import torch

from grpo.algo.registry import Registry

TRAINED_MODULES = Registry("trained module", "modules[].name")


def register_trained_module(name: str, *, overwrite: bool = False):
    """Decorator: a factory of a `TrainedModule`, selectable as ``modules: [{name: ...}]``."""
    return TRAINED_MODULES.register(name, overwrite=overwrite)


class TrainedModule(torch.nn.Module):
    """A module trained beside the policy (module docstring). Subclass it and override:

    attach(batch) -> {name: (B,) or (B, T_c) tensor}: per-row tensors added to the step's
        `RolloutBatch.extras` (computed without gradient), before the advantages.
    rewards(batch) -> {name: (B,) tensor}: sequence rewards the module gives (a reward model
        trained online: grpo.modules.online_rm), computed without gradient after `attach` and
        added to the step's total reward (weight 1: a module scales its own), each on its
        row's last generated token, logged as ``rewards/<name>``. A run with such a module has
        no known highest reward (the learning-health `solved` rule never fires in it).
    loss(batch, update) -> loss or (loss, {"name": scalar}): this rank's loss (a mean over its
        rows) on the step's `RolloutBatch` and `UpdateBatch` (advantages, masks), after the
        policy's update; one optimizer step follows. Or a generator yielding one of those per
        micro-batch (each backpropagated as it is yielded; metrics: the last reported wins).
    updates: optimizer steps per training step on the same batch (default 1; PPO's critic
        takes loss.num_iterations, as the policy; its schedule counts them all).
    trains_first: False (default): the module's optimizer steps come after the policy's
        update, so the step's `attach` / `rewards` see it as the last step left it. True: they
        come first, after the rollout and before `attach` / `rewards`, whose values then come
        from the module trained on this step's batch (`loss` gets ``update=None``: the
        advantages do not exist yet). The online reward model's ``label_first``.
    checkpoint_state() -> {name: tensor}: what checkpoints hold and ranks broadcast at the start
        (default: the whole `state_dict`; a module on frozen shared weights returns only what
        it trains); load_checkpoint_state(weights) puts it back (default: `load_state_dict`).
    """

    updates: int = 1
    trains_first: bool = False  # its updates before attach / rewards (docstring)
    trainable: bool = True  # False: a `FrozenScorer` (no optimizer, no loss, no gradient)

    def attach(self, batch) -> dict[str, torch.Tensor]:
        return {}

    def rewards(self, batch) -> dict[str, torch.Tensor]:
        return {}

    def loss(self, batch, update):
        raise NotImplementedError(f"{type(self).__name__}.loss")

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return self.state_dict()

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(weights)


class FrozenScorer(TrainedModule):
    """A module that only attaches values (a teacher's per-token log-probs, a frozen value
    baseline): configured under ``modules:`` like a trained one and loaded once, but nothing of
    it trains: no optimizer, its parameters frozen (``requires_grad`` off), its `attach` run
    without gradient under the policy's precision, no `loss`. Override:

    attach(batch) -> {name: (B,) or (B, T_c) tensor}: as `TrainedModule.attach`. A factory that
        takes the ``scoring`` input gets the trainer's `grpo.experience.scoring.Scoring`:
        ``scoring.logprobs(model, batch.rollout)`` scores the completions with the trainer's
        micro-batches, packing, precision and log-prob kernel.
    identity() -> {key: str}: what identifies it (e.g. the checkpoint it loaded and that
        checkpoint's hash): the run's metadata (``run/modules``) records it, checkpoints hold
        it, and a resume with another identity is refused.
    checkpoint_state() -> {name: tensor}: state that changes during the run (a running
        statistic), saved in checkpoints and restored on resume; default none (the frozen
        weights come back from where `identity` says). A scorer with state overrides it and
        `load_checkpoint_state`.
    """

    trainable = False

    def loss(self, batch, update):
        raise TypeError(f"{type(self).__name__} is a FrozenScorer: it has no loss")

    def identity(self) -> dict[str, str]:
        return {}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor]) -> None:
        if weights:
            raise RuntimeError(
                f"{type(self).__name__} saves no state, the checkpoint holds "
                f"{sorted(weights)[:3]}: override load_checkpoint_state"
            )
