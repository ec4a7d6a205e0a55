"""The benchmark harness, by its name under benchmarks/: the module is
`grpo.apps.bench.harness` (installed with the package, so `grpo bench` runs without this
folder), the same module object (its `RESULT_HOOKS` list and functions are shared)."""

import sys

from grpo.apps.bench import harness

sys.modules[__name__] = harness
