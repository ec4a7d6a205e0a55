"""Benchmarks that run from the installed package (`grpo bench <name>`): the timing harness
(`grpo.apps.bench.harness`) and the log-prob kernel benchmark (`grpo.apps.bench.logprobs`).
The repository's other benchmarks (benchmarks/) use the same harness."""
