"""`shipyard cache pull|push|configure`: DVC's remote and run-cache, shared by builders."""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "cache",
        help="DVC remote + run-cache from SHIPYARD_DVC_REMOTE: pull before, push after",
        description="Share stage outputs and DVC's run-cache between builders through the "
        "remote named by SHIPYARD_DVC_REMOTE: `configure` points DVC at it (local config), "
        "`pull` before a build, `push` after one.",
    )
    parser.add_argument(
        "action",
        choices=["pull", "push", "configure"],
        help="pull / push outputs and run-cache; configure: point DVC at SHIPYARD_DVC_REMOTE",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines import cache

    print(getattr(cache, args.action)(_common.root()))
    return 0
