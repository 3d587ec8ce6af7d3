"""`shipyard gate [RELEASE...]`: every stage report and threshold of the releases."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipelines.commands import _common

TAKES_JSON = True


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "gate",
        help="check every stage report; exit 4 if anything failed",
        description="Check every stage report of the releases (default: all), the bundle "
        "against its manifest, and each threshold whose baseline is production against the "
        "version the registry's production channel holds (verified first); prints one row "
        "per check and exits 4 when any failed.",
    )
    parser.add_argument("releases", nargs="*", help="release names (default: all)")
    parser.add_argument("--report", help="write a markdown report here (for the PR comment)")
    parser.add_argument(
        "--require-baseline",
        action="store_true",
        help="fail a production comparison that cannot run (nothing in production yet)",
    )
    parser.add_argument(
        "--base",
        metavar="REV",
        help="show each stage's metrics against this git revision's (`dvc metrics diff`), "
        "e.g. origin/main on a pull request",
    )
    _common.registry_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines.gate import gate
    from schemas import GateError

    root = _common.root()
    result = gate(
        root,
        _common.specs(root, args.releases),
        _common.registry(args),
        args.require_baseline,
        args.base,
    )
    if result.base_note:
        print(f"warning: not compared with {args.base}: {result.base_note}", file=sys.stderr)
    if args.json:
        from dataclasses import asdict

        rows = [asdict(r) for r in result.rows]
        print(json.dumps({"ok": result.ok, "base": result.base, "rows": rows}, indent=2))
    else:
        for row in result.rows:
            change = f" [{row.change}]" if row.change and row.change != "=" else ""
            print(f"{row.verdict:4} {row.release:16} {row.check:32} {row.detail}{change}")
    if args.report:
        Path(args.report).write_text(result.markdown(), encoding="utf-8")
        if not args.json:
            print(f"wrote {args.report}")
    if not result.ok:
        failed = sum(r.verdict == "FAIL" for r in result.rows)
        raise GateError(f"gate failed: {failed} check(s) did not pass")
    if not args.json:
        print("gate passed")
    return 0
