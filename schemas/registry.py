"""What the registry keeps besides bundles (`pipelines/registry.py`), each file checked on
read by its model here instead of by bare subscripts: a torn or hand-edited file is a clear
error naming it, never a KeyError later. Keys a later version adds are kept (`extra`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DIGEST = r"^[0-9a-f]{64}$"


class _Kept(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)


class PublishRecord(_Kept):
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


class ChannelPointer(_Kept):
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


class SignaturePolicy(_Kept):
    """policy/<channel>.json: the keys a channel trusts."""

    require_signature: bool
    public_keys: list[str] = Field(default_factory=list)
    by: str | None = None
    at: str | None = None


class HistoryEntry(_Kept):
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
