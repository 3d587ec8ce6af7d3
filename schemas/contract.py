"""The accuracy contract: one definition of what quantization may cost a release.

The bounds are `quantization.budget` (or the task's default budget, schemas/tasks.py). Both
stages that judge accuracy read them from here:
- quantize accepts a recipe only when every bound holds with `quantization.margin` of room
  to spare, on the calibration probe and on held-out samples;
- evaluate applies the same bounds, without the margin, to the shipped model on the
  evaluation set.
So a recipe quantize accepts cannot fail evaluate on the same data (the margin is what
covers new data), and an evaluation threshold that judges the same kind of damage more
strictly than the budget, or judges damage the budget does not bound, is refused at
`shipyard validate` (`disagreements`), naming both fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from schemas.spec.quantization import AccuracyBudget
from schemas.tasks import TASKS

if TYPE_CHECKING:
    from schemas.spec.evaluation import MetricThreshold

# budget field -> (the metric it bounds, "min" or "max"): the one table both stages read
BUDGET_METRICS: dict[str, tuple[str, Literal["min", "max"]]] = {
    "top1_agreement_min": ("top1_agreement", "min"),
    "greedy_agreement_min": ("greedy_agreement", "min"),
    "logit_cosine_min": ("logit_cosine", "min"),
    "snr_db_min": ("snr_db", "min"),
    "perplexity_increase_max": ("perplexity_increase", "max"),
}
# an evaluation metric that measures the same damage as a budget bound (schemas/tasks.py
# METRIC_SOURCES: evaluate reads them from the same comparison)
SAME_AS_BUDGET = {
    "top1_agreement": "top1_agreement_min",
    "agreement": "top1_agreement_min",
    "cosine_to_reference": "logit_cosine_min",
    "snr_db": "snr_db_min",
}
# free-running generation against the reference's: damage no budget bound measures (the
# budget's greedy agreement is teacher-forced on FP32's generations)
UNBOUNDED_DAMAGE = ("greedy_exact_match", "greedy_token_match")


def budget_of(quantization: object, task: str) -> AccuracyBudget:
    """The contract's bounds: the spec's quantization.budget, else the task's default."""
    given = getattr(quantization, "budget", None)
    return given if given is not None else AccuracyBudget(**TASKS[task].default_budget)


def judged_by_evaluate(t: MetricThreshold) -> bool:
    """evaluate judges absolute bounds and changes against the reference; changes against
    production are the gate's."""
    return t.threshold is not None or t.baseline == "reference"


def disagreements(quantization: object, task: str, thresholds: list[MetricThreshold]) -> list[str]:
    """Each evaluation threshold evaluate would judge more strictly than the contract, or on
    damage the contract does not bound: a recipe quantize accepts could fail it. Empty when
    nothing is quantized (method none: there is no budget to disagree with)."""
    if getattr(quantization, "method", "none") == "none":
        return []
    budget = budget_of(quantization, task)
    found = []
    for i, t in enumerate(thresholds):
        if not judged_by_evaluate(t):
            continue
        where = f"evaluation.thresholds[{i}]"
        problem = _against(t, budget)
        if problem:
            found.append(f"{where}: {problem}")
    return found


def _against(t: MetricThreshold, budget: AccuracyBudget) -> str | None:
    drop = (
        "or drop this threshold (evaluate applies the budget itself) or judge it against production"
    )
    if t.metric in UNBOUNDED_DAMAGE:
        return (
            f"judges {t.metric} (free-running generation vs the reference), which no "
            "@quantization.budget bound measures: quantize could ship what evaluate refuses; "
            f"fix: bound greedy_agreement_min in quantization.budget instead, {drop}"
        )
    if t.metric in SAME_AS_BUDGET:
        field = f"@quantization.budget.{SAME_AS_BUDGET[t.metric]}"
        bound = getattr(budget, SAME_AS_BUDGET[t.metric])
        needs = _needed_min(t)
        if needs is None:
            return (
                f"judges {t.metric} in a form {field} cannot state; fix: use `threshold:`, {drop}"
            )
        if bound is None or needs > bound:
            has = "is not set" if bound is None else f"is {bound:g}"
            return (
                f"requires {t.metric} >= {needs:g} but {field} {has} (budget: "
                f"{_shown(budget)}): quantize could ship what evaluate refuses; fix: set "
                f"{field[1:]} to {needs:g}, {drop}"
            )
        return None
    if t.metric == "perplexity" and t.baseline == "reference" and t.threshold is None:
        field = "@quantization.budget.perplexity_increase_max"
        bound = budget.perplexity_increase_max
        if t.min_relative_change is None:
            return (
                f"judges perplexity by an absolute change, which {field} cannot state; fix: "
                f"use min_relative_change, {drop}"
            )
        allowed = 0.0 - t.min_relative_change  # never -0
        if bound is None or allowed < bound:
            has = "is not set" if bound is None else f"is {bound:g}"
            return (
                f"allows perplexity +{allowed:g} over the reference but {field} {has} (budget: "
                f"{_shown(budget)}): quantize could ship what evaluate refuses; fix: set "
                f"{field[1:]} to {max(allowed, 0):g}, {drop}"
            )
    return None  # absolute perplexity: the model's own quality, not what quantizing cost


def _needed_min(t: MetricThreshold) -> float | None:
    """The least value of an agreement-like metric (1 for the reference itself) that the
    threshold accepts; None where it cannot be said without measuring (an SNR change)."""
    if t.threshold is not None and t.baseline == "production":
        return t.threshold
    if t.metric == "snr_db" and t.threshold is None:
        return None
    bounds = [t.threshold] if t.threshold is not None else []
    if t.baseline == "reference":
        for change in (t.min_absolute_change, t.min_relative_change):
            if change is not None:
                bounds.append(1 + change)
    return max(bounds) if bounds else None


def _shown(budget: AccuracyBudget) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in budget.model_dump(exclude_none=True).items())
