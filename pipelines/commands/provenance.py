"""`shipyard provenance [RELEASE...]`: was every stage output built by a trusted builder
from these inputs?"""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "provenance",
        help="check that every stage output was built by a trusted builder from these inputs",
        description="Check each stage output of the releases (default: all) against its "
        "attestation: signed by a trusted builder, for this stage and release, its outputs "
        "byte for byte and its inputs as this checkout has them, params files included. "
        "--evict removes each output that fails, so the next `dvc repro` rebuilds it.",
    )
    parser.add_argument("releases", nargs="*", help="release names (default: every release)")
    _common.trusted_builder_option(parser)
    parser.add_argument(
        "--evict",
        action="store_true",
        help="remove each untrusted output with its cached objects and run-cache entries, "
        "so the next dvc repro rebuilds it",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Every stage of the releases: built by a trusted builder from these inputs?"""
    from pipelines import compiler, fingerprint, provenance
    from schemas import RegistryError, SpecError

    root = _common.root()
    trusted = _common.trusted(args)
    releases, all_ios = compiler.stage_ios(root)
    wanted = {s.name for _, s in releases} if not args.releases else set(args.releases)
    bad = 0
    # every stage's attestation holds against the params it read; the params themselves
    # must be this checkout's (a restored `code` output makes the whole chain an old build)
    stale = compiler.stale_fingerprints(root, wanted)
    if stale:
        print(
            f"FAIL {fingerprint.CODE_STAGE}: "
            + "; ".join(stale[:3])
            + (f"; {len(stale) - 3} more" if len(stale) > 3 else "")
            + ": not rebuilt since a change, or restored from another build (DVC's "
            "run-cache or a remote); run `shipyard fingerprint`, then `dvc repro` rebuilds "
            "what depends on it"
        )
    for _, spec in releases:
        if spec.name not in wanted:
            continue
        for stage in all_ios:
            paths = provenance.stage_paths(root, stage, spec.name)
            who, problems = (
                provenance.check(root, paths, trusted)
                if paths is not None
                else (None, ["not in dvc.yaml: run `shipyard compile`"])
            )
            if problems:
                bad += 1
                print(f"FAIL {stage}@{spec.name}: " + "; ".join(problems))
                if args.evict:
                    from pipelines import cache

                    cache.evict(root, stage, spec.name)
                    print(f"     removed: `dvc repro {stage}@{spec.name}` rebuilds it")
            else:
                print(f"ok   {stage}@{spec.name}: built by {who}")
    unknown = wanted - {s.name for _, s in releases}
    if unknown:
        raise SpecError("releases/", [f"no such release: {', '.join(sorted(unknown))}"])
    if stale and not bad:
        raise RegistryError(
            f"{len(stale)} params file(s) under {compiler.PARAMS_DIR} are not this checkout's: "
            "run `shipyard fingerprint`, then `dvc repro`"
        )
    if bad:
        raise RegistryError(
            (f"{len(stale)} stale params file(s) and " if stale else "")
            + f"{bad} stage output(s) without trusted provenance: "
            + (
                "removed with their cached objects and run-cache entries; `dvc repro` rebuilds them"
                if args.evict
                else "rebuild them (`--evict`, then `dvc repro`) on a trusted builder"
            )
        )
    return 0
