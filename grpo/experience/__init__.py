"""What the trainer learns from: the rollout phase behind a recipe's `batch = source.next(state)`.

    sources     rollout_source: the run's source of batches (inline, colocated, remote)
    inline      InlineRollouts (rollout.async: off), make_sampler, the RolloutSource base
    producer    the asynchronous sources: a producer thread or producer ranks, one schedule
    collect     rollout_phase: the step's prompts in lockstep over ranks, the strategy per
                round, dynamic-sampling refill -> RolloutBatch
    strategies  rollout strategies (rollout.strategy) and their Sampling handle; sample_round,
                score_rollout (rewards)
    batch       the values passed between phases (RolloutBatch, UpdateBatch, MicroBatch) and
                the micro-batch plans (shared with SFT and the reward model)
    balance     tokens evened over ranks after sampling (train.balance_ranks)
    wire        RolloutBatch <-> bytes (no pickle), for producer ranks

The recipes in `grpo.train` read these; none of these modules imports a recipe.
"""
