"""The training recipes, and nothing else:

    grpo  GRPO (and PPO with a critic): a step in numbered stages, rollout -> reference and
          advantages -> update -> the run's tail, each naming the file that does it
    sft   supervised fine-tuning: completion-only token-mean cross-entropy
    rm    a Bradley-Terry reward model on preference pairs (`grpo rm`)

What they share lives beside them: the rollout machinery in `grpo.experience`, the modules
trained beside the policy in `grpo.modules`, the algorithm in `grpo.algo`, and the run around
them (run directory, the loop's tail: evaluation, logging, guards, checkpoints; preflight,
signals, optimizer, step statistics, learning health) in `grpo.run`.
"""
