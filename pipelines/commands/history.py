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
        print(json.dumps(registry.history(), indent=2))
        _common.warn(registry)
        return 0
    for e in registry.history():
        print(
            f"#{e['seq']:<3} {e['at']} {e['who']:10} {e['action']:8} {e['channel']:10} "
            f"{e['from'] or '(empty)'} -> {e['to']}  {str(e.get('digest'))[:12]}  "
            f"{e.get('reason', '')}"
            + (f" (canary {e['canary_percent']} %)" if e.get("canary_percent") is not None else "")
        )
    _common.warn(registry)
    return 0
