"""`shipyard run-stage STAGE --release SPEC`: one stage of one release (dvc.yaml's cmd).

Loaded by every stage run: what this module imports at its top is imported by every stage
(tests/pipelines/test_derived_deps.py), so everything else is imported in `run`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "run-stage",
        help="run one stage for one release (dvc.yaml's cmd)",
        description="Run one stage of one release in a private folder, publish its "
        "outputs and report atomically, and write their provenance (signed when "
        "SHIPYARD_BUILDER_KEY names a key); prints PASS, FAIL or SKIP with the reasons, and "
        "exits 3 when the stage failed. `dvc repro` runs this for every stage.",
    )
    parser.add_argument(
        "stage", help="the stage to run (pin, export, ... bundle: dvc.yaml's order)"
    )
    parser.add_argument("--release", required=True, help="path of the release spec")
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines import provenance
    from schemas import SpecError, StageStatus
    from schemas.loader import load_release
    from stages import STAGES, execute

    verdicts = {StageStatus.PASSED: "PASS", StageStatus.FAILED: "FAIL", StageStatus.SKIPPED: "SKIP"}
    if args.stage not in STAGES:  # an argument mistake (exit 2), as `build --until` says
        raise SpecError(
            args.stage,
            [f"{args.stage}: no such stage\n  fix: choose one of: {', '.join(STAGES)}"],
        )
    root = _common.root()
    spec_path = Path(args.release)
    key = provenance.builder_key()  # a bad key fails before the stage runs
    report = execute(args.stage, load_release(spec_path), spec_path, root)
    paths = provenance.stage_paths(root, args.stage, report.release)
    if paths is not None:  # outside a DVC project nothing declares what to attest
        if report.status is not StageStatus.FAILED:
            no_plot_here(root, paths.outs, report.release)
        provenance.write(root, paths, key)
    verdict = verdicts[report.status]
    print(f"{verdict} {args.stage}@{report.release}: {report.summary}", flush=True)
    for reason in report.reasons:
        print(f"  - {reason}", flush=True)
    return 3 if report.status is StageStatus.FAILED else 0


def no_plot_here(root: Path, outs: tuple[str, ...], release: str) -> None:
    """A plot file dvc.yaml declares for this stage (one template for every release) that
    this release does not draw (no quantization, no streaming) is an empty list, so DVC
    finds every output and the plot shows no points."""
    from stages._contract import PLOTS_DIR

    for out in outs:
        target = root / out
        if out.startswith(f"build/{release}/{PLOTS_DIR}/") and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("[]\n", encoding="utf-8")
