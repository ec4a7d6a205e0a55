"""Training loops (SFT, GRPO) and what they share: optimizer, schedule, state, checkpoints."""
