"""`shipyard rollback CHANNEL`: move a channel back to the version it held before."""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "rollback",
        help="move a channel back to its previous version",
        description="Point the channel back at the version it held before its current one "
        "(the history's promotions and rollbacks, read as a stack), re-verified as a "
        "promotion verifies it, and append the move to the history; --manifests also writes "
        "the cluster manifests of that version, with all of the traffic.",
    )
    parser.add_argument("channel", help="the channel to move back")
    parser.add_argument("--release", help="release name (needed when several have the channel)")
    _common.manifests_option(parser)
    _common.deploy_options(parser)
    _common.registry_option(parser)
    parser.add_argument("--reason", default="", help="why (goes into the history)")
    return parser


def run(args: argparse.Namespace) -> int:
    from schemas import RegistryError, SpecError

    registry = _common.registry(args)
    names = sorted({c.pointer.release for c in registry.channels() if c.channel == args.channel})
    name = args.release or (names[0] if len(names) == 1 else None)
    if name is None:
        problem = (
            f"channel {args.channel!r} exists for {names or 'no release'}; "
            "say which with --release NAME"
        )
        if names:  # several releases have it: the argument is missing
            raise SpecError("--release", [problem])
        raise RegistryError(problem)  # no release has it: the registry lacks it
    entry = registry.rollback(name, args.channel, args.reason)
    print(f"{args.channel}: {entry.from_} -> {entry.to} (#{entry.seq}, rollback)")
    _common.warn(registry)
    if args.manifests:  # the version rolled back to, with all of the traffic
        _common.write_manifests(args, registry, entry.to, None)
    return 0
