"""Modules trained beside the policy (the config's `modules: [...]`): a value head, a learned
baseline, PPO's critic.

    base        the seam a researcher implements: TrainedModule, register_trained_module
    module_set  the trainer's side: ModuleSet (building, optimizers, stepping, checkpoints)
    critic      the built-in PPO critic (`modules: [{name: critic}]`)
    online_rm   a reward model trained online on labelled pairs of the policy's samples
                (`modules: [{name: online_reward_model}]`)
"""

from grpo.modules.base import TRAINED_MODULES, TrainedModule, register_trained_module

__all__ = ["TRAINED_MODULES", "TrainedModule", "register_trained_module"]
