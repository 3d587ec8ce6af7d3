from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from schemas import StageReport
from schemas.artifacts import QuantInfo
from schemas.quantsearch import PerNodeDetails, RecipeSearchDetails
from tests.conftest import Workspace, generic_spec, gpt2_spec

CALIBRATION = {
    "path": "data/calibration/docstrings.jsonl",
    "tokenizer": "models/tiny-gpt2",
    "samples": 24,
    "holdout": 8,
    "sensitivity_samples": 8,
}


def quant_spec(**quantization) -> dict:
    """The example with these quantization settings. Its evaluation keeps only the gates
    against production: its reference checks are the example budget's (one accuracy
    contract), which these settings replace."""
    spec = gpt2_spec()
    spec["evaluation"]["thresholds"] = [
        t for t in spec["evaluation"]["thresholds"] if t.get("baseline") == "production"
    ]
    spec["quantization"] = {
        "calibration": CALIBRATION,
        "budget": {"top1_agreement_min": 0.9},
        **quantization,
    }
    return spec


def info(ws: Workspace, release: str = "tiny-gpt2") -> QuantInfo:
    return QuantInfo.model_validate_json((ws.out(release, "quantize") / QuantInfo.FILE).read_text())


def per_node(report: StageReport) -> PerNodeDetails:
    """An explicit method's report details, typed (a misspelled field fails here)."""
    return PerNodeDetails.model_validate(report.details)


def searched(report: StageReport) -> RecipeSearchDetails:
    """Method auto's report details, typed."""
    return RecipeSearchDetails.model_validate(report.details)


@pytest.mark.parametrize(
    "method,extra,dtype,op",
    [
        ("int8-dynamic", {}, "int8", "MatMulInteger"),
        ("int8-static", {"calibrate_method": "minmax"}, "int8", "QuantizeLinear"),
        ("int8-static", {"calibrate_method": "percentile"}, "int8", "QuantizeLinear"),
        ("int4-weight-only", {"block_size": 32}, "int4", "MatMulNBits"),
        ("int8-weight-only", {"block_size": 32}, "int8", "MatMulNBits"),
    ],
)
def test_each_method_quantizes_tiny_gpt2_within_budget(
    built_gpt2: Workspace, method: str, extra: dict, dtype: str, op: str
) -> None:
    import onnx

    report = built_gpt2.run("quantize", quant_spec(method=method, **extra))
    assert report.status.value == "passed", report.reasons
    assert info(built_gpt2).dtype == dtype
    model = built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    assert op in {n.op_type for n in onnx.load(model).graph.node}
    details = per_node(report)
    assert details.size is not None and details.size.ratio < 0.9
    assert (
        details.calibration.sha256
        == __import__("hashlib")
        .sha256((built_gpt2.root / CALIBRATION["path"]).read_bytes())
        .hexdigest()
    )
    sensitivity = details.sensitivity
    assert all(r.measured == "alone" for r in sensitivity)  # 9 nodes: none ranked in one pass
    assert [r.snr_db for r in sensitivity] == sorted(r.snr_db for r in sensitivity)
    # every node was really quantized when measured alone (identical output = 200 dB)
    assert len(sensitivity) >= 9 and all(r.snr_db < 150 for r in sensitivity)
    ort.InferenceSession(str(model))  # loads and runs in ONNX Runtime


def test_method_none_ships_the_fp32_model(built_gpt2: Workspace) -> None:
    spec = gpt2_spec()
    spec["quantization"] = {"method": "none"}
    assert built_gpt2.run("quantize", spec).status.value == "passed"
    same = (built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx").read_bytes()
    assert same == (built_gpt2.out("tiny-gpt2", "export") / "model.onnx").read_bytes()
    assert info(built_gpt2) == QuantInfo(method="none", dtype="float32", float_nodes=[])


def test_unreachable_budget_fails_with_the_best_figure(built_gpt2: Workspace) -> None:
    spec = quant_spec(method="int8-dynamic", max_float_nodes=1, budget={"snr_db_min": 150.0})
    report = built_gpt2.run("quantize", spec)
    assert report.status.value == "failed"
    assert report.summary == "accuracy budget not met with the cap of 1 float node(s)"
    assert report.reasons[0].startswith(
        "best on calibration samples with 1 node(s) in float: snr_db "
    )
    assert (
        "< 150" in report.reasons[0] and "Raise quantization.max_float_nodes" in report.reasons[0]
    )
    assert not (built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx").exists()


@pytest.fixture
def outlier_ws(ws: Workspace) -> tuple[Workspace, dict]:
    rng = np.random.default_rng(0)
    np.savez(ws.root / "data" / "outlier.npz", x=rng.standard_normal((48, 4, 8)).astype("f4"))
    spec = generic_spec("outlier", "outlier")
    spec["quantization"] = {
        "method": "int8-dynamic",
        "max_float_nodes": 2,
        "budget": {"snr_db_min": 25.0},
        # a toy of a few hundred weights: scales and zero points outweigh them (2.1x FP32);
        # this test is about the ranking, the size rule has its own (test_tasks.py)
        "max_size_ratio": 5.0,
        "calibration": {
            "path": "data/outlier.npz",
            "samples": 32,
            "holdout": 16,
            "sensitivity_samples": 16,
        },
    }
    for stage in ("pin", "export"):
        assert ws.run(stage, spec).status.value == "passed"
    return ws, spec


def test_outlier_layer_is_ranked_first_and_kept_in_float(outlier_ws) -> None:
    ws, spec = outlier_ws
    report = ws.run("quantize", spec)
    assert report.status.value == "passed", report.reasons
    details = per_node(report)
    ranked = details.sensitivity
    assert ranked[0].module == "layers.2"
    assert ranked[0].snr_db < ranked[1].snr_db - 10
    assert [n.node for n in info(ws, "outlier").float_nodes] == [ranked[0].node]
    assert details.float_nodes == [ranked[0].node]
    trace = details.selection
    assert [(t.float_nodes, t.meets_budget) for t in trace] == [(0, False), (1, True)]
    assert trace[1].snr_db > trace[0].snr_db + 10  # the exclusion really took effect


def test_layerwise_view_shows_where_the_error_enters(outlier_ws) -> None:
    ws, spec = outlier_ws
    spec["quantization"]["max_float_nodes"] = 0
    spec["quantization"]["budget"] = {"snr_db_min": 1.0}
    report = ws.run("quantize", spec)
    worst = {row.module: row.worst_channel_snr_db for row in per_node(report).layerwise or []}
    assert worst["layers.1"] > 25 > 10 > worst["layers.2"]


def calibration_error(ws: Workspace, **changes) -> str:
    spec = quant_spec(method="int8-dynamic")
    spec["quantization"]["calibration"] = {**CALIBRATION, **changes}
    for stage in ("pin", "export"):
        ws.run(stage, spec)
    report = ws.run("quantize", spec)
    assert report.status.value == "failed"
    return report.reasons[0]


def write_jsonl(ws: Workspace, lines: list[str]) -> str:
    path = ws.root / "data" / "custom.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return "data/custom.jsonl"


def test_missing_calibration_file_is_refused(ws: Workspace) -> None:
    reason = calibration_error(ws, path="data/nope.jsonl")
    assert reason.startswith("quantization.calibration.path data/nope.jsonl does not exist")
    assert "never substitutes random data" in reason


def test_empty_calibration_file_is_refused(ws: Workspace) -> None:
    reason = calibration_error(ws, path=write_jsonl(ws, []))
    assert reason.startswith("quantization.calibration.path data/custom.jsonl is empty")


def test_too_few_samples_names_the_counts(ws: Workspace) -> None:
    reason = calibration_error(ws, path=write_jsonl(ws, ['{"text": "hello"}'] * 10))
    assert reason.startswith(
        "quantization.calibration.path data/custom.jsonl has 10 sample(s);"
        " samples + holdout need 32"
    )


def test_sample_longer_than_the_export_is_refused_with_its_line(ws: Workspace) -> None:
    path = write_jsonl(ws, ['{"text": "short"}', '{"text": "%s"}' % ("word " * 200)])
    reason = calibration_error(ws, path=path)
    assert reason.startswith("data/custom.jsonl:2: ") and "longer than the limit 64" in reason


def test_token_id_outside_the_vocabulary_is_refused(ws: Workspace) -> None:
    ids = np.full((40, 4), 3, dtype=np.int64)
    ids[5, 2] = 9999
    np.savez(ws.root / "data" / "ids.npz", input_ids=ids)
    reason = calibration_error(ws, path="data/ids.npz", tokenizer=None)
    assert reason.startswith(
        "data/ids.npz: sample 5: token id 9999 is outside the model's vocabulary of 512"
    )


def test_malformed_line_is_refused_with_its_number(ws: Workspace) -> None:
    reason = calibration_error(ws, path=write_jsonl(ws, ['{"text": "a"}', "not json"]))
    assert reason.startswith("data/custom.jsonl:2: not a JSON object with a 'text' string")


def test_jsonl_without_a_tokenizer_is_a_spec_error(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from schemas import ReleaseSpec

    spec = quant_spec(method="int8-dynamic")
    spec["quantization"]["calibration"] = {**CALIBRATION, "tokenizer": None}
    with pytest.raises(ValidationError, match="needs `tokenizer`"):
        ReleaseSpec.model_validate(spec)


def test_the_calibration_count_is_samples_plus_holdout_at_its_boundary(ws: Workspace) -> None:
    """31 texts for 24 + 8 fail (more than `samples` alone, so a check of `samples` only
    would pass them); exactly 32 load, split 24 / 8."""

    from schemas.artifacts import ModelInfo
    from stages.onnx import model as m
    from stages.quant import calibration as _calibration

    texts = [json.dumps({"text": f"def f{i}(x): return x + {i}"}) for i in range(32)]
    reason = calibration_error(ws, path=write_jsonl(ws, texts[:31]))
    assert reason.startswith(
        "quantization.calibration.path data/custom.jsonl has 31 sample(s); "
        "samples + holdout need 32"
    )
    write_jsonl(ws, texts)
    spec = ws.spec(quant_spec(method="int8-dynamic"))
    cfg = spec.quantization.calibration.model_copy(update={"path": "data/custom.jsonl"})
    info = ModelInfo.model_validate_json(
        (ws.out("tiny-gpt2", "export") / ModelInfo.FILE).read_text()
    )
    lay = m.layout_from_info(info)
    samples = _calibration.load(ws.root, cfg, spec.task, lay, spec.export.dims, info.arch.vocab)
    assert (len(samples.calibration), len(samples.holdout)) == (24, 8)


# ----------------------------------------------------------------- method auto: recipes
def auto_spec(**quantization: object) -> dict:
    return quant_spec(method="auto", **quantization)


def test_auto_ships_the_first_recipe_that_meets_the_budget_with_its_margin(
    built_gpt2: Workspace,
) -> None:
    """int4 meets top-1 0.975 bare but not with the margin (0.975 + 0.2 x 0.025 = 0.98); the
    next recipe does, and ships; the report has a row for each with size, speed and why."""
    import onnx

    spec = auto_spec(
        recipes=["int4-weight-only", "int8-dynamic"],
        budget={"top1_agreement_min": 0.975},
        min_speedup=0,
    )
    report = built_gpt2.run("quantize", spec)
    assert report.status.value == "passed", report.reasons
    details = searched(report)
    rows = details.recipes
    assert [(r.recipe, r.chosen) for r in rows] == [
        ("int4-weight-only", False),
        ("int8-dynamic", True),
    ]
    assert details.chosen == "int8-dynamic"
    assert 0.975 <= rows[0].holdout["top1_agreement"] < 0.98, rows[0]  # the margin decided
    assert "held-out (with margin): top1_agreement" in rows[0].why
    assert all(r.size_ratio < 0.9 for r in rows)
    # timed as it is served: decode steps at batch 1 and the served 3, the slowest of which
    # decides; int4 missed the budget and nothing fell back on it, so it is not timed
    assert rows[0].speedup is None and rows[0].speedups == {}
    r = rows[1]
    assert set(r.speedups) == {"decode_batch_1", "decode_batch_3"}
    assert r.speedup == min(r.speedups["decode_batch_1"], r.speedups["decode_batch_3"])
    assert details.budget_with_margin.top1_agreement_min == pytest.approx(0.98)
    shipped = info(built_gpt2)
    assert (shipped.method, shipped.dtype, shipped.float_nodes) == ("int8-dynamic", "int8", [])
    # the table ships with it (the model card prints it): one row per variant measured, as
    # the report has it but for the per-pass speed-ups
    assert shipped.recipes == [r.shipped() for r in rows]
    assert [(r.recipe, r.chosen) for r in shipped.recipes] == [
        ("int4-weight-only", False),
        ("int8-dynamic", True),
    ]
    model = built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    assert "MatMulInteger" in {n.op_type for n in onnx.load(model).graph.node}
    # no margin: the first recipe is good enough
    report = built_gpt2.run(
        "quantize", {**spec, "quantization": {**spec["quantization"], "margin": 0}}
    )
    assert report.status.value == "passed" and searched(report).chosen == "int4-weight-only"
    assert info(built_gpt2).dtype == "int4"


def test_auto_never_ships_a_recipe_slower_than_fp32_and_says_so(built_gpt2: Workspace) -> None:
    """At 64 channels INT8's quantize/dequantize costs more than the matmuls it speeds up:
    every recipe is slower than FP32 on tiny-gpt2, so with min_speedup 1 none ships (with
    fallback fail: the stage fails, naming each recipe's reason)."""
    report = built_gpt2.run("quantize", auto_spec(min_speedup=1.0, fallback="fail"))
    details = searched(report)
    rows = details.recipes
    timed = [r for r in rows if r.speedup is not None]
    # a row goes untimed only when it failed accuracy and could not become the fallback
    assert all("(with margin)" in r.why for r in rows if r.speedup is None)
    by = {r.recipe: r for r in rows}
    # per-channel accurate but too slow: static may be faster, so the search builds it,
    # unless a recipe before it in the order shipped (per-tensor int8-dynamic can measure
    # at FP32's speed on a busy machine: the search then stops there)
    if "(with margin)" not in by["int8-dynamic-per-channel"].why and details.chosen is None:
        assert by["int8-static"].calibration, by["int8-static"]
    slow = [r for r in timed if r.speedup < 1]
    if len(slow) < len(timed):  # a recipe ran faster here: then it must be the one shipped
        assert report.status.value == "passed" and details.chosen in {
            r.recipe for r in timed if r.speedup >= 1
        }
        return
    assert details.chosen is None
    assert report.status.value == "failed"
    assert (
        report.summary.startswith("no recipe ships; refused for ") and "speed: " in report.summary
    )
    assert "below quantization.min_speedup 1" in report.reasons[0]
    assert "min_speedup (0: ship INT8 even when slower)" in report.reasons[0]


def test_when_no_recipe_ships_the_fp32_model_does_and_says_why(built_gpt2: Workspace) -> None:
    """The default fallback: a model too small for INT8 to be faster (every recipe refused
    for speed or accuracy here) builds, shipping the FP32 export byte for byte, and the
    report, QuantInfo and the model card's table say why, recipe by recipe."""
    report = built_gpt2.run(
        "quantize", auto_spec(min_speedup=1.0, budget={"top1_agreement_min": 0.9999})
    )
    assert report.status.value == "passed", report.reasons
    details = searched(report)
    assert details.chosen is None and details.fallback
    assert details.fallback.startswith("no recipe ships; refused for ")
    assert report.summary.startswith(f"FP32 ships: {details.fallback}")
    shipped = info(built_gpt2)
    assert (shipped.method, shipped.dtype, shipped.float_nodes) == ("none", "float32", [])
    assert shipped.recipes and not any(r.chosen for r in shipped.recipes)
    assert shipped.budget == {"top1_agreement_min": 0.9999}
    out, export = built_gpt2.out("tiny-gpt2", "quantize"), built_gpt2.out("tiny-gpt2", "export")
    assert (out / "model.onnx").read_bytes() == (export / "model.onnx").read_bytes()
    assert report.metrics["size_ratio"] == 1.0
    assert not (out / "_variants").exists()


def test_auto_keeps_whole_layer_classes_in_float_when_no_recipe_is_enough(
    built_gpt2: Workspace,
) -> None:
    """int4 alone cannot hold top-1 0.99: the search keeps the most damaging class of
    layers in float, every layer of it, ranked by one variant per class."""
    import onnx

    from stages.quant.recipes import class_of

    # lm_head is tied to the embedding: kept in float it is a second copy (size > FP32)
    spec = auto_spec(
        recipes=["int4-weight-only"],
        budget={"top1_agreement_min": 0.99},
        min_speedup=0,
        max_size_ratio=1.5,
    )
    report = built_gpt2.run("quantize", spec)
    rows = searched(report).recipes
    assert rows[0].float_classes == [] and not rows[0].chosen
    assert len(rows) >= 2 and all(r.float_classes for r in rows[1:])
    assert all(
        len(b.float_classes) == len(a.float_classes) + 1
        for a, b in zip(rows[1:], rows[2:], strict=False)
    )
    assert report.status.value == "passed", report.reasons
    floats = {n.node for n in info(built_gpt2).float_nodes}
    classes = set(next(r for r in rows if r.chosen).float_classes)
    graph = onnx.load(built_gpt2.out("tiny-gpt2", "export") / "model.onnx").graph
    members = {
        n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and class_of(n) in classes
    }
    assert floats and floats <= members  # whole classes, nothing else
    assert len({class_of(n) for n in graph.node if n.name in floats}) == len(classes)


def test_a_clipping_calibration_is_not_a_coarser_grid(tmp_path: Path) -> None:
    """DOMINATED_BY skips static QDQ after dynamic per-channel missed the accuracy only for
    minmax ranges: entropy and percentile clip outliers, which may help."""
    from schemas.loader import load_release
    from schemas.spec.quantization import Int8Static
    from stages.quant.recipes import _dominates, concrete

    auto = load_release(Workspace(tmp_path).write(auto_spec())).quantization
    assert _dominates(concrete(auto, "int8-static"))
    for method in ("entropy", "percentile"):
        cfg = Int8Static.model_validate(
            {
                **auto.model_dump(include={"calibration"}),
                "method": "int8-static",
                "calibrate_method": method,
            }
        )
        assert not _dominates(cfg)


def test_the_margin_moves_each_bound_toward_its_ideal() -> None:
    from schemas.spec.quantization import AccuracyBudget
    from stages.quant.recipes import tightened

    budget = AccuracyBudget(
        top1_agreement_min=0.98, logit_cosine_min=0.99, snr_db_min=20, perplexity_increase_max=0.01
    )
    tight = tightened(budget, 0.5)
    assert tight.top1_agreement_min == pytest.approx(0.99)
    assert tight.logit_cosine_min == pytest.approx(0.995)
    assert tight.snr_db_min == pytest.approx(30)
    assert tight.perplexity_increase_max == pytest.approx(0.005)
    assert tightened(budget, 0) == budget


def test_auto_recipes_are_checked_by_the_spec(tmp_path: Path) -> None:
    from schemas import SpecError
    from schemas.loader import load_release

    ws = Workspace(tmp_path)
    with pytest.raises(SpecError, match="name one recipe twice"):
        load_release(ws.write(auto_spec(recipes=["int8-dynamic", "int8-dynamic"])))
    with pytest.raises(SpecError, match="recipes"):
        load_release(ws.write(auto_spec(recipes=["int3"])))
    assert load_release(ws.write(auto_spec())).quantization.method == "auto"


def test_pre_processing_never_writes_into_the_exports_own_data_file(ws: Workspace) -> None:
    """An export with external data ships model.onnx.data, the name ONNX Runtime's
    optimizer also writes the pre-processed weights to: the export's files are read (linked
    or copied) but must come out byte-identical, and the quantized graph must still run."""
    import hashlib

    spec = gpt2_spec()
    spec["export"]["external_data"] = "always"
    for stage in ("pin", "export"):
        assert ws.run(stage, spec).status.value == "passed"
    export = ws.out(spec["name"], "export")
    assert (export / "model.onnx.data").is_file()

    def digests() -> dict[str, str]:
        return {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in export.glob("model.onnx*")
        }

    before = digests()
    report = ws.run("quantize", spec)
    assert report.status.value == "passed", report.reasons
    assert digests() == before
    assert (ws.out(spec["name"], "quantize") / "model.onnx").is_file()
