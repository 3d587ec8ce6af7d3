"""`shipyard build`: `dvc repro` several releases at once, within the machine's memory."""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "build",
        help="dvc repro several releases in parallel, within the machine's memory",
        description="Build the named releases (default: every one) with `dvc repro`, as "
        "many at once as --jobs and the memory estimated from each checkpoint allow, the "
        "biggest first; each release's log lands in build/.logs/<release>.log. Exits 1 when "
        "a release failed.",
    )
    parser.add_argument("releases", nargs="*", help="release names (default: all)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="most at once")
    parser.add_argument("--memory", help="memory the builds may use (default: 80%% of available)")
    parser.add_argument(
        "--pull",
        action="store_true",
        help="fetch missing outputs and run-cache objects from the shared remote (dvc repro "
        "--pull); with SHIPYARD_TRUSTED_BUILDERS set, each restored output is checked against "
        "its attestation before the next stage reads it, and rebuilt when it fails",
    )
    parser.add_argument("--until", metavar="STAGE", help="stop after this stage (default: bundle)")
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines import build

    budget = build.parse_memory(args.memory) if args.memory else None
    failed = build.build(
        _common.root(), args.releases, args.jobs, budget, pull=args.pull, until=args.until
    )
    return 1 if failed else 0
