"""The quantize stage's search, typed: the rows it measures and the details it reports.

An explicit method ranks nodes by sensitivity (`SensitivityRow`), keeps the k most damaging
in float until the budget holds (`SelectionRow`) and shows where error enters
(`LayerRow`): `PerNodeDetails`. Method auto tries recipes (`RecipeTrial`, one row a variant
measured): `RecipeSearchDetails`. Both are `StageReport.details` (for people: no code
decides from them), built and serialized here so the report's shape is spelled once and a
misspelled or missing field fails where the row is made. The recipe table also ships, as
`QuantInfo.recipes` (`RecipeRow`, which the model card prints).

A metric set (`calibration`, `holdout`) stays `dict[str, float]` keyed by metric name, like
`StageReport.metrics` and `Evaluation.metrics`: the budget's bounds name the metrics they
hold (stages/quant/accuracy.py BOUNDS). Where a row carries its metrics inline (sensitivity,
selection), they are the optional fields of `Measured`, and a metric not measured is absent
from the JSON, not null.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_serializer,
    model_serializer,
)

from schemas.spec.quantization import AccuracyBudget


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Sparse(_Row):
    """A row whose unset (None) fields are left out of its JSON: absent means not measured
    (or not reached), which the report has always said by leaving the key out."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class Measured(_Sparse):
    """What stages/quant/accuracy.py measures of a variant against FP32, inline in a row."""

    top1_agreement: float | None = None
    logit_cosine: float | None = None
    snr_db: float | None = None
    perplexity_fp32: float | None = None
    perplexity: float | None = None
    perplexity_increase: float | None = None
    greedy_agreement: float | None = Field(
        default=None, description="Only when the budget bounds it (it costs generation)."
    )


class SensitivityRow(Measured):
    """One candidate node: quantized alone and measured end to end, or (`one pass`) ranked
    by its local SNR in one run of the fully quantized model only."""

    node: str
    module: str = Field(description="The node's module scope; empty when it has none.")
    measured: Literal["alone", "one pass"]
    local_snr_db: float | None = Field(
        default=None, description="Its own output's mean per-channel SNR (one-pass ranking)."
    )


class SelectionRow(Measured):
    """Mixed precision with the `float_nodes` most sensitive nodes kept in float."""

    float_nodes: int
    meets_budget: bool


class LayerRow(_Row):
    """SNR of a module's last tensor, FP32 vs quantized (where error enters)."""

    module: str
    tensor: str
    snr_db: float
    worst_channel_snr_db: float


class LayerPlotRow(_Row):
    """A LayerRow as a DVC plot row (x: its position in execution order)."""

    layer: int
    module: str
    snr_db: float
    worst_channel_snr_db: float


class FileSize(_Row):
    """The quantized files against the export's."""

    bytes: int
    fp32_bytes: int
    ratio: float


class CalibrationSummary(_Row):
    """The calibration data used: where from, its digest, how it was split."""

    path: str
    sha256: str
    samples: int
    holdout: int


class SpeedCheck(_Sparse):
    """One timed pass of a variant against FP32 (stages/quant/speed.py): the timed median
    ratio with its 95 % interval, the cost model's prediction, and which of them decided."""

    ratio: float = Field(description="Median over interleaved rounds of FP32 time / variant time.")
    interval: tuple[float, float] = Field(description="95 % interval of that median.")
    predicted: float = Field(description="The deterministic cost model's FP32 cost / variant's.")
    decided_by: Literal["timing", "cost model"] = Field(
        description="timing: the interval cleared the bar by the band; else the cost model."
    )
    fast: bool = Field(description="At least quantization.min_speedup by what decided.")
    rounds: int | None = Field(
        default=None,
        description="Interleaved rounds timed: 15, or fewer when every ratio at a look (6, "
        "9, 12 rounds) already cleared the bar by the band on one side (absent in reports "
        "written before the early stop: 15).",
    )


class RecipeRow(_Row):
    """One variant the `auto` recipe search measured (the model card prints the table)."""

    recipe: str
    method: str
    float_classes: list[str] = Field(description="Layer classes kept in float.")
    size_ratio: float = Field(description="Quantized / FP32 file size.")
    speedup: float | None = Field(
        default=None,
        description="FP32 time / quantized time, slowest decisive pass; None: not timed (it "
        "failed its accuracy budget and could not become the fallback).",
    )
    speed_decided_by: Literal["timing", "cost model"] | None = Field(
        default=None,
        description="What decided the slowest decisive pass's verdict (None: not timed); "
        "`speedup` is the timed median, or the cost model's prediction when it decided.",
    )
    calibration: dict[str, float] = Field(
        default_factory=dict, description="Budget metrics on the calibration probe."
    )
    holdout: dict[str, float] = Field(
        description="Budget metrics on held-out samples; empty when the calibration probe "
        "already broke the budget (the variant could not ship: held-out was not measured)."
    )
    chosen: bool
    why: str


class RecipeTrial(RecipeRow):
    """A recipe table row as the search keeps it: with every pass it timed. The search
    completes a row as it goes (timed later as the fallback, then chosen), so it is
    mutable, and each assignment is validated."""

    model_config = ConfigDict(frozen=False, validate_assignment=True)

    speedups: dict[str, float] = Field(
        default_factory=dict, description="FP32 time / quantized time of each pass timed."
    )
    speed: dict[str, SpeedCheck] = Field(
        default_factory=dict, description="Each pass timed: interval, prediction, verdict."
    )

    def shipped(self) -> RecipeRow:
        """The row as QuantInfo ships it (without the per-pass speed-ups)."""
        return RecipeRow.model_validate(self.model_dump(include=set(RecipeRow.model_fields)))


class _Details(_Sparse):
    """What both searches report. Mutable: a section is added as the stage reaches it."""

    model_config = ConfigDict(frozen=False, validate_assignment=True)

    calibration: CalibrationSummary
    budget: AccuracyBudget
    preprocess: str = Field(description="How the FP32 graph was pre-processed.")
    layerwise: list[LayerRow] | None = None
    size: FileSize | None = Field(default=None, description="Once the variant is published.")

    @field_serializer("budget", "budget_with_margin", check_fields=False)
    def _bounds_given(self, budget: AccuracyBudget) -> dict[str, float]:
        return budget.model_dump(exclude_none=True)


class PerNodeDetails(_Details):
    """An explicit method: per-node sensitivity and mixed precision."""

    sensitivity: list[SensitivityRow] = Field(description="Most damaging first.")
    selection: list[SelectionRow]
    holdout: dict[str, float] = Field(description="The chosen variant on held-out samples.")
    float_nodes: list[str]


class FusedDetails(_Details):
    """A weight-only method with `graph: fused`: the rebuilt decoder, measured whole."""

    builder: str = Field(description="What wrote the graph (onnxruntime-genai's version).")
    kernels: dict[str, int] = Field(description="The graph's nodes by op type.")
    probe: dict[str, float] = Field(description="Budget metrics on the calibration probe.")
    holdout: dict[str, float] = Field(
        description="Budget metrics on held-out samples; empty when the probe already broke "
        "the budget."
    )


class RecipeSearchDetails(_Details):
    """Method auto: every recipe variant measured, and FP32's own figures."""

    recipes: list[RecipeTrial]
    fp32: dict[str, int | float] = Field(
        description="The export's bytes, and FP32's median seconds (x1000: `<pass>_ms`) of "
        "each pass timed."
    )
    budget_with_margin: AccuracyBudget
    chosen: str | None = Field(default=None, description="The recipe shipped.")
    fallback: str | None = Field(
        default=None,
        description="Why no recipe shipped, when the FP32 model shipped in its place "
        "(quantization.fallback fp32).",
    )
