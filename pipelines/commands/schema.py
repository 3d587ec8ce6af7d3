"""`shipyard schema`: the release spec's JSON Schema, or its rules as Markdown."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "schema",
        help="print the release spec JSON Schema",
        description="Print the JSON Schema of a release spec (every field with its "
        "description), for editors and other tools; --rules prints the rules a spec is "
        "checked against beyond its schema, as Markdown.",
    )
    parser.add_argument("--rules", action="store_true", help="the rules as Markdown instead")
    return parser


def run(args: argparse.Namespace) -> int:
    from schemas import ReleaseSpec

    if args.rules:
        from schemas.rules import markdown

        print(markdown(), end="")
        return 0
    print(json.dumps(ReleaseSpec.model_json_schema(), indent=2))
    return 0
