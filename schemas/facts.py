"""`shipyard.json`: a bundle's facts (pins, stage verdicts, metrics, serving values),
hashed and signed like every other bundle file, written by the manifest stage.

Two views of one file:
- `FactsHead`: what any Shipyard reads of any bundle's facts, whichever version built it
  (the registry: release, version and verdicts; the gate: the evaluation baseline). Keys it
  does not name are kept, so a bundle built by a later version still reads.
- `BundleFacts`: everything this version's manifest writes, each part the typed artifact it
  came from; the manifest validates what it writes against it, and the bundle stage (the
  same build) reads it so.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.artifacts import (
    CalibrationUsed,
    DimSizes,
    Provenance,
    QuantInfo,
    ServingValues,
    VersionLock,
)
from schemas.loadresults import Headline


class StageVerdict(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    status: str = Field(description="passed, failed or skipped, as the stage's report says.")
    summary: str | None = None


class FactsHead(BaseModel):
    """The part of the facts every reader relies on."""

    model_config = ConfigDict(extra="allow", frozen=True)

    release: str
    version: str
    stages: dict[str, StageVerdict] = Field(default_factory=dict)
    evaluation: dict[str, float] = Field(
        default_factory=dict, description="Task metrics: the baseline later candidates meet."
    )


class ProfileFacts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    dims: dict[str, DimSizes]


class EngineFacts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    status: str
    profiles: list[ProfileFacts]
    tensorrt: str | None = None  # the three only where an engine was built
    gpu: str | None = None
    compute_capability: str | None = None


class BundleFacts(FactsHead):
    """Everything the manifest stage writes into shipyard.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    pins: VersionLock
    provenance: Provenance
    quantization: QuantInfo
    engine: EngineFacts
    loadtest: Headline
    serving: ServingValues
    calibration: CalibrationUsed | None = None
