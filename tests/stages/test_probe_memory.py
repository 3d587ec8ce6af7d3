"""Probes fit in memory (issue 40 part 4): export's shapes and parity's corners lower only
their batch until one forward pass's activations fit the probe budget, say so, and still
prove every dim at its extreme."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import StageReport
from schemas.details import ExportDetails, ParityDetails
from stages.onnx import shapes as sh
from tests.conftest import Workspace, gpt2_spec

LAY = sh.Layout(
    inputs=(
        sh.Tensor("input_ids", "int64", ("batch", "sequence")),
        sh.Tensor("past_key_values.0.key", "float32", ("batch", 2, "past_sequence", 8)),
    ),
    outputs=(
        sh.Tensor("logits", "float32", ("batch", "sequence", 1000)),
        sh.Tensor("present.0.key", "float32", ("batch", 2, sh.TOTAL, 8)),
    ),
)


def cost(s: Mapping[str, int]) -> int:
    return sh.run_bytes(LAY, s, hidden=16, heads=2)


def test_run_bytes_counts_outputs_buffers_and_one_layers_scores() -> None:
    s = {"batch": 2, "sequence": 5, "past_sequence": 3}
    logits, present = 2 * 5 * 1000 * 4, 2 * 2 * 8 * 8 * 4
    assert cost(s) == logits + present + 2 * 5 * (8 * 16 + 2 * 8) * 4


@settings(max_examples=200, deadline=None)
@given(
    low=st.integers(1, 4),
    extra=st.integers(0, 60),
    seq=st.integers(1, 300),
    past=st.integers(0, 300),
    budget=st.integers(0, 10**8),
)
def test_the_batch_is_the_largest_that_fits_and_never_below_its_min(
    low: int, extra: int, seq: int, past: int, budget: int
) -> None:
    dims = {
        "batch": {"min": low, "opt": low, "max": low + extra},
        "sequence": {"min": 1, "opt": 1, "max": 300},
        "past_sequence": {"min": 0, "opt": 0, "max": 300},
    }
    sizes = {"batch": low + extra, "sequence": seq, "past_sequence": past}
    got = sh.within_budget(sizes, dims, cost, budget)
    assert {k: v for k, v in got.items() if k != "batch"} == {
        "sequence": seq,
        "past_sequence": past,
    }
    assert low <= got["batch"] <= sizes["batch"]
    assert cost(got) <= budget or got["batch"] == low
    if got["batch"] < sizes["batch"]:  # one more row would not have fit
        assert cost({**got, "batch": got["batch"] + 1}) > budget


def test_the_floor_keeps_small_models_probing_at_their_full_batch() -> None:
    assert sh.probe_budget(1000) == sh.PROBE_FLOOR
    assert sh.probe_budget(5 << 30) == 5 << 30


def _budget_for(batch: int) -> int:
    """The budget at which tiny-gpt2's all-max corner (gpt2_spec dims) fits exactly `batch`
    rows: its own estimate, read from the exported layout's arithmetic."""
    spec = gpt2_spec()
    d = spec["export"]["dims"]
    lay = sh.Layout(
        inputs=(),
        outputs=(
            sh.Tensor("logits", "float32", ("batch", "sequence", 512)),
            *(
                sh.Tensor(f"present.{i}.{k}", "float32", ("batch", 4, sh.TOTAL, 16))
                for i in range(2)
                for k in ("key", "value")
            ),
        ),
    )
    sizes = {
        "batch": batch,
        "sequence": d["sequence"]["max"],
        "past_sequence": d["past_sequence"]["max"],
    }
    return sh.run_bytes(lay, sizes, hidden=64, heads=4)


@pytest.mark.parametrize("fits,expected", [(2, 2), (1, 1)])
def test_export_and_parity_run_the_max_corner_at_the_batch_that_fits(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, fits: int, expected: int
) -> None:
    """At exactly the estimate of 2 rows the corner runs 2 rows (the boundary passes); the
    budget of 1 row runs 1. batch.max (3) is still probed."""
    budget = _budget_for(fits)
    monkeypatch.setattr(sh, "probe_budget", lambda weights: budget)
    spec = gpt2_spec()
    for stage in ("pin", "export"):
        assert ws.run(stage, spec).status.value == "passed"
    details = ExportDetails.model_validate(
        StageReport.model_validate_json(
            (ws.out("tiny-gpt2", "export") / "report.json").read_text()
        ).details
    )
    probed = {r.shape: r.sizes for r in details.probed}
    label = f"all max, batch {expected} (probe memory)"
    assert probed[label] == {"batch": expected, "sequence": 64, "past_sequence": 24}
    assert "all max" not in probed
    # batch.max (3) ran at a corner the budget did not lower (the odd one), or alone
    assert any(sizes["batch"] == 3 for sizes in probed.values())
    assert probed["all min"] == {"batch": 1, "sequence": 1, "past_sequence": 0}
    report = ws.run("parity", spec)
    assert report.status.value == "passed", report.reasons
    shapes = {c.shape: c.sizes for c in ParityDetails.model_validate(report.details).comparisons}
    assert shapes[f"max, batch {expected} (probe memory)"]["batch"] == expected
    assert "max" not in shapes and shapes["min"]["batch"] == 1


def test_named_parity_shapes_run_as_named(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sh, "probe_budget", lambda weights: 0)
    spec = gpt2_spec()
    spec["parity"] = {**(spec.get("parity") or {}), "shapes": [{"batch": 3, "sequence": 64}]}
    for stage in ("pin", "export"):
        assert ws.run(stage, spec).status.value == "passed"
    report = ws.run("parity", spec)
    assert report.status.value == "passed", report.reasons
    sizes = [c.sizes for c in ParityDetails.model_validate(report.details).comparisons]
    assert all(s["batch"] == 3 and s["sequence"] == 64 for s in sizes)
