"""Command line: `python -m loader demo` and `python -m loader audit RUN_DIR`."""

import argparse
import sys

from loader import audit, demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loader", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="train, kill a rank mid-step, resume at another world size, audit")
    run.add_argument("--fail-at-step", type=int, default=9, help="the last completed step before the failure")
    run.add_argument("--world-sizes", type=int, nargs=2, default=(4, 3), metavar=("BEFORE", "AFTER"))
    check = commands.add_parser("audit", help="per epoch: samples seen once, skipped, duplicated, dropped by policy")
    check.add_argument("run_dir", help="the run directory whose ledger/ to read")
    check.add_argument("--limit", type=int, default=20, help="offending indices to print per epoch")
    args = parser.parse_args(argv)
    if args.command == "audit":
        return audit.main(args.run_dir, args.limit)
    return demo.main(args.fail_at_step, *args.world_sizes)


if __name__ == "__main__":
    sys.exit(main())
