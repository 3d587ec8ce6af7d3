"""What `shipyard verify --provenance` checks: the chain of stage attestations a bundle
carries (attestations/<stage>.json, pipelines/provenance.py), apart from that module so that
what every stage run imports stays small (the bundle layout is not every stage's code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelines.provenance import compare, listed, read, signer
from schemas import RegistryError
from schemas.manifest import BUNDLE_UNHASHED, PROVENANCE_DIR
from stages.bundling.hashing import hash_files


def bundle_chain(
    bundle: Path,
    trusted: dict[str, Any],
    stages: tuple[str, ...],
    made_here: tuple[str, ...] = (),
) -> tuple[list[str], list[str]]:
    """(lines, problems) for the attestations a bundle carries (attestations/<stage>.json):
    each signed by a trusted builder and naming its own stage; each stage's inputs what the
    upstream stage's attestation says it produced, so the chain from the model and the spec
    to the bundle is one build's; and every shipped file, by name and digest, in the file
    list the bundle's builder signed (attestations/bundle.json, stages/bundle.py): an
    edited, added, renamed or deleted file fails, however the bundle was re-sealed. Asked
    without "bundle" in `stages` (a chain of some stages only), each shipped file must only
    be some attested run's output, but what `made_here` names (names, folders ending /)."""
    lines, problems = [], []
    produced: dict[str, dict[str, str]] = {}  # stage -> {file: sha256} it attests
    for stage in stages:
        path = bundle / PROVENANCE_DIR / f"{stage}.json"
        try:
            stmt, signatures, payload = read(path)
        except RegistryError as exc:
            problems.append(f"{stage}: {exc}")
            continue
        predicate = stmt.get("predicate") or {}
        if predicate.get("stage") != stage:
            problems.append(f"{stage}: {path.name} attests {predicate.get('stage')!r}")
            continue
        who = signer(signatures, payload, trusted)
        if who is None:
            problems.append(f"{stage}: not signed by a trusted builder")
            continue
        produced[stage] = listed(stmt.get("subject"))
        inputs = listed(predicate.get("inputs"))
        for name, digest in sorted(inputs.items()):
            parts = name.split("/")
            upstream = parts[2] if len(parts) > 3 and parts[0] == "build" else None
            if upstream in produced and produced[upstream].get(name) != digest:
                problems.append(f"{stage}: its input {name} is not what {upstream} attested")
        lines.append(f"{stage}: built by {who}")
    own = f"{PROVENANCE_DIR}/bundle.json"
    if "bundle" not in stages:
        attested_any = {d for files in produced.values() for d in files.values()}
        skip = (*BUNDLE_UNHASHED, *made_here)
        rest = {
            p.relative_to(bundle).as_posix(): p
            for p in sorted(bundle.rglob("*"))
            if p.is_file() and p.relative_to(bundle).parts[0] != PROVENANCE_DIR
        }
        for name, digest in sorted(hash_files(rest).items()):
            made = name in skip or any(p.endswith("/") and name.startswith(p) for p in skip)
            if not made and digest not in attested_any:
                problems.append(f"{name}: no attested stage run produced it")
        return lines, problems
    if "bundle" not in produced:  # no trusted file list: said above
        return lines, problems
    shipped = {
        p.relative_to(bundle).as_posix(): p
        for p in sorted(bundle.rglob("*"))
        if p.is_file() and p.relative_to(bundle).as_posix() not in (*BUNDLE_UNHASHED, own)
    }
    problems += compare("shipped file", produced["bundle"], hash_files(shipped))
    return lines, problems
