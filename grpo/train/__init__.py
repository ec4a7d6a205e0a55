"""The training recipes a researcher reads:

    grpo      GRPO: the step as phases over values (rollout -> scores -> advantages ->
              reference / old log-probs -> update) and the loop that sequences them
    rollouts  the rollout phase: sampling, scoring, dynamic-sampling refill -> RolloutBatch
    batch     the values passed between phases (RolloutBatch, UpdateBatch, MicroBatch)
    stats     what a step reports (loss stats over micro-batches and ranks, advantages,
              rollout metrics)
    health    learning that silently stops: rules over each step's metrics, warnings, a stop
    sft       supervised fine-tuning

The run around them (run directory, checkpoints, preflight checks, signals, the loop skeleton,
optimizer) is `grpo.run`; the policy (model, LoRA, reference) is `grpo.policy`.
"""
