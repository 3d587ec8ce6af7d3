"""`shipyard compile`: write dvc.yaml from releases/*.yaml (or check it, or list the CI
matrix)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "compile",
        help="write dvc.yaml from releases/*.yaml",
        description="Write dvc.yaml, one foreach stage per pipeline stage over every "
        "release in releases/, each with the dependencies derived from its code and its "
        "spec sections. --check writes nothing and exits 1 when the committed dvc.yaml is "
        "stale; --matrix prints one CI job per release.",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml is stale")
    parser.add_argument("--matrix", action="store_true", help="print the releases as a CI matrix")
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines import compiler

    root = _common.root()
    if args.matrix:  # one CI job per release: [{"release": ..., "target": ...}, ...]
        releases = [spec.name for _, spec in compiler.discover(root)]
        print(json.dumps([{"release": r, "target": f"bundle@{r}"} for r in releases]))
        return 0
    if args.check:
        if compiler.is_stale(root):
            print(
                "dvc.yaml is stale: it does not match releases/*.yaml and the stages; "
                "run `shipyard compile` and commit the result",
                file=sys.stderr,
            )
            return 1
        print("dvc.yaml is up to date")
        return 0
    print(f"wrote {compiler.write(root).relative_to(root)}")
    return 0
