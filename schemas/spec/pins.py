"""`pins`: package versions, Python and checkpoint digests the build must match."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from schemas.spec.base import SHA256_PATTERN, CheckpointName, PackageName, Specifier, Strict


class PinsConfig(Strict):
    python: Specifier | None = Field(default=None, description="PEP 440 specifier for Python.")
    packages: dict[PackageName, Specifier] = Field(
        default_factory=dict,
        description="Package name -> PEP 440 specifier, e.g. `torch: ==2.13.0`.",
    )
    checkpoints: dict[CheckpointName, Annotated[str, Field(pattern=SHA256_PATTERN)]] = Field(
        default_factory=dict,
        description="Checkpoint file (relative to the model folder) -> expected sha256. "
        "When given, every weight file must be listed.",
    )
    require_clean_git: bool = Field(
        default=False, description="Fail when the code has uncommitted changes."
    )
