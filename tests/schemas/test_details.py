"""The checking stages' report details, typed (schemas/details.py): a stage that writes a
misspelled or missing key fails where it writes it, what it did not set stays out, and an
infinite error (a NaN or a shape mismatch) is a value, not a refusal."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from schemas.details import (
    Embedding,
    ExportDetails,
    KvcheckDetails,
    ParityDetails,
    ShapeComparison,
)

ROW = {"shape": "min", "sizes": {"batch": 1}, "output": "logits", "ok": True}


def test_a_misspelled_or_missing_key_is_refused() -> None:
    with pytest.raises(ValidationError) as exc:
        ParityDetails.model_validate({"comparison": []})
    kinds = {(e["loc"][0], e["type"]) for e in exc.value.errors()}
    assert kinds == {("comparisons", "missing"), ("comparison", "extra_forbidden")}
    with pytest.raises(ValidationError, match="max_abs"):
        ShapeComparison.model_validate({**ROW, "error": 0.1})
    with pytest.raises(ValidationError, match="position"):
        KvcheckDetails.model_validate(
            {
                "plan": {
                    "prompt": 6,
                    "steps": 2,
                    "past_lengths": [6],
                    "prefill_chunk": 8,
                    "padded": None,
                    "full_pass_lengths": [7, 8],
                },
                "pytorch": [{**ROW, "probe": "step 0", "past": 6, "error": 0.1, "max_abs": 0.0}],
                "onnx": [],
                "shipped": {"graph": "quantize", "rows": []},
            }
        )


def test_only_what_the_stage_set_is_written_and_inf_is_a_value() -> None:
    mismatch = {**ROW, "ok": False, "error": math.inf, "max_abs": math.inf, "note": "shape"}
    plain = {**ROW, "error": 0.1, "max_abs": 0.01}
    details = ParityDetails.model_validate({"comparisons": [mismatch, plain]})
    dumped = details.dump()
    assert dumped == {"comparisons": [mismatch, plain]}  # no layerwise, no atol_scale, no note
    assert json.loads(json.dumps(dumped))["comparisons"][0]["error"] == math.inf


def test_the_embedding_source_is_written_under_its_json_name() -> None:
    found = {
        "trace_sizes": {"batch": 2},
        "probed": [],
        "model_files": ["model.onnx"],
        "embedding": {"pooling": "mean", "normalize": True, "from": "modules.json"},
    }
    details = ExportDetails.model_validate(found)
    assert details.embedding == Embedding(pooling="mean", normalize=True, source="modules.json")
    assert details.dump() == found
