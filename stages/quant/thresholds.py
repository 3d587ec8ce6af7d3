"""MLflow MetricThreshold semantics, shared by the evaluate stage (absolute bounds and the
reference baseline) and the gate (the production baseline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.details import ThresholdResult

if TYPE_CHECKING:
    from schemas.spec.evaluation import MetricThreshold


def check(
    t: MetricThreshold, metrics: dict[str, float], baseline: float | None, absolute: bool = True
) -> ThresholdResult:
    """MLflow MetricThreshold semantics: an absolute bound (when `absolute`) and the
    min absolute / relative change vs `baseline` (when given). The verdict is read by field
    (evaluate's failures, the gate's rows) and written as is into evaluate's report."""
    value, up = metrics[t.metric], t.greater_is_better
    problems = []
    if (
        absolute
        and t.threshold is not None
        and (value < t.threshold if up else value > t.threshold)
    ):
        problems.append(f"{value:.4g} {'<' if up else '>'} threshold {t.threshold:g}")
    for kind, change in (("absolute", t.min_absolute_change), ("relative", t.min_relative_change)):
        if change is None or baseline is None:
            continue
        delta = change if kind == "absolute" else change * abs(baseline)
        bound = baseline + delta if up else baseline - delta
        if value < bound if up else value > bound:
            problems.append(
                f"needs {'>=' if up else '<='} {bound:.4g} (min_{kind}_change {change:g})"
            )
    shown = f"{value:.4g}" + (f" vs {t.baseline} {baseline:.4g}" if baseline is not None else "")
    return ThresholdResult(
        metric=t.metric,
        baseline=t.baseline,
        value=value,
        baseline_value=baseline,
        ok=not problems,
        message=f"{t.metric} {shown}: " + ("; ".join(problems) or "holds"),
    )


def has_change(t: MetricThreshold) -> bool:
    return t.min_absolute_change is not None or t.min_relative_change is not None
