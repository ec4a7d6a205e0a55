"""Modules beside the policy (the config's `modules: [...]`): trained ones (a value head, a
learned baseline, PPO's critic) and frozen scorers (a distillation teacher).

    base        the seams a researcher implements: TrainedModule, FrozenScorer,
                register_trained_module
    module_set  the trainer's side: ModuleSet (building, optimizers, stepping, checkpoints)
    critic      the built-in PPO critic (`modules: [{name: critic}]`)
    teacher     the built-in distillation teacher (`modules: [{name: teacher, kwargs: ...}]`)
    online_rm   a reward model trained online on labelled pairs of the policy's samples
                (`modules: [{name: online_reward_model}]`)
"""

from grpo.modules.base import (
    TRAINED_MODULES,
    FrozenScorer,
    TrainedModule,
    register_trained_module,
)

__all__ = ["TRAINED_MODULES", "FrozenScorer", "TrainedModule", "register_trained_module"]
