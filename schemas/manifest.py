"""The bundle manifest: an in-toto Statement in the OpenSSF model-signing (OMS) layout.

`predicate.resources` lists every file of the bundle as sha256 shards (`path:start:end`);
`subject.digest` is the sha256 of the resource digests concatenated in name order.
Shipyard's own facts (pins, stage verdicts, provenance) sit under `predicate.shipyard`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Resource(Frozen):
    name: str = Field(description="`path:start:end` of one shard of a bundle file.")
    algorithm: str = Field(description="Hash algorithm, e.g. sha256.")
    digest: str = Field(description="Hex digest of the shard's bytes.")


class Serialization(Frozen):
    method: Literal["shards"] = Field(default="shards", description="OMS serialization method.")
    hash_type: Literal["sha256"] = Field(default="sha256", description="Hash of each shard.")
    shard_size: int = Field(description="Shard size in bytes.")
    allow_symlinks: bool = Field(default=False, description="Symlinks are refused.")
    ignore_paths: list[str] = Field(default_factory=list, description="Paths not hashed.")


class Predicate(Frozen):
    serialization: Serialization = Field(description="How the files were hashed.")
    resources: list[Resource] = Field(description="Every shard of every file, by name.")
    shipyard: dict[str, Any] = Field(default_factory=dict, description="Pins, reports, provenance.")


class Subject(Frozen):
    name: str = Field(description="Release name and version.")
    digest: dict[str, str] = Field(description="sha256 over the resource digests.")


class Manifest(Frozen):
    type_: str = Field(default=STATEMENT_TYPE, alias="_type", description="in-toto type.")
    subject: list[Subject] = Field(description="The bundle as one subject.")
    predicateType: str = Field(default=PREDICATE_TYPE, description="OMS predicate type.")  # noqa: N815
    predicate: Predicate = Field(description="Hashes and Shipyard metadata.")

    def files(self) -> dict[str, list[Resource]]:
        """Bundle path -> its shards."""
        out: dict[str, list[Resource]] = {}
        for r in self.predicate.resources:
            out.setdefault(r.name.rsplit(":", 2)[0], []).append(r)
        return out
