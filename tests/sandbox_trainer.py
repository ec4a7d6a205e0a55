"""A stand-in trainer for tests/test_sandbox.py: runs `run_python` for each request it reads and
answers with the result, so a test can check that this process survives what the code does.

    python tests/sandbox_trainer.py      # stdin: one JSON {"code": ..., "kwargs": {...}} per line
                                         # stdout: one JSON PythonResult per line
"""

from __future__ import annotations

import dataclasses
import json
import sys

from grpo.envs.sandbox import run_python


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        result = run_python(request["code"], **request.get("kwargs", {}))
        print(json.dumps(dataclasses.asdict(result)), flush=True)


if __name__ == "__main__":
    main()
