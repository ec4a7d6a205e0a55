"""`grpo bench logprobs` (`grpo.apps.bench.logprobs`) under its name in the repository:

    python -m benchmarks.bench_logprobs --quick          # = grpo bench logprobs --quick

The stored command names this entry, so the results file says how to run it again."""

from grpo.apps.bench import logprobs as _bench


def main(argv=None) -> None:
    _bench.main(argv, prog="python -m benchmarks.bench_logprobs")


if __name__ == "__main__":
    main()
