"""The applications: thin compositions of core calls that parse untrusted input.

`cli` (the `grpo` command), `pipeline` (SFT -> eval -> GRPO -> eval), `sweep` (grid / random /
optuna trials), `serve` + `serving/` (the OpenAI-compatible server), `tool` (the tutorial's
JSON actions), `demo` (the offline end-to-end run) and `plot` (curves from metrics.jsonl).
The core (`grpo.*` outside this package) never imports from here (tests/test_layers.py).
"""
