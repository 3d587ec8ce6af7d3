"""`shipyard status`: every channel pointer of the registry."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipelines.commands import _common

TAKES_JSON = True


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="print every channel pointer",
        description="Print, for every release and channel in the registry, the version "
        "the channel points at, its digest and since when.",
    )
    _common.registry_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps([c.document() for c in _common.registry(args).channels()], indent=2))
        return 0
    for c in _common.registry(args).channels():
        p = c.pointer
        print(f"{p.release:16} {c.channel:10} {p.version:10} {p.digest[:16]} since {p.since}")
    return 0
