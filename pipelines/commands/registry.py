"""`shipyard registry check|unlock|require-signature`: registry maintenance and policy."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "registry",
        help="registry maintenance and policy",
        description="Maintenance and policy of the registry: finish or remove what an "
        "interrupted publish or move left (check), remove the lock of a writer that died "
        "(unlock), and make a channel accept only signed bundles (require-signature).",
    )
    nested = parser.add_subparsers(
        dest="registry_command", required=True, help="check | unlock | require-signature"
    )
    check = nested.add_parser(
        "check",
        help="finish or remove interrupted publishes",
        description="Under the registry lock: finish each interrupted publish whose bundle "
        "verifies and remove one that does not, remove staging leftovers, finish a channel "
        "move a crash left between its history entry and its pointer, and name every "
        "pointer or policy file that cannot be read; says what it did.",
    )
    unlock = nested.add_parser(
        "unlock",
        help="remove a remote lock whose holder died",
        description="Remove the registry lock of a writer that died, naming its holder; a "
        "lock whose holder renewed it recently only with --force.",
    )
    unlock.add_argument("--force", action="store_true", help="even a live (recently renewed) one")
    require = nested.add_parser(
        "require-signature",
        help="a channel accepts only signed bundles",
        description="From now on, promote and rollback move the channel only to bundles "
        "signed by one of these public keys (`shipyard sign`), and serve and deploy of "
        "NAME@CHANNEL check that signature.",
    )
    require.add_argument("channel", help="the channel that will accept only signed bundles")
    require.add_argument("--public-key", nargs="+", required=True, help="trusted PEM public key(s)")
    for command in (check, unlock, require):
        _common.registry_option(command)
    return parser


def run(args: argparse.Namespace) -> int:
    return {"check": _check, "unlock": _unlock, "require-signature": _require_signature}[
        args.registry_command
    ](args)


def _check(args: argparse.Namespace) -> int:
    registry = _common.registry(args)
    actions = registry.check()
    for line in actions:
        print(line)
    if not actions:
        print(f"{registry.url}: consistent (no interrupted publish or move, no leftovers)")
    _common.warn(registry)
    return 0


def _unlock(args: argparse.Namespace) -> int:
    print(_common.registry(args).unlock(force=args.force))
    return 0


def _require_signature(args: argparse.Namespace) -> int:
    registry = _common.registry(args)
    keys = [Path(k) for k in args.public_key]
    policy = registry.require_signature(args.channel, keys)
    print(
        f"channel {args.channel!r} now requires a signature by one of "
        f"{len(policy.public_keys)} trusted key(s)"
    )
    return 0
