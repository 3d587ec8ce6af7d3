"""`evaluation`: the metrics each task computes, the data and the thresholds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.spec.base import RepoPath, Strict


class EvalData(Strict):
    path: RepoPath = Field(
        description="JSONL of texts (or NPZ of inputs), relative to the repo root."
    )
    tokenizer: RepoPath | None = Field(
        default=None, description="Folder with tokenizer.json (JSONL)."
    )
    text_field: str = Field(default="text", description="JSONL key holding the text.")
    samples: int = Field(default=64, ge=1, description="Samples to evaluate.")

    @model_validator(mode="after")
    def _readable(self) -> EvalData:
        """Rule: a .jsonl evaluation set needs `tokenizer`; the path ends in .jsonl or .npz (as
        for quantization.calibration: the same reader)."""
        if self.path.endswith(".jsonl") and not self.tokenizer:
            raise ValueError("a JSONL evaluation set needs `tokenizer` (a tokenizer.json folder)")
        if not self.path.endswith((".jsonl", ".npz")):
            raise ValueError(f"path {self.path!r}: use a .jsonl (texts) or .npz (tensors) file")
        return self


class DecodeConfig(Strict):
    prompts: int = Field(default=8, ge=1, description="Prompts to decode greedily (causal-lm).")
    prompt_tokens: int = Field(default=8, ge=1, description="Tokens of each prompt fed first.")
    tokens: int = Field(default=16, ge=1, description="Tokens generated per prompt.")


class MetricThreshold(Strict):
    """MLflow MetricThreshold semantics, with a named baseline."""

    metric: str = Field(description="Metric name (the task's metrics: schemas/tasks.py).")
    threshold: float | None = Field(
        default=None, description="Absolute bound: >= when higher is better, else <=."
    )
    min_absolute_change: float | None = Field(
        default=None,
        description="Candidate must beat the baseline by this much (negative = allowed loss).",
    )
    min_relative_change: float | None = Field(
        default=None, description="Same, as a fraction of the baseline (0.01 = 1 %)."
    )
    greater_is_better: bool = Field(description="Direction of the metric.")
    baseline: Literal["reference", "production"] = Field(
        default="production",
        description="What the change is measured against: the FP32 export (the graph parity "
        "and kvcheck proved equal to PyTorch, and quantize's reference) on the same inputs, "
        "or the release in the registry's production channel.",
    )

    @model_validator(mode="after")
    def _something(self) -> MetricThreshold:
        """Rule: A threshold gives threshold, min_absolute_change or min_relative_change."""
        if (self.threshold, self.min_absolute_change, self.min_relative_change) == (None,) * 3:
            raise ValueError("give threshold, min_absolute_change or min_relative_change")
        return self


class EvaluationConfig(Strict):
    dataset: EvalData = Field(description="The evaluation set (never the calibration set).")
    decode: DecodeConfig = Field(default_factory=DecodeConfig, description="Greedy decoding.")
    thresholds: list[MetricThreshold] = Field(
        default_factory=list, description="Gates on the metrics; all must hold."
    )
