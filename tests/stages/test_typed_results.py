"""Issue 44: the comparator's rows, the thresholds' verdicts and the export's probe runs
travel typed (schemas/details.py: Compared and the rows placed from it, ThresholdResult,
Probed), read by field. The reports the stages write from them stay byte for byte what the
dict code wrote: each case writes the details as the stage does now and as the dict code
did (the dict validated through the same details model, `write_json`), and compares the
files. None of the types can be indexed as the dicts were."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel

from schemas.details import (
    Compared,
    EvaluateDetails,
    ExportDetails,
    KvcheckDetails,
    KvComparison,
    KvPlan,
    LayerComparison,
    Layerwise,
    ParityDetails,
    Probed,
    ShapeComparison,
    ShippedKv,
    ThresholdResult,
)
from schemas.spec.evaluation import MetricThreshold
from schemas.spec.parity import ParityConfig, Tolerance
from schemas.spec.quantization import AccuracyBudget
from stages._contract import write_json
from stages.onnx import kvcache as kv
from stages.onnx.compare import OutputCompared, compare, compare_outputs, placed
from stages.onnx.layerwise import _row as layer_row


def same_file(tmp_path: Path, now: dict[str, Any], before: dict[str, Any]) -> None:
    """Both written as the runner writes a report's details: identical bytes."""
    write_json(tmp_path / "now.json", now)
    write_json(tmp_path / "before.json", before)
    assert (tmp_path / "now.json").read_bytes() == (tmp_path / "before.json").read_bytes()


def unindexable(row: BaseModel, *keys: str) -> None:
    assert not hasattr(type(row), "__getitem__")
    assert not hasattr(row, "get")
    for key in keys:
        with pytest.raises(TypeError, match="not subscriptable"):
            row[key]  # type: ignore[index]


CFG = ParityConfig()
EXACT = Tolerance(atol=0.25, rtol=0.0, scale="none")  # normalized error 1.0 at |diff| 0.25
RMS = Tolerance(atol=0.125, rtol=0.0)  # a reference of RMS 4: atol 0.5, error 1.0 at 0.5


# ------------------------------------------------------------------------ the comparator
# (ref, out, tol) -> what compare() returned as a dict before
COMPARISONS = [
    (np.zeros(4), np.full(4, 0.25), EXACT, {"ok": True, "error": 1.0, "max_abs": 0.25}),
    (
        np.full(4, 4.0),
        np.full(4, 4.5),
        RMS,
        {"ok": True, "error": 1.0, "max_abs": 0.5, "atol_scale": 4.0},
    ),
    (
        np.ones((2, 3)),
        np.ones((3, 2)),
        EXACT,
        {
            "ok": False,
            "error": math.inf,
            "max_abs": math.inf,
            "note": "shape [3, 2] != reference [2, 3]",
        },
    ),
    (
        np.zeros(2),
        np.array([0.0, np.nan]),
        EXACT,
        {"ok": False, "error": math.inf, "max_abs": math.inf},
    ),
    (np.zeros((2, 0)), np.zeros((2, 0)), EXACT, {"ok": True, "error": 0.0, "max_abs": 0.0}),
]


@pytest.mark.parametrize(("ref", "out", "tol", "before"), COMPARISONS)
def test_compared_dumps_what_the_dict_was_and_parity_writes_the_same_report(
    tmp_path: Path, ref: np.ndarray, out: np.ndarray, tol: Tolerance, before: dict[str, Any]
) -> None:
    result = compare(ref, out, tol, CFG)
    assert isinstance(result, Compared) and result.dump() == before
    unindexable(result, "ok", "error")
    where = {"shape": "min", "sizes": {"batch": 1, "sequence": 3}, "output": "logits"}
    row = placed(ShapeComparison, result, **where)
    assert (row.ok, row.error, row.output) == (before["ok"], before["error"], "logits")
    same_file(
        tmp_path,
        ParityDetails(comparisons=[row]).dump(),
        ParityDetails.model_validate({"comparisons": [{**where, **before}]}).dump(),
    )


def test_compare_outputs_rows_are_typed_and_name_their_output() -> None:
    want = {"a": np.zeros(4), "b": np.zeros(2)}
    rows = compare_outputs(want, {"a": np.full(4, 0.25)}, ParityConfig(tolerance=EXACT))
    assert all(isinstance(r, OutputCompared) for r in rows)
    assert [r.dump() for r in rows] == [
        {"output": "a", "ok": True, "error": 1.0, "max_abs": 0.25},
        {
            "output": "b",
            "ok": False,
            "error": math.inf,
            "max_abs": math.inf,
            "note": "missing from the outputs",
        },
    ]
    unindexable(rows[0], "ok", "error", "output")


def test_a_frozen_row_cannot_be_edited_in_place() -> None:
    from pydantic import ValidationError

    row = compare(np.zeros(2), np.zeros(2), EXACT, CFG)
    with pytest.raises(ValidationError, match="frozen"):
        row.ok = False  # type: ignore[misc]


# ------------------------------------------------------------------------- layer by layer
def test_layerwise_rows_write_the_report_the_dicts_wrote(tmp_path: Path) -> None:
    cfg = ParityConfig(tolerance=EXACT)
    good = layer_row("h.0", "/h.0/Add_output_0", np.zeros(4), np.full(4, 0.25), cfg)
    bad = layer_row("h.1[0]", "/h.1/Mul_output_0", np.zeros(4), np.full(4, 0.5), cfg)
    assert isinstance(good, LayerComparison) and (bad.module, bad.ok) == ("h.1[0]", False)
    unindexable(bad, "ok", "error", "tensor")
    now = Layerwise(compared=2, first_divergent=bad, layers=[good, bad])
    before_rows = [
        {"module": "h.0", "tensor": "/h.0/Add_output_0", "ok": True, "error": 1.0, "max_abs": 0.25},
        {
            "module": "h.1[0]",
            "tensor": "/h.1/Mul_output_0",
            "ok": False,
            "error": 2.0,
            "max_abs": 0.5,
        },
    ]
    shape = {"shape": "odd", "sizes": {"batch": 3}, "output": "logits"}
    row = {**shape, "ok": False, "error": 2.0, "max_abs": 0.5}
    same_file(
        tmp_path,
        ParityDetails(
            comparisons=[
                placed(ShapeComparison, Compared(ok=False, error=2.0, max_abs=0.5), **shape)
            ],
            layerwise=now,
        ).dump(),
        ParityDetails.model_validate(
            {
                "comparisons": [row],
                "layerwise": {
                    "compared": 2,
                    "first_divergent": before_rows[1],
                    "layers": before_rows,
                },
            }
        ).dump(),
    )
    clean = Layerwise(compared=1, first_divergent=None, layers=[good])
    assert clean.dump() == {"compared": 1, "first_divergent": None, "layers": before_rows[:1]}


# -------------------------------------------------------------------------------- kvcheck
def _kv_rows() -> tuple[list[KvComparison], list[dict[str, Any]]]:
    """kv.judge on a present that one quantizer step moved (excused as rounding with the
    FP32 pass at hand) and on exact logits; and the dicts the dict code built from the same
    comparisons: {probe, past, output, position, **compare(), ok: True, rounding: share}."""
    rng = np.random.default_rng(0)
    fp32 = {
        "logits": rng.standard_normal((1, 50)).astype(np.float32),
        "present.0.key": rng.standard_normal((1, 2, 40, 8)).astype(np.float32),
    }
    quant = {
        k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in fp32.items()
    }
    key = quant["present.0.key"].copy()
    key[0, 1, 20, :] += 0.004
    key[0, :, 21:, :] += 2e-4 * np.sign(key[0, :, 21:, :])
    probe = kv.Probe("step 0", 39, 39, {"logits": quant["logits"][:, None], "present.0.key": key})
    tol = CFG.tolerance
    rows = kv.judge(probe, quant, tol, CFG, fp32)
    moved = compare(quant["present.0.key"], key, tol, CFG).dump()
    share = kv.rounding_share(key, quant["present.0.key"], fp32["present.0.key"])
    before = [
        {"probe": "step 0", "past": 39, "output": "logits", "position": 39, "ok": True}
        | {"error": 0.0, "max_abs": 0.0},
        {"probe": "step 0", "past": 39, "output": "present.0.key", "position": 20}
        | {**moved, "ok": True, "rounding": share},
    ]
    assert moved["ok"] is False and 0 < share <= kv.ROUNDING_SHARE
    return rows, before


def test_kvcheck_rows_write_the_report_the_dicts_wrote(tmp_path: Path) -> None:
    rows, before = _kv_rows()
    assert [r.dump() for r in rows] == before
    assert rows[1].rounding is not None and rows[0].rounding is None
    unindexable(rows[1], "ok", "error", "rounding", "position")
    plan = {
        "prompt": 6,
        "steps": 2,
        "past_lengths": [6, 9],
        "prefill_chunk": 8,
        "padded": [5, 2, 2],
        "full_pass_lengths": [7, 8],
    }
    same_file(
        tmp_path,
        KvcheckDetails(
            plan=KvPlan(
                prompt=6,
                steps=2,
                past_lengths=[6, 9],
                prefill_chunk=8,
                padded=list((5, 2, 2)),
                full_pass_lengths=[7, 8],
            ),
            pytorch=rows,
            onnx=rows[:1],
            shipped=ShippedKv(graph="quantize", rows=[]),
        ).dump(),
        KvcheckDetails.model_validate(
            {
                "plan": {**plan, "padded": (5, 2, 2)},  # a tuple, as kv.Plan holds it
                "pytorch": before,
                "onnx": before[:1],
                "shipped": {"graph": "quantize", "rows": []},
            }
        ).dump(),
    )


def test_kv_reasons_read_the_typed_rows() -> None:
    rows, _ = _kv_rows()
    assert kv.reasons("ONNX Runtime", rows) == []  # the rounding is excused
    failed = placed(
        KvComparison,
        Compared(ok=False, error=3.0, max_abs=0.5),
        probe="past 48",
        past=48,
        output="present.1.value",
        position=7,
    )
    [reason] = kv.reasons("PyTorch", [*rows, failed, failed])
    assert reason == (
        "PyTorch: cached decode at past 48: present.1.value at position 7 differs from a full "
        "recompute: normalized error 3 > 1 (max |diff| 0.5); 1 more comparison(s) out of "
        "tolerance"
    )


# ----------------------------------------------------------------------------- thresholds
def test_threshold_results_write_the_report_the_dicts_wrote(tmp_path: Path) -> None:
    from stages.evaluate import contract_results
    from stages.quant.thresholds import check

    rule = MetricThreshold(
        metric="top1_agreement",
        min_absolute_change=0.0,
        greater_is_better=True,
        baseline="reference",
    )
    bound = MetricThreshold(metric="perplexity", threshold=600.0, greater_is_better=False)
    judged = [
        check(rule, {"top1_agreement": 0.8}, 1.0),
        check(bound, {"perplexity": 513.9384573530025}, None),
    ]
    before = [
        {
            "metric": "top1_agreement",
            "baseline": "reference",
            "value": 0.8,
            "baseline_value": 1.0,
            "ok": False,
            "message": "top1_agreement 0.8 vs reference 1: needs >= 1 (min_absolute_change 0)",
        },
        {
            "metric": "perplexity",
            "baseline": "production",
            "value": 513.9384573530025,
            "baseline_value": None,
            "ok": True,
            "message": "perplexity 513.9: holds",
        },
    ]
    assert all(isinstance(r, ThresholdResult) for r in judged)
    assert [r.dump() for r in judged] == before
    unindexable(judged[0], "ok", "message")

    budget = AccuracyBudget(top1_agreement_min=0.98, perplexity_increase_max=0.01)
    measured = {"top1_agreement": 0.99185667752443, "perplexity_increase": 0.02}
    contract = contract_results(budget, measured)
    before_contract = [
        {
            "metric": "top1_agreement",
            "baseline": "reference",
            "value": 0.99185667752443,
            "baseline_value": None,
            "ok": True,
            "message": "top1_agreement 0.9919 >= quantization.budget.top1_agreement_min 0.98",
        },
        {
            "metric": "perplexity_increase",
            "baseline": "reference",
            "value": 0.02,
            "baseline_value": None,
            "ok": False,
            "message": "perplexity_increase 0.02 > quantization.budget.perplexity_increase_max "
            "0.01 on the evaluation set (the accuracy contract)",
        },
    ]
    assert [r.dump() for r in contract] == before_contract
    metrics = {"top1_agreement": 0.99185667752443, "perplexity": 513.9384573530025}
    same_file(
        tmp_path,
        EvaluateDetails(metrics=metrics, contract=contract, thresholds=judged, samples=64).dump(),
        EvaluateDetails.model_validate(
            {
                "metrics": metrics,
                "contract": before_contract,
                "thresholds": before,
                "samples": 64,
            }
        ).dump(),
    )


# ------------------------------------------------------------------------ export's probes
def test_probe_runs_write_the_report_the_dicts_wrote(tmp_path: Path) -> None:
    from stages.onnx.exporter import Probes

    runs = [
        Probed(shape="all min", sizes={"batch": 1, "sequence": 1}, ok=True),
        Probed(shape="only batch=4", sizes={"batch": 4, "sequence": 8}, ok=False),
    ]
    found = Probes(runs, ["graph fails at only batch=4 {'batch': 4, 'sequence': 8}"])
    before = [
        {"shape": "all min", "sizes": {"batch": 1, "sequence": 1}, "ok": True},
        {"shape": "only batch=4", "sizes": {"batch": 4, "sequence": 8}, "ok": False},
    ]
    assert [r.dump() for r in found.runs] == before
    unindexable(found.runs[1], "ok", "shape")
    assert not hasattr(Probes, "__getitem__")
    common = {"trace_sizes": {"batch": 2, "sequence": 4}, "model_files": ["model.onnx"]}
    same_file(
        tmp_path,
        ExportDetails(probed=found.runs, **common).dump(),
        ExportDetails.model_validate({**common, "probed": before}).dump(),
    )


def test_the_engine_build_rows_read_back_what_the_dict_rows_wrote() -> None:
    """EngineBuild's TensorRT parity and CUDA-graph rows are typed: the JSON the stage
    wrote as dicts reads back field for field and dumps to the same bytes; an unknown key
    or a dict-style read fails."""
    from schemas.artifacts import CudaGraphRow, EngineBuild, EngineParityRow

    old = {
        "tensorrt": "10.9",
        "gpu": "H100",
        "compute_capability": "9.0",
        "plan": "serving/triton/r-trt/1/model_sm90.plan",
        "parity": [{"profile": "p0", "shape": "opt", "ok": True, "why": "profile p0 opt: ok"}],
        "cuda_graphs": [
            {
                "batch": 4,
                "ok": False,
                "plain_ms": 1.5,
                "graph_ms": 1.0,
                "speedup": 1.5,
                "why": "batch 4: graph replay DIFFERS",
            }
        ],
    }
    build = EngineBuild.model_validate(old)
    assert isinstance(build.parity[0], EngineParityRow) and build.parity[0].ok
    assert isinstance(build.cuda_graphs[0], CudaGraphRow) and build.cuda_graphs[0].batch == 4
    assert build.model_dump() == old
    with pytest.raises(TypeError):
        build.parity[0]["ok"]  # type: ignore[index]
    with pytest.raises(ValueError):
        EngineParityRow.model_validate({**old["parity"][0], "extra": 1})  # type: ignore[dict-item]
