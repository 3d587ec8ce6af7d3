"""The bundle manifest: exactly the in-toto Statement that OpenSSF model signing (OMS,
model-signing 1.x) produces for the bundle folder with 1 GiB shard serialization.

- `predicate.resources`: one entry per shard of every non-empty file, named
  `path:start:end`, labelled `sha256-sharded-<shard size>`, ordered as model_signing orders
  them (by path components, then offsets). OMS lists no empty files.
- `subject[0].digest.sha256`: sha256 over the resource digests in that order (the root
  digest; what a signature covers and what the registry records).
- `predicate.serialization`: method, hash type, shard size, symlinks refused, and the two
  paths never hashed (the manifest itself and the signature). Verify does not take that
  list from the manifest: it is fixed in code (`BUNDLE_UNHASHED`).

Shipyard's facts (pins, stage verdicts, metrics, versions) are not in the manifest: they
are the bundle file `shipyard.json`, hashed and signed like every other file.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
SHARD_SIZE = 1 << 30
# The shard sizes a manifest may use, fixed in code (issue 27): powers of two from 4 KiB to
# 16 GiB and of ten from 10 kB to 1 GB (model_signing's default is 10**9). A manifest picks
# among these, never a size of its own: fewer shards than bytes / 4 KiB per file, and with
# MAX_RESOURCES a bounded amount of hashing before the signature is checked.
SHARD_SIZES = frozenset({1 << k for k in range(12, 35)} | {10**k for k in range(4, 10)})
# The only files of a bundle that are not hashed: the manifest cannot hash itself, and the
# signature signs the manifest. Fixed here, never read from a (possibly edited) manifest.
MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "model.sig"
FACTS_FILE = "shipyard.json"
BUNDLE_UNHASHED = (MANIFEST_FILE, SIGNATURE_FILE)
# Each stage run's signed provenance attestation (pipelines/provenance.py): a bundle carries
# every upstream stage's as attestations/<stage>.json. (Not provenance.json: that is pin's
# record of the git state, schemas.artifacts.Provenance.)
PROVENANCE_DIR = "attestations"


def algorithm_label(shard_size: int) -> str:
    """model_signing's label for a sharded sha256 digest."""
    return f"sha256-sharded-{shard_size}"


def resource_order(name: str) -> tuple[tuple[str, ...], int, int]:
    """model_signing sorts shard keys as (PurePath, start, end): path components first."""
    path, start, end = name.rsplit(":", 2)
    return PurePosixPath(path).parts, int(start), int(end)


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Resource(Frozen):
    name: str = Field(description="`path:start:end` of one shard of a bundle file.")
    algorithm: str = Field(description="`sha256-sharded-<shard size>`, as model_signing writes.")
    digest: str = Field(description="Hex sha256 of the shard's bytes.")


class Serialization(Frozen):
    method: Literal["shards"] = Field(default="shards", description="OMS serialization method.")
    hash_type: Literal["sha256"] = Field(default="sha256", description="Hash of each shard.")
    # model_signing stores it through a protobuf Struct, so a signed payload carries a float.
    shard_size: int = Field(description="Shard size in bytes.")
    allow_symlinks: Literal[False] = Field(default=False, description="Symlinks are refused.")
    ignore_paths: list[str] = Field(
        default_factory=lambda: sorted(BUNDLE_UNHASHED),
        description="Paths not hashed: always the manifest and the signature.",
    )


class Predicate(Frozen):
    serialization: Serialization = Field(description="How the files were hashed.")
    resources: list[Resource] = Field(description="Every shard of every non-empty file.")


class Subject(Frozen):
    name: str = Field(description="Release name@version; the registry files the bundle only there.")
    digest: dict[str, str] = Field(description="sha256 over the resource digests, in order.")


class Manifest(Frozen):
    type_: str = Field(default=STATEMENT_TYPE, alias="_type", description="in-toto type.")
    subject: list[Subject] = Field(description="The bundle as one subject.")
    predicateType: str = Field(default=PREDICATE_TYPE, description="OMS predicate type.")  # noqa: N815
    predicate: Predicate = Field(description="Hashes and how they were made.")

    @property
    def digest(self) -> str:
        """The bundle's root digest."""
        return self.subject[0].digest["sha256"]

    def files(self) -> dict[str, list[Resource]]:
        """Bundle path -> its shards."""
        out: dict[str, list[Resource]] = {}
        for r in self.predicate.resources:
            out.setdefault(r.name.rsplit(":", 2)[0], []).append(r)
        return out
