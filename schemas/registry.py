"""What the registry keeps besides bundles (`pipelines/registry.py`), each file checked on
read by its model here instead of by bare subscripts: a torn or hand-edited file is a clear
error naming it, never a KeyError later. Keys a later version adds are kept (`extra`).

The registry writes a file from its model too (`RegistryFile.document`): the keys it was
made or read with, no others, so a file reads back and writes out byte for byte
(tests/pipelines/test_registry_files.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DIGEST = r"^[0-9a-f]{64}$"


class RegistryFile(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    def document(self) -> dict[str, Any]:
        """The file's JSON object: exactly the keys the model was read or made with (a key
        left to its default is not written), extras included, `from_` as `from`."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class PublishRecord(RegistryFile):
    """releases/<name>/<version>.json: the commit point of a publish."""

    release: str
    version: str
    digest: str = Field(pattern=DIGEST, description="The bundle's OMS root digest.")
    manifest_sha256: str | None = Field(
        default=None, pattern=DIGEST, description="None in records written before it was kept."
    )
    by: str | None = Field(default=None, description="Who published (informational).")
    at: str | None = Field(default=None, description="When (informational).")
    recovered: bool = Field(default=False, description="Finished by `registry check`.")


class ChannelPointer(RegistryFile):
    """channels/<name>/<channel>.json: the version a channel serves."""

    release: str
    version: str
    digest: str = Field(pattern=DIGEST)
    since: str | None = None
    canary_percent: int | None = Field(
        default=None,
        ge=0,
        le=100,
        description="A canary step: the share of traffic the cluster sends this version "
        "(`promote --canary`); None: all of it.",
    )


class SignaturePolicy(RegistryFile):
    """policy/<channel>.json: the keys a channel trusts."""

    require_signature: bool
    public_keys: list[str] = Field(default_factory=list)
    by: str | None = None
    at: str | None = None


class HistoryEntry(RegistryFile):
    """One line of history.jsonl (or one history/<seq>.json object)."""

    seq: int = Field(ge=1)
    at: str
    who: str | None = None
    action: Literal["promote", "rollback"]
    channel: str
    from_: str | None = Field(default=None, alias="from")
    to: str = Field(pattern=r"^[^@]+@[^@]+$", description="release@version")
    digest: str | None = None
    reason: str | None = None
    canary_percent: int | None = Field(default=None, ge=0, le=100)


class UploadMarker(RegistryFile):
    """releases/<name>/.upload-<version>.json (object stores): whose upload of a version is in
    flight, by the token of the lock lease it holds."""

    token: str
    by: str | None = None
    at: str | None = None
