"""The `grpo` command line: parses arguments, calls the library, turns errors into one line."""

from __future__ import annotations

import argparse
import logging
import sys

from grpo.errors import GrpoError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5")


def cmd_config(args) -> int:
    import yaml

    from grpo.config import config_to_dict, load_config

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo", description="GRPO for LLMs in pure PyTorch (run `grpo CMD -h` for help)."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="validate a config and print it resolved")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.func(args) or 0
    except GrpoError as e:
        print(f"grpo {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"grpo {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
