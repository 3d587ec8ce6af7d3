"""`shipyard promote NAME@VERSION --to CHANNEL`: move a channel to a published version."""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "promote",
        help="move a channel to a published version",
        description="Re-verify a published version (every file against its manifest and "
        "its publish record, the channel's signature policy), then point the channel at it "
        "and append the move to the history; --canary makes the move a canary step (that "
        "share of the traffic), --manifests also writes the cluster manifests of the new "
        "state. Promoting the version already live is a no-op.",
    )
    parser.add_argument("target", metavar="NAME@VERSION", help="a published release version")
    parser.add_argument("--to", required=True, metavar="CHANNEL", help="the channel to move")
    parser.add_argument(
        "--canary",
        type=int,
        metavar="PCT",
        help="a canary step: PCT %% of traffic to this version (recorded in the history)",
    )
    _common.manifests_option(parser)
    _common.deploy_options(parser)
    _common.registry_option(parser)
    parser.add_argument("--reason", default="", help="why (goes into the history)")
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines.registry import Unmoved
    from schemas import SpecError

    if "@" not in args.target:
        raise SpecError("", [f"{args.target!r}: write NAME@VERSION, e.g. tiny-gpt2@0.1.0"])
    name, version = args.target.rsplit("@", 1)
    registry = _common.registry(args)
    moved = registry.promote(name, version, args.to, args.reason, args.canary)
    step = "" if args.canary is None else f", canary {args.canary} %"
    if isinstance(moved, Unmoved):
        print(f"{args.to}: {moved.to}{step} is already live there; nothing moved or recorded")
    else:
        print(f"{args.to}: {moved.from_ or '(empty)'} -> {moved.to}{step} (#{moved.seq})")
    _common.warn(registry)
    if args.manifests:
        _common.write_manifests(args, registry, f"{name}@{version}", args.canary)
    return 0
