"""The report every stage writes (`report.json`) and the gate, bundle and PR report read."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StageStatus(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class StageReport(BaseModel):
    """Outcome of one stage for one release. Skipped is never passed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: str = Field(description="Stage name, e.g. `export`.")
    release: str = Field(description="Release name.")
    status: StageStatus = Field(description="passed, failed or skipped.")
    summary: str = Field(description="One-line verdict shown in `dvc repro` output.")
    reasons: list[str] = Field(default_factory=list, description="Why it failed or skipped.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Numeric results, also written as DVC metrics."
    )
    details: dict[str, Any] = Field(
        default_factory=dict, description="Stage-specific structured results."
    )

    def acceptable(self, required: bool = False) -> bool:
        """The one rule for "this stage is fine" (manifest, registry and gate all ask here):
        passed, or skipped by a stage that was optional for the release when it ran (its
        report says so: the engine where no GPU is) and that is not `required` now."""
        if self.status is StageStatus.PASSED:
            return True
        optional = self.details.get("optional") is True
        return self.status is StageStatus.SKIPPED and optional and not required
