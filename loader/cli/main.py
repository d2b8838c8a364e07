"""Command line: `python -m loader demo [--lm]`, `python -m loader audit RUN_DIR [--plot OUT.png] [--documents
KEEP.npy]`,
`python -m loader inspect PATH` and `python -m loader index SHARDS`."""

import argparse
import json
import sys
from pathlib import Path

from loader.checkpoint import audit
from loader.checkpoint.ledger import LedgerError
from loader.cli import demo, inspection
from loader.cli.names import MaskedDocuments, by_source, describe_by_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loader", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_command = commands.add_parser(
        "demo", help="an elastic torchrun job loses a node mid-step and resumes on fewer workers"
    )
    demo_command.add_argument(
        "--lm",
        action="store_true",
        help="the job of examples/train_lm.py: a transformer on "
        "packed token files mixed by a schedule, audited per "
        "source",
    )
    demo_command.add_argument(
        "--dir", help="where the runs go, kept for auditing (default: a new temporary directory, printed)"
    )
    check = commands.add_parser(
        "audit",
        help="per epoch: samples seen once, skipped, duplicated, dropped by policy",
        epilog=audit.EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("run_dir", help="the run directory whose ledger/ to read")
    check.add_argument("--limit", type=_count, default=20, help="offending indices to print per epoch")
    check.add_argument("--shards", help="the run's WebDataset shards: name samples by shard and key")
    check.add_argument(
        "--mixture",
        help="the run's mixture plan (Mixture.plan.save): a row per source, samples named by source and index",
    )
    check.add_argument(
        "--documents",
        metavar="KEEP.npy",
        help="the keep= mask of the run's PackedSource (one bool per document): lists the documents it filtered "
        "before packing, by number, as filtered by policy",
    )
    check.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also draw the run: positions by step per launch, restarts "
        "and world sizes, and each epoch's indices by what the audit "
        "found (needs matplotlib: the bench extra)",
    )
    show = commands.add_parser(
        "inspect",
        help="where a run stands: its newest checkpoint's step, epoch, world size, "
        "committed and remaining samples, mixture plan, files verified",
    )
    show.add_argument(
        "path", help="a checkpoint directory (step-NNNNNNNNN/) or a run directory (its newest checkpoint that verifies)"
    )
    show.add_argument(
        "--mixture",
        help="the run's mixture plan (Mixture.plan.save; default: mixture.json in the run directory, if there is one)",
    )
    index = commands.add_parser("index", help="build the WebDataset shards' indexes ahead of a job, in parallel")
    index.add_argument("shards", help="a directory of .tar shards or a brace pattern (local, or URLs fsspec opens)")
    index.add_argument(
        "--cache-dir",
        help="where the job will look for them (default: next to each shard, also "
        "for remote shards: <url>.idx.npz, for every later job)",
    )
    index.add_argument("--cache-limit", help="remote shards with --cache-dir: that node cache's limit, e.g. 50GB")
    index.add_argument(
        "--storage-options",
        type=json.loads,
        default=None,
        help='remote shards: fsspec storage options as JSON, e.g. \'{"endpoint_url": "..."}\'',
    )
    index.add_argument("--rebuild", action="store_true", help="rebuild indexes that are cached and current")
    index.add_argument("--jobs", type=int, help="processes (default: one per CPU)")
    args = parser.parse_args(argv)
    if args.command == "index":
        from loader.sources import prepare_indexes

        counts = prepare_indexes(
            args.shards, args.cache_dir, args.rebuild, args.jobs, args.storage_options, args.cache_limit
        )
        print(
            f"{counts['shards']} shards, {counts['samples']} samples: {counts['built']} indexes built, "
            f"{counts['shards'] - counts['built']} already current"
        )
        return 0
    if args.command == "audit":
        return _audit(parser, args)
    if args.command == "inspect":
        return inspection.main(args.path, args.mixture)
    return demo.main(args.lm, args.dir)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a count, 0 or more, got {value}")
    return value


def _audit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`audit`: every input checked where it is read (arguments here, the ledger by `read_run`, the mixture plan by
    `MixturePlan.load`), so that what cannot be read exits NO_LEDGER with the file and field named, never a
    traceback; exit FAILED stays "a sample skipped or duplicated"."""
    if args.plot:
        from loader.cli.plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as err:
            parser.error(str(err))
        if not Path(args.plot).parent.is_dir():
            parser.error(f"--plot {args.plot}: the folder {Path(args.plot).parent} does not exist; create it first")
    if args.mixture and args.shards:
        parser.error(
            "audit: --shards names the samples of a WebDataset run, --mixture those of a mixture run: pass one"
        )
    try:
        grouping, describe = by_source(args.mixture) if args.mixture else (None, str)
        documents = MaskedDocuments(args.documents) if args.documents else None
    except LedgerError as err:
        print(f"audit: {err}", file=sys.stderr)
        return audit.NO_LEDGER
    if args.shards:
        describe = describe_by_key(args.shards)
    status = audit.main(args.run_dir, args.limit, describe, grouping, documents)
    if args.plot and status != audit.NO_LEDGER:
        from loader.cli.plot import plot

        try:
            plot(args.run_dir, args.plot)
        except OSError as err:  # the picture's file: a folder removed meanwhile, no room, no permission
            print(f"audit: --plot {args.plot}: not written ({err})", file=sys.stderr)
            return audit.NO_LEDGER
        except LedgerError as err:  # a stream's ledger: no indices of an epoch to draw
            print(f"audit: --plot {args.plot}: not drawn ({err})", file=sys.stderr)
            return status
        print(f"audit: the run drawn in {args.plot}")
    return status
