"""`shipyard fingerprint`: dvc.yaml's `code` stage, each stage's code and spec sections."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "fingerprint",
        help="write build/.params/<release>/<stage>.json (dvc.yaml's `code` stage)",
        description="Write, for every release and stage, the fingerprint of the code the "
        "stage runs and the spec sections it reads (build/.params/<release>/<stage>.json): "
        "the params file each stage depends on, so `dvc repro` reruns exactly what a change "
        "reaches. --check writes nothing and names each file from another build.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming each params file that is not what this checkout "
        "gives (one restored from another build by DVC's run-cache or a remote)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines import compiler

    root = _common.root()
    if args.check:
        stale = compiler.stale_fingerprints(root)
        for problem in stale:
            print(f"stale: {problem}", file=sys.stderr)
        if stale:
            print(
                f"{len(stale)} params file(s) came from another build: run `shipyard "
                "fingerprint`, then `dvc repro` rebuilds what depends on them",
                file=sys.stderr,
            )
            return 1
        print(f"every release's params under {compiler.PARAMS_DIR} are this checkout's")
        return 0
    written = compiler.write_fingerprints(root)
    print(
        f"wrote the code fingerprint and spec sections of each release's stages into "
        f"{len(written)} files under {compiler.PARAMS_DIR}"
    )
    return 0
