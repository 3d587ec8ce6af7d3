"""The quantize search's typed rows (schemas/quantsearch.py): a row with a misspelled,
missing or mistyped field is refused where it is made, naming the field; and the models
write exactly the report the stage wrote when its rows were dicts (absent is not null,
an int stays an int)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError

from schemas.artifacts import QuantInfo
from schemas.quantsearch import (
    FileSize,
    PerNodeDetails,
    RecipeRow,
    RecipeSearchDetails,
    RecipeTrial,
    SelectionRow,
    SensitivityRow,
)
from schemas.spec.quantization import AccuracyBudget

METRICS = {
    "top1_agreement": 0.9963898916967509,
    "logit_cosine": 0.9998696614024715,
    "snr_db": 35.83623221511401,
    "perplexity_fp32": 522.2079213061809,
    "perplexity": 522.159643020451,
    "perplexity_increase": -9.24503129120513e-05,
}
CALIBRATION = {
    "path": "data/calibration/docstrings.jsonl",
    "sha256": "3923a695c28700e53460bf1c1e6661acc2ec53146aa91ca48ac3eab2c929e315",
    "samples": 48,
    "holdout": 16,
}
LAYER = {
    "module": "transformer.wpe",
    "tensor": "/model/transformer/wpe/Gather_output_0",
    "snr_db": 200.0,
    "worst_channel_snr_db": 200.0,
}
SIZE = {"bytes": 522911, "fp32_bytes": 674869, "ratio": 0.7748333380256021}
# an explicit method's details as the stage wrote them (a quantize report, shortened): a
# node measured alone, one ranked in one pass (no end-to-end metrics, no greedy agreement
# unless the budget bounds it), the selection trace
PER_NODE: dict[str, Any] = {
    "calibration": CALIBRATION,
    "sensitivity": [
        {"node": "/model/lm_head/MatMul", "module": "lm_head", "measured": "alone", **METRICS},
        {
            "node": "/model/h.0/mlp/c_fc/Gemm",
            "module": "transformer.h.0.mlp.c_fc",
            "measured": "one pass",
            "local_snr_db": 31.5,
        },
    ],
    "selection": [
        {"float_nodes": 0, **METRICS, "greedy_agreement": 1.0, "meets_budget": False},
        {"float_nodes": 1, **METRICS, "greedy_agreement": 1.0, "meets_budget": True},
    ],
    "holdout": METRICS,
    "float_nodes": ["/model/lm_head/MatMul"],
    "layerwise": [LAYER],
    "preprocess": "quant_pre_process with symbolic shape inference",
    "budget": {"greedy_agreement_min": 0.5, "snr_db_min": 39.0},
    "size": SIZE,
}
ROW: dict[str, Any] = {
    "recipe": "int8-dynamic",
    "method": "int8-dynamic",
    "float_classes": [],
    "size_ratio": 0.0,
    "speedup": None,
    "speed_decided_by": None,
    "speedups": {},
    "speed": {},
    "calibration": {},
    "holdout": {},
    "chosen": False,
    "why": "not tried: int8-dynamic-per-channel missed the accuracy budget",
}
# method auto's details: an untimed row keeps `speedup: null`; FP32's bytes stay an int
SEARCH: dict[str, Any] = {
    "calibration": CALIBRATION,
    "recipes": [
        ROW,
        {
            **ROW,
            "recipe": "int4-weight-only",
            "method": "int4-weight-only",
            "size_ratio": 0.5425,
            "speedup": 0.625,
            "speed_decided_by": "timing",
            "speedups": {"decode_batch_1": 0.625, "decode_batch_8": 0.75},
            "speed": {
                "decode_batch_1": {
                    "ratio": 0.625,
                    "interval": [0.6, 0.7],
                    "predicted": 0.9,
                    "decided_by": "timing",
                    "fast": False,
                },
                "decode_batch_8": {
                    "ratio": 0.75,
                    "interval": [0.5, 1.25],
                    "predicted": 0.8,
                    "decided_by": "cost model",
                    "fast": False,
                },
            },
            "calibration": METRICS,
            "holdout": METRICS,
            "chosen": True,
            "why": "meets the budget with its margin, fast and small enough",
        },
    ],
    "fp32": {"bytes": 674869, "decode_batch_1_ms": 1.0, "decode_batch_8_ms": 2.25},
    "budget": {"top1_agreement_min": 0.975},
    "budget_with_margin": {"top1_agreement_min": 0.98},
    "preprocess": "quant_pre_process with symbolic shape inference",
    "layerwise": [LAYER],
    "size": SIZE,
    "chosen": "int4-weight-only",
}


def written(data: Any) -> str:
    """As stages/_contract.py write_json writes it (sorted keys; 1 and 1.0 differ)."""
    return json.dumps(data, indent=2, sort_keys=True)


@pytest.mark.parametrize(
    "model, details", [(PerNodeDetails, PER_NODE), (RecipeSearchDetails, SEARCH)]
)
def test_the_details_read_and_write_back_byte_for_byte(model: Any, details: dict) -> None:
    assert written(model.model_validate(details).model_dump()) == written(details)


def test_a_failed_search_writes_no_section_it_did_not_reach() -> None:
    """Failing before publishing, the stage reports no size, no chosen recipe and (auto,
    no recipe met the budget) no layerwise view: absent keys, not nulls."""
    early = {k: v for k, v in SEARCH.items() if k not in ("layerwise", "size", "chosen")}
    parsed = RecipeSearchDetails.model_validate(early)
    assert (parsed.layerwise, parsed.size, parsed.chosen) == (None, None, None)
    assert written(parsed.model_dump()) == written(early)


def test_a_budget_writes_only_the_bounds_it_gives() -> None:
    details = PerNodeDetails.model_validate(PER_NODE)
    assert details.budget == AccuracyBudget(greedy_agreement_min=0.5, snr_db_min=39.0)
    details.budget = AccuracyBudget(top1_agreement_min=0.9)
    assert details.model_dump()["budget"] == {"top1_agreement_min": 0.9}


def test_a_misspelled_recipe_row_field_is_refused_by_name() -> None:
    row = {**ROW, "speed_up": ROW["speedup"]}
    del row["speedup"]  # optional: the typo alone would otherwise pass unnoticed
    with pytest.raises(ValidationError, match=r"speed_up\s+Extra inputs are not permitted"):
        RecipeTrial.model_validate(row)
    with pytest.raises(ValidationError, match="speed_up"):
        RecipeSearchDetails.model_validate({**SEARCH, "recipes": [row]})


def test_a_recipe_row_without_its_verdict_is_refused() -> None:
    row = {k: v for k, v in ROW.items() if k != "why"}
    with pytest.raises(ValidationError, match=r"why\s+Field required"):
        RecipeTrial.model_validate(row)
    shipped = {k: v for k, v in row.items() if k not in ("speedups", "speed")}
    with pytest.raises(ValidationError, match=r"recipes\.0\.why\s+Field required"):
        QuantInfo.model_validate(
            {"method": "int8-dynamic", "dtype": "int8", "float_nodes": [], "recipes": [shipped]}
        )


def test_a_mistyped_row_is_refused_when_made_and_when_changed() -> None:
    with pytest.raises(ValidationError, match=r"size_ratio\s+Input should be a valid number"):
        RecipeTrial.model_validate({**ROW, "size_ratio": "small"})
    with pytest.raises(ValidationError, match=r"calibration\.snr_db\s+Input should be a valid"):
        RecipeTrial.model_validate({**ROW, "calibration": {"snr_db": "high"}})
    trial = RecipeTrial.model_validate(ROW)
    trial.speedup = 1.25  # the search times a row after making it: assignments are checked
    with pytest.raises(ValidationError, match="speedup"):
        trial.speedup = "fast"  # type: ignore[assignment]
    with pytest.raises(ValidationError, match="chosen"):
        trial.chosen = "yes please"  # type: ignore[assignment]
    with pytest.raises(ValidationError, match="Instance is frozen"):
        trial.shipped().chosen = True  # what ships does not change


def test_sensitivity_and_selection_rows_refuse_unknown_metrics_and_ways() -> None:
    alone = PER_NODE["sensitivity"][0]
    # a metric accuracy.py does not produce (or a new one not yet typed) is refused
    with pytest.raises(ValidationError, match="top1_agrement"):
        SensitivityRow.model_validate({**alone, "top1_agrement": 1.0})
    with pytest.raises(ValidationError, match=r"measured\s+Input should be 'alone' or 'one pass'"):
        SensitivityRow.model_validate({**alone, "measured": "twice"})
    with pytest.raises(ValidationError, match=r"node\s+Field required"):
        SensitivityRow.model_validate({k: v for k, v in alone.items() if k != "node"})
    with pytest.raises(ValidationError, match=r"meets_budget\s+Field required"):
        SelectionRow.model_validate({"float_nodes": 0, **METRICS})
    with pytest.raises(ValidationError, match=r"float_nodes\s+Input should be a valid integer"):
        SelectionRow.model_validate({"float_nodes": 0.5, **METRICS, "meets_budget": True})


def test_an_unmeasured_metric_is_absent_and_an_untimed_recipe_is_null() -> None:
    one_pass = SensitivityRow(node="n", module="", measured="one pass", local_snr_db=3.0)
    assert one_pass.snr_db is None and "snr_db" not in one_pass.model_dump()
    assert json.loads(one_pass.model_dump_json()) == {
        "node": "n",
        "module": "",
        "measured": "one pass",
        "local_snr_db": 3.0,
    }
    untimed = RecipeTrial.model_validate(ROW)
    assert untimed.model_dump()["speedup"] is None  # the report says "not timed" as null
    # ...and QuantInfo, written without None fields, leaves it out (the card: "not timed")
    info = QuantInfo(method="auto", dtype="int8", float_nodes=[], recipes=[untimed.shipped()])
    assert "speedup" not in info.model_dump(exclude_none=True)["recipes"][0]


def test_a_shipped_row_is_the_trial_without_its_per_pass_speedups() -> None:
    trial = RecipeTrial.model_validate(SEARCH["recipes"][1])
    shipped = trial.shipped()
    assert type(shipped) is RecipeRow
    assert shipped.model_dump() == {
        k: v for k, v in SEARCH["recipes"][1].items() if k not in ("speedups", "speed")
    }


def test_sizes_keep_their_integer_bytes() -> None:
    size = FileSize.model_validate(SIZE)
    assert written(size.model_dump()) == written(SIZE)
    with pytest.raises(ValidationError, match="bytes"):
        FileSize.model_validate({**SIZE, "bytes": 1.5})
    search = RecipeSearchDetails.model_validate(copy.deepcopy(SEARCH))
    assert isinstance(search.fp32["bytes"], int) and isinstance(
        search.fp32["decode_batch_1_ms"], float
    )
