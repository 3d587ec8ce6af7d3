"""`shipyard publish RELEASE`: copy a release's built bundle into the registry."""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "publish",
        help="copy a built bundle into the registry",
        description="Copy the release's built bundle (build/<release>/bundle) into the "
        "registry as <release>@<version>, the version its spec names: under the registry "
        "lock, to a staging place first, verified there (every file, every stage passed), "
        "then renamed into place and recorded. A published version is immutable; publishing "
        "the same bundle again is a no-op.",
    )
    parser.add_argument("release", help="release name: its built bundle is published")
    _common.registry_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    root = _common.root()
    [spec] = _common.specs(root, [args.release])
    registry = _common.registry(args)
    done = registry.publish(root / "build" / spec.name / "bundle", spec.name, spec.version)
    for line in done.recovered:
        print(line)
    state = "already published" if done.already else "published"
    print(f"{spec.name}@{spec.version} {state} (bundle digest {done.record.digest})")
    _common.warn(registry)
    return 0
