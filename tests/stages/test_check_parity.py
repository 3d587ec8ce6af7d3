from __future__ import annotations

import numpy as np
import pytest

from schemas.release import ParityConfig, Tolerance
from stages.onnx.compare import compare, tolerance
from tests.conftest import Workspace, generic_spec, gpt2_spec


def test_parity_passes_at_min_opt_max_and_odd_shapes(built_gpt2: Workspace) -> None:
    report = built_gpt2.run("parity", gpt2_spec())
    assert report.status.value == "passed"
    shapes = {row["shape"] for row in report.details["comparisons"]}
    assert shapes == {"min", "opt", "max", "odd"}
    assert "layerwise" not in report.details  # on-failure only


def test_layerwise_always_maps_every_gpt2_block_to_an_onnx_tensor(built_gpt2: Workspace) -> None:
    spec = gpt2_spec(parity={"layerwise": "always"})
    layers = built_gpt2.run("parity", spec).details["layerwise"]
    modules = [row["module"] for row in layers["layers"]]
    assert {"transformer.h.0.attn", "transformer.h.1.mlp", "transformer.ln_f", "lm_head"} <= set(
        modules
    )
    assert layers["first_divergent"] is None


def test_divergent_layer_is_named_first(ws: Workspace) -> None:
    spec = generic_spec("divergent", "divergent")
    for stage in ("pin", "export"):
        ws.run(stage, spec)
    report = ws.run("parity", spec)
    assert report.status.value == "failed"
    assert report.reasons[-1].startswith("first diverging layer: skew (ONNX tensor")
    first = report.details["layerwise"]["layers"][0]
    assert first["module"] == "first" and first["ok"]


def test_tight_tolerance_turns_a_pass_into_a_failure(built_gpt2: Workspace) -> None:
    spec = gpt2_spec(parity={"tolerance": {"atol": 0.0, "rtol": 0.0}, "outputs": {}})
    report = built_gpt2.run("parity", spec)
    assert report.status.value == "failed"
    assert "first diverging layer" in report.reasons[-1]


def test_per_output_glob_tolerance_wins_over_default() -> None:
    cfg = ParityConfig(outputs={"present.*": Tolerance(atol=1.0, rtol=0.0)})
    assert tolerance(cfg, "present.3.key").atol == 1.0
    assert tolerance(cfg, "logits").atol == cfg.tolerance.atol


@pytest.mark.parametrize(
    "statistic,expected_ok", [("max", False), ("mean", True), ("quantile", True)]
)
def test_statistic_decides_how_one_outlier_counts(statistic: str, expected_ok: bool) -> None:
    ref = np.zeros(1000, np.float32)
    out = ref.copy()
    out[0] = 0.5  # one element far off, the rest exact
    cfg = ParityConfig(statistic=statistic, quantile=0.99)
    result = compare(ref, out, Tolerance(atol=0.01, rtol=0.0), cfg)
    assert result["ok"] is expected_ok and result["max_abs"] == 0.5


def test_nan_in_output_is_a_failure() -> None:
    ref = np.ones(4, np.float32)
    out = ref.copy()
    out[1] = np.nan
    assert compare(ref, out, Tolerance(), ParityConfig())["ok"] is False


def test_shape_mismatch_is_a_failure_with_a_note() -> None:
    result = compare(np.ones((2, 3)), np.ones((3, 2)), Tolerance(), ParityConfig())
    assert not result["ok"] and "!= reference" in result["note"]


def test_zero_tolerance_accepts_exact_equality_and_nothing_else() -> None:
    exact = Tolerance(atol=0.0, rtol=0.0)
    assert compare(np.zeros(3), np.zeros(3), exact, ParityConfig())["ok"] is True
    assert compare(np.zeros(3), np.full(3, 1e-12), exact, ParityConfig())["ok"] is False
