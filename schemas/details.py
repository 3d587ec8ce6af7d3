"""What the checking stages put in their reports' `details`, typed.

`details` are for people: no stage, gate or registry reads them (tests/schemas/
test_report_channels.py holds that). Each stage still writes them through the model here
(`dump()`), so a report's details have one shape the tests read back by field, and a
misspelled key fails when a stage writes it instead of showing up in a report as a new one.
Optional keys are written only when the stage set them, as before.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.artifacts import GitState, VersionLock


class _Details(BaseModel):
    # inf is a real value here: a NaN or shape mismatch reads as an infinite error
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def dump(self) -> dict[str, Any]:
        """The details as the report carries them: the keys the stage set, by alias."""
        return self.model_dump(exclude_unset=True, by_alias=True)


class Compared(_Details):
    """One comparison of an output with its reference: what the comparator
    (stages/onnx/compare.py) returns, read by field by every check that calls it; the rows
    below are the same comparison placed (at a shape, a module, a decode probe)."""

    ok: bool
    error: float = Field(description="The normalized error, reduced by the statistic.")
    max_abs: float
    note: str | None = Field(default=None, description="Why it could not be compared.")
    atol_scale: float | None = Field(default=None, description="Set when not 1 (scale: rms).")


class ShapeComparison(Compared):
    shape: str = Field(description="min, opt, max, odd, or a parity.shapes entry.")
    sizes: dict[str, int]
    output: str


class LayerComparison(Compared):
    module: str = Field(description="The PyTorch module ([k]: its k-th output).")
    tensor: str = Field(description="The ONNX tensor it was matched with.")


class Layerwise(_Details):
    compared: int
    first_divergent: LayerComparison | None
    layers: list[LayerComparison]


class ParityDetails(_Details):
    comparisons: list[ShapeComparison]
    layerwise: Layerwise | None = Field(default=None, description="On failure, or always.")


class KvComparison(Compared):
    probe: str = Field(description="e.g. `step 3`, `past 48`, `padded row 1 (3 pads) step 4`.")
    past: int
    output: str
    position: int = Field(description="The first diverging position (-1: none found).")
    rounding: float | None = Field(
        default=None,
        description="A quantized graph's present accepted though out of tolerance: its rms "
        "error as a share of the quantization's own (shipped vs FP32 full pass), at most "
        "0.1: a quantizer's rounding step flipped by float-level differences.",
    )


class KvPlan(_Details):
    prompt: int
    steps: int
    past_lengths: list[int]
    prefill_chunk: int
    padded: list[int] | None = Field(description="Row lengths and steps; None: not checked.")
    full_pass_lengths: list[int]


class ShippedKv(_Details):
    graph: str
    rows: list[KvComparison]


class KvcheckDetails(_Details):
    plan: KvPlan
    pytorch: list[KvComparison]
    onnx: list[KvComparison]
    shipped: ShippedKv


class Probed(_Details):
    shape: str
    sizes: dict[str, int]
    ok: bool


class TiedWeight(_Details):
    dropped: str
    kept: str
    how: str = Field(description="`copy` or `transpose`: what the dropped one was of the kept.")


class Embedding(_Details):
    pooling: str
    normalize: bool
    source: str = Field(alias="from", description="What decided the pooling.")


class ExportDetails(_Details):
    trace_sizes: dict[str, int]
    probed: list[Probed]
    model_files: list[str]
    tied_weights: list[TiedWeight] | None = None
    embedding: Embedding | None = None


class ThresholdResult(_Details):
    """One threshold's verdict: stages/quant/thresholds.py `check` (evaluate's thresholds,
    the gate's against production) and evaluate's accuracy-contract bounds, in one shape.
    Read by field where it is judged; written as is into evaluate's report."""

    metric: str
    baseline: str
    value: float | None
    baseline_value: float | None
    ok: bool
    message: str


class EvaluateDetails(_Details):
    metrics: dict[str, float]
    contract: list[ThresholdResult] = Field(
        default_factory=list,
        description="quantization.budget's bounds on the evaluation set (schemas/contract.py).",
    )
    thresholds: list[ThresholdResult]
    samples: int


class PinDetails(VersionLock):
    """The pins (the artifact) and the repository's state, which stays out of the pins: a
    commit is not a dependency."""

    git: GitState

    def dump(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)
