"""Run infrastructure the training recipes (`grpo.train`) share, apart from the algorithm:

    loop       the run lifecycle: join the job, claim the run directory, optimizer and
               schedule, restore, checkpoint and stop on a signal at step boundaries, save
    rundir     the run directory: lock, overwrite, resume, signals, the saved config
    failures   a failure on any torchrun rank as one line per rank, every rank stopping
    state      TrainState, checkpoints (safetensors + JSON), RNG state, seeding
    preflight  every check that can fail before a model loads or a file is written
    memory     the memory estimate of a run and the memory the machine has for it
    budgets    token budgets: the new tokens a run may add to a prompt
    notices    limits a run states once before it starts (turns cut by the budget, ...)
    optim      optimizer and learning-rate schedule
    perf       peak memory per phase, progress bars of long phases

Nothing here imports `grpo.train`.
"""
