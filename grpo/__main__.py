"""`python -m grpo` is the `grpo` command."""

from grpo.apps.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
