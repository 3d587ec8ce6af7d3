"""`shipyard deploy NAME@VERSION|NAME@CHANNEL --out DIR`: a published version's cluster
manifests."""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "deploy",
        help="write a published version's cluster manifests (KServe, Kubernetes)",
        description="Check out NAME@VERSION or NAME@CHANNEL from the registry, verify it, and "
        "write its cluster manifests (the bundle's deploy/ folder) under --out, with the "
        "registry URI the cluster fetches it from.",
    )
    parser.add_argument("target", metavar="NAME@VERSION|NAME@CHANNEL", help="what to deploy")
    parser.add_argument(
        "--out", dest="manifests", required=True, metavar="DIR", help="where to write"
    )
    parser.add_argument("--canary", type=int, metavar="PCT", help="canaryTrafficPercent (KServe)")
    _common.deploy_options(parser)
    _common.registry_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    _common.write_manifests(args, _common.registry(args), args.target, args.canary)
    return 0
