"""manifest: sha256 of every file that goes into the bundle, in the OMS manifest layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas import ReleaseSpec, StageError
from schemas.artifacts import (
    CalibrationUsed,
    EngineBuild,
    EngineProfiles,
    Evaluation,
    LoadTestSummary,
    Provenance,
    QuantInfo,
    ServingValues,
    VersionLock,
)
from schemas.facts import BundleFacts
from schemas.manifest import FACTS_FILE, MANIFEST_FILE
from stages._contract import StageContext, StageIO, StageResult, read_report, write_json
from stages.bundling.files import CHECKED, payload
from stages.bundling.hashing import hash_shards
from stages.bundling.oms import build_manifest, empty_files, write_manifest

if TYPE_CHECKING:
    from schemas.report import StageReport

NAME = "manifest"


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task"),
        reads=FACT_SOURCES,
        upstream=CHECKED,
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    reports = {s: read_report(ctx.upstream(s)) for s in CHECKED}
    bad = [f"{s}: {r.status.value}" for s, r in reports.items() if not r.acceptable()]
    if bad:
        raise StageError(
            NAME,
            f"upstream stages did not pass ({', '.join(bad)})",
            "fix those stages first; a manifest only covers passing releases",
        )
    files = payload(ctx)
    empty = empty_files(files)
    if empty:
        raise StageError(
            NAME,
            f"empty file(s) would ship: {', '.join(empty)}; OMS manifests list no empty files, "
            "so verify would refuse them",
            "make the stage that writes them write content, or leave them out of the bundle",
        )
    write_json(ctx.work / FACTS_FILE, facts(ctx, release, reports))
    files[FACTS_FILE] = ctx.work / FACTS_FILE
    total = sum(p.stat().st_size for p in files.values())
    with ctx.progress(f"hashing {total / 1e6:.1f} MB", total) as advance:
        digests = hash_shards(files, advance=advance)
    manifest = build_manifest(f"{ctx.release}@{release.version}", digests)
    write_manifest(ctx.work / MANIFEST_FILE, manifest)
    return StageResult.passed(
        f"{len(files)} files, {len(digests)} shards, {total / 1e6:.1f} MB "
        f"hashed; content digest {manifest.digest[:16]} (before the model card)",
        metrics={"bytes_hashed": total, "files": len(files)},
    )


# What the facts are made of: every one a typed artifact, none read from a report's details.
FACT_SOURCES = (
    VersionLock,
    Provenance,
    QuantInfo,
    CalibrationUsed,
    Evaluation,
    EngineProfiles,
    EngineBuild,
    ServingValues,
    LoadTestSummary,
)


def facts(
    ctx: StageContext, release: ReleaseSpec, reports: dict[str, StageReport]
) -> dict[str, Any]:
    """Everything the gate, the registry or a reader trusts: shipped as `shipyard.json`,
    hashed (and signed) like every other bundle file."""
    lock, engine = ctx.read(VersionLock), ctx.read(EngineBuild, optional=True)
    out: dict[str, Any] = {
        "release": ctx.release,
        "version": release.version,
        "task": release.task,
        "pins": lock.model_dump(),
        "provenance": ctx.read(Provenance).model_dump(),
        "stages": {s: {"status": r.status.value, "summary": r.summary} for s, r in reports.items()},
        "quantization": ctx.read(QuantInfo).model_dump(exclude_none=True),
        # The gate compares later candidates with these when this release is in production.
        "evaluation": ctx.read(Evaluation).metrics,
        "engine": {
            "status": reports["engine"].status.value,
            "profiles": [
                {"name": p.name, "dims": {k: d.model_dump() for k, d in p.dims.items()}}
                for p in ctx.read(EngineProfiles).profiles
            ],
            **(
                engine.model_dump(include={"tensorrt", "gpu", "compute_capability"})
                if engine
                else {}
            ),
        },
        "loadtest": ctx.read(LoadTestSummary).summary.model_dump(exclude_none=True),
        "serving": ctx.read(ServingValues).model_dump(),
    }
    calibration = ctx.read(CalibrationUsed)
    if calibration.path:  # the data the weights were fitted to is part of what ships
        out["calibration"] = calibration.model_dump()
    BundleFacts.model_validate(out)  # every part typed (schemas/facts.py), as the readers expect
    return out
