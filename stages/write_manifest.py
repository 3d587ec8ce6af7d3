"""manifest: sha256 of every file that goes into the bundle, in the OMS manifest layout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from schemas import ReleaseSpec, StageError
from schemas.manifest import Manifest, Predicate, Resource, Serialization, Subject
from stages._hashing import SHARD, hash_shards
from stages._runtime import StageContext, StageIO, StageResult, read_report, write_json

NAME = "manifest"
CHECKED = (
    "pin",
    "export",
    "evalcheck",
    "parity",
    "quantize",
    "evaluate",
    "plan",
    "engine",
    "serve",
    "loadtest",
)


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task"),
        upstream=CHECKED,
        code=("stages/_hashing.py", "schemas/manifest.py"),
    )


def acceptable(report: Any) -> bool:
    """Passed, or skipped by a stage that is optional for this release (an engine where no
    GPU is; the report says so). A required stage that skipped is a failure."""
    status = report.status.value
    return status == "passed" or (status == "skipped" and report.details.get("optional") is True)


def payload(ctx: StageContext) -> dict[str, Path]:
    """Bundle path -> upstream file, for the model and the stage reports."""
    quantized = ctx.upstream("quantize")
    files = {f"model/{p.name}": p for p in sorted(quantized.glob("model.onnx*"))}
    files["model/model_info.json"] = ctx.upstream("export") / "model_info.json"
    files["model/quant_info.json"] = quantized / "quant_info.json"
    for stage in CHECKED:
        files[f"reports/{stage}.json"] = ctx.upstream(stage) / "report.json"
    # Triton wants the model inside its repository entry: the same file under a second name.
    for p in sorted(quantized.glob("model.onnx*")):
        files[f"serving/triton/{ctx.release}/1/{p.name}"] = p
    files.update(_outputs(ctx.upstream("serve"), ""))
    engine = ctx.upstream("engine")
    files.update(
        {k: v for k, v in _outputs(engine, "").items() if k.startswith("serving/")}
        | {f"engine/{p.name}": p for p in sorted(engine.glob("*")) if p.is_file()}
    )
    files.pop("engine/report.json", None)
    files.update(_outputs(ctx.upstream("loadtest"), "reports/loadtest/"))
    return files


def _outputs(folder: Path, prefix: str) -> dict[str, Path]:
    """Every file a stage wrote but its report (which goes under reports/)."""
    return {
        prefix + p.relative_to(folder).as_posix(): p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "report.json"
    }


def run(ctx: StageContext, release: Any) -> StageResult:
    reports = {s: read_report(ctx.upstream(s)) for s in CHECKED}
    bad = [f"{s}: {r.status.value}" for s, r in reports.items() if not acceptable(r)]
    if bad:
        raise StageError(
            NAME,
            f"upstream stages did not pass ({', '.join(bad)})",
            "fix those stages first; a manifest only covers passing releases",
        )
    files = payload(ctx)
    total = sum(p.stat().st_size for p in files.values())
    with ctx.progress(f"hashing {total / 1e6:.1f} MB", total) as advance:
        digests = hash_shards(files, advance=advance)
    pin = reports["pin"].details
    facts = {
        "release": ctx.release,
        "version": release.version,
        "task": release.task,
        "pins": {k: pin[k] for k in ("python", "packages", "checkpoints")},
        "provenance": {"git": pin["git"]},
        "stages": {s: {"status": r.status.value, "summary": r.summary} for s, r in reports.items()},
        "quantization": json.loads((ctx.upstream("quantize") / "quant_info.json").read_text()),
    }
    # The gate compares later candidates with these when this release is in production.
    facts["evaluation"] = reports["evaluate"].details["metrics"]
    engine = reports["engine"].details
    facts["engine"] = {
        "status": reports["engine"].status.value,
        "profiles": [{"name": p["name"], "dims": p["dims"]} for p in engine.get("profiles", [])],
        **{k: engine[k] for k in ("tensorrt", "gpu", "compute_capability") if k in engine},
    }
    facts["loadtest"] = reports["loadtest"].details.get("summary", {})
    calibration = reports["quantize"].details.get("calibration")
    if calibration:  # the data the weights were fitted to is part of what ships
        facts["calibration"] = {k: calibration[k] for k in ("path", "sha256")}
    manifest = build_manifest(f"{ctx.release}@{release.version}", digests, facts)
    write_json(ctx.work / "manifest.json", manifest.model_dump(mode="json", by_alias=True))
    return StageResult.passed(
        f"{len(files)} files, {len(digests)} shards, {total / 1e6:.1f} MB "
        f"hashed; digest {manifest.subject[0].digest['sha256'][:16]}",
        metrics={"bytes_hashed": total, "files": len(files)},
    )


# The manifest cannot hash itself; report.json is the bundle stage's own verdict, written
# after the manifest by the stage runner.
IGNORED = ["manifest.json", "report.json"]


def build_manifest(
    subject: str, digests: dict[str, str], facts: dict[str, Any], shard: int = SHARD
) -> Manifest:
    resources = [Resource(name=n, algorithm="sha256", digest=d) for n, d in sorted(digests.items())]
    serialization = Serialization(shard_size=shard, ignore_paths=IGNORED)
    return Manifest(
        subject=[Subject(name=subject, digest={"sha256": subject_digest(resources)})],
        predicate=Predicate(serialization=serialization, resources=resources, shipyard=facts),
    )


def subject_digest(resources: list[Resource]) -> str:
    h = hashlib.sha256()
    for r in sorted(resources, key=lambda r: r.name):
        h.update(bytes.fromhex(r.digest))
    return h.hexdigest()


def load_manifest(path: Path) -> Manifest:
    return Manifest.model_validate(json.loads(path.read_text(encoding="utf-8")))


def verify_bundle(folder: Path, workers: int | None = None) -> list[str]:
    """Re-hash a bundle; list every added, missing or changed file (empty = intact)."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing; not a Shipyard bundle"]
    manifest = load_manifest(manifest_path)
    listed = manifest.files()
    present = {
        p.relative_to(folder).as_posix(): p
        for p in folder.rglob("*")
        if p.is_file() or p.is_symlink()
    }
    for ignored in manifest.predicate.serialization.ignore_paths:
        present.pop(ignored, None)
    problems = [f"{n}: added (not in the manifest)" for n in sorted(set(present) - set(listed))]
    problems += [
        f"{n}: missing (listed in the manifest)" for n in sorted(set(listed) - set(present))
    ]
    problems += [
        f"{n}: is a symlink; bundles hold plain files" for n, p in present.items() if p.is_symlink()
    ]
    common = {
        n: present[n] for n in sorted(set(listed) & set(present)) if not present[n].is_symlink()
    }
    actual = hash_shards(common, manifest.predicate.serialization.shard_size, workers)
    for name in common:
        want = {r.name: r.digest for r in listed[name]}
        have = {k: v for k, v in actual.items() if k.rsplit(":", 2)[0] == name}
        if want != have:
            problems.append(f"{name}: changed (sha256 differs from the manifest)")
    if subject_digest(manifest.predicate.resources) != manifest.subject[0].digest["sha256"]:
        problems.append("manifest.json: subject digest does not match its resources (edited?)")
    return problems
