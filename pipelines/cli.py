"""The `shipyard` command line. The only place that catches ShipyardError."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from schemas import ShipyardError, StageStatus

VERDICT = {StageStatus.PASSED: "PASS", StageStatus.FAILED: "FAIL", StageStatus.SKIPPED: "SKIP"}


def cmd_validate(args: argparse.Namespace) -> int:
    from schemas import SpecError
    from schemas.loader import load_release

    problems = []
    for spec in args.specs:
        try:
            release = load_release(spec)
            print(f"{spec}: ok ({release.name} {release.version}, {release.task})")
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError("", problems)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from pipelines import compiler
    from stages import repo_root

    root = repo_root()
    if args.check:
        if compiler.is_stale(root):
            print(
                "dvc.yaml is stale: it does not match releases/*.yaml and the stages; "
                "run `shipyard compile` and commit the result",
                file=sys.stderr,
            )
            return 1
        print("dvc.yaml is up to date")
        return 0
    print(f"wrote {compiler.write(root).relative_to(root)}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from schemas import ReleaseSpec

    print(json.dumps(ReleaseSpec.model_json_schema(), indent=2))
    return 0


def cmd_run_stage(args: argparse.Namespace) -> int:
    from schemas.loader import load_release
    from stages import execute, repo_root

    root = repo_root()
    spec_path = Path(args.release)
    report = execute(args.stage, load_release(spec_path), spec_path, root)
    verdict = VERDICT[report.status]
    print(f"{verdict} {args.stage}@{report.release}: {report.summary}", flush=True)
    for reason in report.reasons:
        print(f"  - {reason}", flush=True)
    return 3 if report.status is StageStatus.FAILED else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from schemas import RegistryError
    from stages.write_manifest import verify_bundle

    problems = verify_bundle(Path(args.bundle))
    if problems:
        raise RegistryError(
            f"bundle {args.bundle} does not match its manifest:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    print(f"{args.bundle}: every file matches manifest.json")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shipyard", description=__doc__)
    p.add_argument("--verbose", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="validate release specs")
    v.add_argument("specs", nargs="+")
    v.set_defaults(func=cmd_validate)
    c = sub.add_parser("compile", help="write dvc.yaml from releases/*.yaml")
    c.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml is stale")
    c.set_defaults(func=cmd_compile)
    sub.add_parser("schema", help="print the release spec JSON Schema").set_defaults(
        func=cmd_schema
    )
    r = sub.add_parser("run-stage", help="run one stage for one release (dvc.yaml's cmd)")
    r.add_argument("stage")
    r.add_argument("--release", required=True, help="path of the release spec")
    r.set_defaults(func=cmd_run_stage)
    f = sub.add_parser("verify", help="re-hash a bundle against its manifest")
    f.add_argument("bundle")
    f.set_defaults(func=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ShipyardError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {exc.render()}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
