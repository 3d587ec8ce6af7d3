from __future__ import annotations

import json

import pytest

from schemas.details import EvaluateDetails
from schemas.release import MetricThreshold
from stages.evaluate import check
from tests.conftest import Workspace, gpt2_spec


def test_evaluate_reports_task_metrics_and_decodes_with_the_cache(built_gpt2: Workspace) -> None:
    report = built_gpt2.run("evaluate", gpt2_spec())
    assert report.status.value == "passed", report.reasons
    metrics = EvaluateDetails.model_validate(report.details).metrics
    assert set(metrics) == {
        "perplexity",
        "perplexity_reference",
        "top1_agreement",
        "greedy_exact_match",
        "greedy_token_match",
    }
    assert metrics["perplexity"] == pytest.approx(metrics["perplexity_reference"], rel=0.01)
    assert 0.95 < metrics["top1_agreement"] <= 1.0


def test_threshold_broken_vs_reference_fails_the_stage(built_gpt2: Workspace) -> None:
    spec = gpt2_spec()
    spec["evaluation"]["thresholds"] = [
        {
            "metric": "top1_agreement",
            "min_absolute_change": 0.0,
            "greater_is_better": True,
            "baseline": "reference",
        }
    ]  # must equal the FP32 reference exactly: INT8 cannot
    report = built_gpt2.run("evaluate", spec)
    assert report.status.value == "failed"
    assert report.reasons[0].startswith("top1_agreement 0.99")
    assert "vs reference 1: needs >= 1 (min_absolute_change 0)" in report.reasons[0]
    # the evidence: every sample's own agreement, worst first, its mean the failed metric
    kept = built_gpt2.root / "build" / "tiny-gpt2" / "failed" / "evaluate"
    assert "kept in build/tiny-gpt2/failed/evaluate/" in report.reasons[-1]
    rows = [json.loads(x) for x in (kept / "failed_samples.jsonl").read_text().splitlines()]
    details = EvaluateDetails.model_validate(report.details)
    assert sorted(r["sample"] for r in rows) == list(range(details.samples))
    assert [t.ok for t in details.thresholds] == [False]
    top1 = [r["top1_agreement"] for r in rows]
    assert top1 == sorted(top1) and top1[0] < 1.0
    # each sample weighs by its tokens in the metric; equal-length samples: the plain mean
    assert min(top1) <= report.metrics["top1_agreement"] <= max(top1)


def rule(**kw: object) -> MetricThreshold:
    return MetricThreshold(metric="m", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw,value,baseline,ok",
    [
        ({"threshold": 0.9, "greater_is_better": True}, 0.91, None, True),
        ({"threshold": 0.9, "greater_is_better": True}, 0.89, None, False),
        ({"threshold": 10.0, "greater_is_better": False}, 11.0, None, False),
        ({"min_absolute_change": 0.0, "greater_is_better": True}, 0.80, 0.81, False),
        ({"min_absolute_change": -0.02, "greater_is_better": True}, 0.80, 0.81, True),
        ({"min_relative_change": -0.01, "greater_is_better": False}, 100.9, 100.0, True),
        ({"min_relative_change": -0.01, "greater_is_better": False}, 101.1, 100.0, False),
        ({"min_relative_change": 0.05, "greater_is_better": True}, 1.04, 1.0, False),
    ],
)
def test_mlflow_threshold_semantics(
    kw: dict, value: float, baseline: float | None, ok: bool
) -> None:
    assert check(rule(**kw), {"m": value}, baseline)["ok"] is ok


def test_a_threshold_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="give threshold, min_absolute_change"):
        rule(greater_is_better=True)
