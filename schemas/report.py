"""The report every stage writes (`report.json`) and the gate, bundle and PR report read."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StageStatus(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class Check(BaseModel):
    """One verdict a stage judged beside its own (a load test's SLO): the gate lists each."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="What was judged, e.g. `SLO p95_latency_ms`.")
    ok: bool = Field(description="Whether it holds.")
    why: str = Field(description="The measured value against its limit, or why none was.")


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
    optional: bool = Field(
        default=False,
        description="The stage was optional for the release when it ran (the engine where "
        "`engine.required` is false): a skip is acceptable.",
    )
    checks: list[Check] = Field(
        default_factory=list, description="Verdicts judged beside the stage's own (SLOs)."
    )
    details: dict[str, Any] = Field(
        default_factory=dict,
        description="Stage-specific results for people (the report, the PR comment): no "
        "code decides anything from them (tests/schemas/test_report_channels.py).",
    )

    @model_validator(mode="before")
    @classmethod
    def _written_before_optional_was_a_field(cls, data: Any) -> Any:
        """A report written before `optional` was typed (a published bundle's) carried it
        as `details.optional`: read there, so an old bundle's skipped engine stays fine."""
        if isinstance(data, dict) and "optional" not in data:
            details = data.get("details")
            if isinstance(details, dict) and details.get("optional") is True:
                data = {**data, "optional": True}
        return data

    def acceptable(self, required: bool = False) -> bool:
        """The one rule for "this stage is fine" (manifest, registry and gate all ask here):
        passed, or skipped by a stage that was optional for the release when it ran (its
        report says so: the engine where no GPU is) and that is not `required` now."""
        if self.status is StageStatus.PASSED:
            return True
        return self.status is StageStatus.SKIPPED and self.optional and not required
