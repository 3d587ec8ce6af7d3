"""Bundle manifests in the exact OMS layout, and the strict check of a bundle against one.

`build_manifest` produces what model_signing 1.x's shard serialization produces for the same
folder (tests/stages/test_manifest_and_bundle.py compares every resource and the root
digest with the library), hashed with our own parallel reader (`_hashing`), which is faster.

`verify_bundle` is stricter than model_signing's verifier on purpose:
- the files it may skip are fixed here (`BUNDLE_UNHASHED`), never read from the manifest;
- a symlink anywhere (the manifest included) or any non-regular file is refused;
- an unlisted file is refused even when it is empty (OMS lists no empty files, so an empty
  `numpy.py` dropped next to the MLServer runtime would otherwise shadow a module unseen).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from schemas.facts import FactsHead
from schemas.manifest import (
    BUNDLE_UNHASHED,
    FACTS_FILE,
    MANIFEST_FILE,
    SHARD_SIZE,
    SHARD_SIZES,
    Manifest,
    Predicate,
    Resource,
    Serialization,
    Subject,
    algorithm_label,
    resource_order,
)
from schemas.problems import first_problem
from stages._contract import write_json
from stages.bundling.hashing import hash_shards

F = TypeVar("F", bound=FactsHead)

# Bundles are small in file count; a manifest beyond this is not ours (and not read whole).
MAX_MANIFEST_BYTES = 64 << 20
MAX_RESOURCES = 200_000  # shards listed (1 GiB shards: 200 TB), under MAX_MANIFEST_BYTES


def build_manifest(subject: str, digests: dict[str, str], shard: int = SHARD_SIZE) -> Manifest:
    """The OMS statement for `name:start:end -> sha256` shard digests."""
    label = algorithm_label(shard)
    names = sorted(digests, key=resource_order)
    resources = [Resource(name=n, algorithm=label, digest=digests[n]) for n in names]
    return Manifest(
        subject=[Subject(name=subject, digest={"sha256": root_digest(resources)})],
        predicate=Predicate(serialization=Serialization(shard_size=shard), resources=resources),
    )


def root_digest(resources: list[Resource]) -> str:
    """sha256 over the resource digests in the order listed (model_signing's Payload)."""
    h = hashlib.sha256()
    for r in resources:
        h.update(bytes.fromhex(r.digest))
    return h.hexdigest()


def write_manifest(path: Path, manifest: Manifest) -> None:
    write_json(path, manifest.model_dump(mode="json", by_alias=True))


def load_manifest(path: Path) -> Manifest:
    """Parse a manifest file; refuses symlinks, non-files and oversized files."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{path.name} is a symlink; a bundle holds plain files only")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    if info.st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path.name} is {info.st_size} bytes (over {MAX_MANIFEST_BYTES})")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read()
    return Manifest.model_validate(json.loads(raw.decode("utf-8")))


def walk(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """Every regular file under `folder` (posix relative name -> path), never following a
    link, plus a problem for each symlink, special file, and each folder or file this user
    cannot list or read: a folder os.walk cannot open is otherwise skipped in silence, and
    whatever hides in it (a package the server imports by name) would pass verify."""
    files: dict[str, Path] = {}
    problems: list[str] = []

    def rel(path: str | Path) -> str:
        return Path(path).relative_to(folder).as_posix() if Path(path) != folder else "."

    def unlisted(exc: OSError) -> None:
        problems.append(
            f"{rel(exc.filename)}: cannot be listed ({exc.strerror}); verify must see every "
            "entry: fix its permissions or verify as its owner"
        )

    for top, dirs, names in os.walk(folder, onerror=unlisted, followlinks=False):
        for name in sorted(dirs + names):
            path = Path(top) / name
            try:
                mode = os.lstat(path).st_mode
            except OSError as exc:
                problems.append(f"{rel(path)}: cannot be read ({exc.strerror})")
                continue
            if stat.S_ISLNK(mode):
                problems.append(f"{rel(path)}: is a symlink; bundles hold plain files only")
            elif stat.S_ISREG(mode):
                if os.access(path, os.R_OK):
                    files[rel(path)] = path
                else:
                    problems.append(
                        f"{rel(path)}: cannot be read (permission denied); verify must hash "
                        "every file: fix its permissions or verify as its owner"
                    )
            elif not stat.S_ISDIR(mode):
                problems.append(f"{rel(path)}: is not a regular file")
    return files, problems


def verify_bundle(folder: Path, workers: int | None = None) -> list[str]:
    """Re-hash a bundle; every added, missing, changed or unsafe file (empty = intact)."""
    if folder.is_symlink() or not folder.is_dir():
        return [f"{folder}: not a directory (or a symlink to one); not a Shipyard bundle"]
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.exists() and not manifest_path.is_symlink():
        return [f"{MANIFEST_FILE}: missing; not a Shipyard bundle"]
    try:
        manifest = load_manifest(manifest_path)
    except (OSError, ValueError, ValidationError) as exc:
        first = str(exc).splitlines()[0][:300]
        return [f"{MANIFEST_FILE}: not a valid OMS manifest ({first})"]
    problems = manifest_problems(manifest)
    if problems:
        return problems
    present, problems = walk(folder)
    for skipped in BUNDLE_UNHASHED:
        present.pop(skipped, None)
    listed = manifest.files()
    problems += [f"{n}: added (not in the manifest)" for n in sorted(set(present) - set(listed))]
    problems += [
        f"{n}: missing (listed in the manifest)" for n in sorted(set(listed) - set(present))
    ]
    common = {n: present[n] for n in sorted(set(listed) & set(present))}
    shard = manifest.predicate.serialization.shard_size
    # counted before hashing: a file must make as many shards at the manifest's shard
    # size as the manifest lists for it (shard_size 1 over 6 GiB was six billion hash
    # jobs, a MemoryError before the signature was checked); what is hashed is then at
    # most the listed resources, which MAX_RESOURCES caps
    for name in list(common):
        count = max(1, -(-common[name].stat().st_size // shard))
        if count != len(listed[name]):
            problems.append(
                f"{name}: changed (its size makes {count} shards of {shard} bytes; the "
                f"manifest lists {len(listed[name])})"
            )
            del common[name]
    actual = hash_shards(common, shard, workers)
    for name in common:
        want = {r.name: r.digest for r in listed[name]}
        have = {k: v for k, v in actual.items() if k.rsplit(":", 2)[0] == name}
        if want != have:
            problems.append(f"{name}: changed (sha256 differs from the manifest)")
    return problems


def manifest_problems(manifest: Manifest) -> list[str]:
    """What makes a manifest itself untrustworthy, before any file is read."""
    s = manifest.predicate.serialization
    problems = []
    if sorted(s.ignore_paths) != sorted(BUNDLE_UNHASHED):
        problems.append(
            f"{MANIFEST_FILE}: ignore_paths is {s.ignore_paths}; a Shipyard bundle skips only "
            f"{sorted(BUNDLE_UNHASHED)} (fixed in code, never taken from the manifest)"
        )
    if s.shard_size not in SHARD_SIZES:
        problems.append(
            f"{MANIFEST_FILE}: shard_size {s.shard_size} is not one Shipyard accepts: a power "
            "of two from 4 KiB to 16 GiB or of ten from 10 kB to 1 GB (fixed in code)"
        )
    if len(manifest.subject) != 1 or set(manifest.subject[0].digest) != {"sha256"}:
        problems.append(f"{MANIFEST_FILE}: needs exactly one subject with a sha256 digest")
    resources = manifest.predicate.resources
    if len(resources) > MAX_RESOURCES:
        return [
            *problems,
            f"{MANIFEST_FILE}: {len(resources)} resources (over {MAX_RESOURCES}); a bundle's "
            "manifest lists a few per file",
        ]
    names = [r.name for r in resources]
    if len(set(names)) != len(names):
        problems.append(f"{MANIFEST_FILE}: a resource is listed twice")
    if any(r.algorithm != algorithm_label(s.shard_size) for r in resources):
        problems.append(
            f"{MANIFEST_FILE}: every resource must be labelled {algorithm_label(s.shard_size)}"
        )
    try:
        ordered = names == sorted(names, key=resource_order)
    except ValueError:
        return [*problems, f"{MANIFEST_FILE}: a resource name is not path:start:end"]
    if not ordered:
        problems.append(f"{MANIFEST_FILE}: resources are not in OMS order (edited?)")
    if not problems and root_digest(resources) != manifest.digest:
        problems.append(f"{MANIFEST_FILE}: subject digest does not match its resources (edited?)")
    return problems


def read_facts(folder: Path, model: type[F]) -> F:
    """`shipyard.json` of a bundle as `model` (FactsHead: what any bundle's facts promise;
    BundleFacts: all of this version's); only call after `verify_bundle` found nothing. A
    file that does not match is a ValueError naming it and the field."""
    try:
        return model.model_validate_json((folder / FACTS_FILE).read_bytes())
    except ValidationError as exc:
        raise ValueError(f"{FACTS_FILE}: {first_problem(exc)}") from None


def empty_files(files: dict[str, Path]) -> list[str]:
    """Names of empty files: OMS cannot list them, so a bundle must not carry them."""
    return sorted(n for n, p in files.items() if p.stat().st_size == 0)
