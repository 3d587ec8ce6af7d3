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
    details = EvaluateDetails.model_validate(report.details)
    metrics = details.metrics
    # the task's metrics, and the metric of each bound of the contract (the spec's budget:
    # top1_agreement_min 0.98, perplexity_increase_max 0.01)
    assert set(metrics) == {
        "perplexity",
        "perplexity_reference",
        "top1_agreement",
        "greedy_exact_match",
        "greedy_token_match",
        "perplexity_increase",
    }
    assert metrics["perplexity"] == pytest.approx(metrics["perplexity_reference"], rel=0.01)
    assert metrics["perplexity_increase"] == pytest.approx(
        metrics["perplexity"] / metrics["perplexity_reference"] - 1
    )
    assert 0.95 < metrics["top1_agreement"] <= 1.0
    assert [(c.metric, c.ok) for c in details.contract] == [
        ("top1_agreement", True),
        ("perplexity_increase", True),
    ]


def _budget(spec: dict, **bounds: float) -> dict:
    return {**spec, "quantization": {**spec["quantization"], "budget": bounds}}


def test_evaluate_holds_the_shipped_model_to_the_quantization_budget(
    built_gpt2: Workspace,
) -> None:
    """One accuracy contract: the budget quantize judged by is what evaluate applies on the
    evaluation set (no threshold of its own needed); a bound just past the measured value
    fails the stage, naming the budget's field."""
    spec = gpt2_spec()
    spec["evaluation"]["thresholds"] = []
    first = built_gpt2.run("evaluate", spec)
    assert first.status.value == "passed", first.reasons
    measured = first.metrics["top1_agreement"]
    at = built_gpt2.run("evaluate", _budget(spec, top1_agreement_min=measured))
    assert at.status.value == "passed", at.reasons  # exactly at the bound holds
    past = built_gpt2.run("evaluate", _budget(spec, top1_agreement_min=measured + 1e-6))
    assert past.status.value == "failed"
    assert past.summary == "1 threshold(s) broken (1 of the accuracy contract, quantization.budget)"
    assert past.reasons[0] == (
        f"top1_agreement {measured:.4g} < quantization.budget.top1_agreement_min "
        f"{measured + 1e-6:g} on the evaluation set (the accuracy contract)"
    )


def test_evaluate_measures_greedy_agreement_as_quantize_does(built_gpt2: Workspace) -> None:
    """greedy_agreement_min in the budget: evaluate generates FP32's greedy text (the same
    prompts and lengths as quantize) and scores the shipped model teacher-forced on it."""
    from stages.quant import accuracy as acc

    spec = _budget(gpt2_spec(), greedy_agreement_min=0.5)
    spec["evaluation"]["thresholds"] = []
    report = built_gpt2.run("evaluate", spec)
    assert report.status.value == "passed", report.reasons
    value = report.metrics["greedy_agreement"]
    tokens = acc.GREEDY_PROMPTS * acc.GREEDY_TOKENS
    assert 0.5 <= value <= 1.0 and (value * tokens) == pytest.approx(round(value * tokens))
    strict = built_gpt2.run("evaluate", _budget(spec, greedy_agreement_min=min(1.0, value + 0.01)))
    assert (strict.status.value == "failed") is (value < 1.0)


def test_threshold_broken_vs_reference_fails_the_stage(built_gpt2: Workspace) -> None:
    spec = _budget(gpt2_spec(), top1_agreement_min=1.0, perplexity_increase_max=0.01)
    spec["evaluation"]["thresholds"] = [
        {
            "metric": "top1_agreement",
            "min_absolute_change": 0.0,
            "greater_is_better": True,
            "baseline": "reference",
        }
    ]  # must equal the FP32 reference exactly: INT8 cannot (nor can the budget, the same)
    report = built_gpt2.run("evaluate", spec)
    assert report.status.value == "failed"
    # the contract's bound first, then the threshold's own verdict
    assert report.reasons[0].startswith("top1_agreement 0.99")
    assert "< quantization.budget.top1_agreement_min 1" in report.reasons[0]
    assert report.reasons[1].startswith("top1_agreement 0.99")
    assert "vs reference 1: needs >= 1 (min_absolute_change 0)" in report.reasons[1]
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
    assert check(rule(**kw), {"m": value}, baseline).ok is ok


def test_a_threshold_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="give threshold, min_absolute_change"):
        rule(greater_is_better=True)


def test_the_shipped_graph_decodes_its_prompts_as_one_batch_and_as_one_at_a_time(
    built_gpt2: Workspace, tmp_path: object
) -> None:
    """Its rows are independent (per-token INT8, padding-proof attention), so evaluate
    decodes every prompt in one batch: the same tokens as one prompt a call, whatever
    lengths the prompts have. A graph with per-call INT8 scales is decoded one at a time."""
    from pathlib import Path

    import numpy as np
    import onnxruntime as ort
    from onnxruntime.quantization import quantize_dynamic

    from schemas.artifacts import ModelInfo
    from stages import evaluate
    from stages.onnx import model as m

    shipped = built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    export = built_gpt2.out("tiny-gpt2", "export") / "model.onnx"
    assert evaluate.rows_independent(shipped)
    per_call = Path(str(tmp_path)) / "per_call.onnx"
    quantize_dynamic(export, per_call, op_types_to_quantize=["MatMul"])
    assert not evaluate.rows_independent(per_call)
    info = ModelInfo.model_validate_json(
        (built_gpt2.out("tiny-gpt2", "export") / ModelInfo.FILE).read_text()
    )
    lay = m.layout_from_info(info)
    session = ort.InferenceSession(str(shipped), providers=["CPUExecutionProvider"])
    names = [t.name for t in lay.outputs]
    run = lambda feeds: session.run(names, feeds)  # noqa: E731
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).astype(np.int64) for n in (3, 8, 5, 8, 1, 7)]
    together = evaluate.greedy(run, lay, prompts, 12)
    alone = [evaluate.greedy(run, lay, [p], 12)[0] for p in prompts]
    assert together == alone
