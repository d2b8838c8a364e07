"""Command line: `python -m loader demo`."""

import argparse
import sys

from loader import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loader", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="train, kill a rank mid-step, resume at another world size, audit")
    run.add_argument("--fail-at-step", type=int, default=9, help="the last completed step before the failure")
    run.add_argument("--world-sizes", type=int, nargs=2, default=(4, 3), metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    return demo.main(args.fail_at_step, *args.world_sizes)


if __name__ == "__main__":
    sys.exit(main())
