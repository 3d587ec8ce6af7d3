"""`shipyard history`: the registry's append-only history of channel moves."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipelines.commands import _common

TAKES_JSON = True


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "history",
        help="print the append-only promotion history",
        description="Print every promotion and rollback the registry recorded, oldest "
        "first: who moved which channel, when, from which version to which, the digest, "
        "why, and the canary share of a canary step. A torn entry is reported and skipped.",
    )
    _common.registry_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    registry = _common.registry(args)
    if args.json:
        print(json.dumps([e.document() for e in registry.history()], indent=2))
        _common.warn(registry)
        return 0
    for e in registry.history():
        canary = "" if e.canary_percent is None else f" (canary {e.canary_percent} %)"
        print(
            f"#{e.seq:<3} {e.at} {e.who:10} {e.action:8} {e.channel:10} "
            f"{e.from_ or '(empty)'} -> {e.to}  {str(e.digest)[:12]}  {e.reason or ''}{canary}"
        )
    _common.warn(registry)
    return 0
