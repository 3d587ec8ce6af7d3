"""The load test's results (`loadtest.json`) and headline, typed (schemas/loadresults.py):
a misspelled or mistyped field is refused where it is read, what was not measured stays out
of the file, and the columns other code picks by name are fields of the models."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from schemas.loadresults import (
    WINDOW_METRICS,
    Batching,
    GridPoint,
    Headline,
    LoadTestResults,
    Point,
    Window,
    WindowMetrics,
)
from stages.loadtest import RAMP_COLUMNS, STREAM_COLUMNS

WINDOW = {
    "requests": 9,
    "errors": 0,
    "seconds": 1.0,
    "throughput_rps": 9.0,
    "rows_per_s": 9.0,
    "tokens_per_s": 36.0,
    "p50_latency_ms": 4.0,
    "p90_latency_ms": 5.0,
    "p95_latency_ms": 5.5,
    "p99_latency_ms": 6.0,
}
METRICS = {k: [1.0, 1.0, 1.0] for k in WINDOW_METRICS}
POINT = {
    **WINDOW,
    "concurrency": 2,
    "windows": 3,
    "stable": True,
    "window_throughput": [9.0, 9.0, 9.0],
    "window_metrics": METRICS,
}


def test_a_misspelled_or_mistyped_field_is_refused_naming_it() -> None:
    typo = {**{k: v for k, v in POINT.items() if k != "p95_latency_ms"}, "p95_latency": 5.5}
    with pytest.raises(ValidationError) as exc:
        Point.model_validate(typo)
    problems = {".".join(map(str, e["loc"])): e["type"] for e in exc.value.errors()}
    assert problems == {"p95_latency_ms": "missing", "p95_latency": "extra_forbidden"}
    with pytest.raises(ValidationError, match="stable"):
        Point.model_validate({**POINT, "stable": "maybe"})
    with pytest.raises(ValidationError, match="window_metrics.p95_ttft_ms"):
        Point.model_validate({**POINT, "window_metrics": {**METRICS, "p95_ttft_ms": "fast"}})


def test_what_was_not_measured_stays_out_and_a_known_none_stays_in() -> None:
    """TTFT, inter-token latency, the first error and the SLO break appear only when they
    happened; an input length of None (no sequence axis) and a ratio of None are said."""
    point = Point.model_validate(POINT)
    dumped = point.model_dump()
    for absent in ("p50_ttft_ms", "p95_ttft_ms", "p50_itl_ms", "p95_itl_ms", "first_error"):
        assert absent not in dumped
    assert "breaks_slo" not in dumped
    broke = point.model_copy(update={"breaks_slo": True, "first_error": "HTTP 500"})
    assert broke.model_dump()["breaks_slo"] is True
    assert broke.model_dump()["first_error"] == "HTTP 500"
    grid = GridPoint.model_validate({**WINDOW, "batch": 1, "input_length": None})
    assert grid.model_dump()["input_length"] is None
    off = Batching(concurrency=2, on_rps=9.0, off_rps=0.0, ratio=None, off=point)
    assert off.model_dump()["ratio"] is None


def test_results_survive_a_round_trip_through_the_file() -> None:
    point = Point.model_validate(POINT)
    ramp = {"points": [point], "knee": 2, "knee_point": point, "judged_at": 2}
    results = LoadTestResults.model_validate(
        {
            "target": "local MLServer",
            "grid": [],
            "ramp": ramp,
            "soak": {"skipped": "loadtest.soak.seconds is 0"},
            "peak_rss_bytes": 0,
            "batching": {"skipped": "loadtest.batching_comparison is false"},
            "slo": [],
        }
    )
    text = json.dumps(results.model_dump(mode="json"), sort_keys=True)
    assert LoadTestResults.model_validate_json(text) == results
    assert "streaming" not in json.loads(text)  # no streaming ramp was measured
    with pytest.raises(ValidationError, match="soak"):  # neither a soak nor a skip
        LoadTestResults.model_validate({**json.loads(text), "soak": {"seconds": 1.0}})


def test_the_columns_picked_by_name_are_fields() -> None:
    assert set(RAMP_COLUMNS) <= set(Point.model_fields)
    assert set(STREAM_COLUMNS) <= set(Point.model_fields)
    assert set(WINDOW_METRICS) == set(WindowMetrics.model_fields) <= set(Window.model_fields)


def test_the_headline_metrics_are_its_numbers() -> None:
    head = Headline(
        target="local MLServer",
        knee_concurrency=4,
        knee_throughput_rps=50.0,
        knee_p95_latency_ms=None,
        knee_stable=True,
        slo_judged_at_concurrency=4,
        peak_rss_mb=177.2,
    )
    assert head.metrics() == {
        "knee_concurrency": 4,
        "knee_throughput_rps": 50.0,
        "knee_stable": True,
        "slo_judged_at_concurrency": 4,
        "peak_rss_mb": 177.2,
    }
