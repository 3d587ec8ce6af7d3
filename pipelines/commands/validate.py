"""`shipyard validate SPEC...`: check release specs as every other command reads them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "validate",
        help="validate release specs",
        description="Load each release spec as the build reads it and check it against the "
        "rules (`shipyard schema --rules`); every problem is printed as file:line: field: "
        "message, and a spec whose evaluation reads its calibration data gets a warning.",
    )
    parser.add_argument("specs", nargs="+", help="release spec files (releases/<name>.yaml)")
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines.init import past_problem, same_data
    from schemas import SpecError
    from schemas.loader import load_release, repo_of

    problems = []
    for spec in args.specs:
        try:
            release = load_release(spec)
            problem = past_problem(release, repo_of(Path(spec)), Path(spec), str(spec))
            if problem:
                raise SpecError(str(spec), [problem])
            print(f"{spec}: ok ({release.name} {release.version}, {release.task})")
            warning = same_data(release)
            if warning:
                print(f"{spec}: warning: {warning}", file=sys.stderr)
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError("", problems)
    return 0
