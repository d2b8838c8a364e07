"""Command line: `python -m loader demo` and `python -m loader audit RUN_DIR`."""

import argparse
import sys

from loader import audit, demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loader", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="an elastic torchrun job loses a node mid-step and resumes on fewer workers")
    check = commands.add_parser("audit", help="per epoch: samples seen once, skipped, duplicated, dropped by policy")
    check.add_argument("run_dir", help="the run directory whose ledger/ to read")
    check.add_argument("--limit", type=int, default=20, help="offending indices to print per epoch")
    args = parser.parse_args(argv)
    if args.command == "audit":
        return audit.main(args.run_dir, args.limit)
    return demo.main()


if __name__ == "__main__":
    sys.exit(main())
