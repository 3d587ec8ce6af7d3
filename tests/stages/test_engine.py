"""engine: what runs without TensorRT: profiles, validation, skip/required paths, config."""

from __future__ import annotations

import pytest

from pipelines.gate import gate
from schemas import SpecError, StageError
from schemas.loader import load_release
from schemas.release import CudaGraphs, EngineConfig, ServingConfig
from stages import engine as build_engine
from stages.rendering.render import parse_triton
from tests.conftest import REPO, Workspace, gpt2_spec, model_info

INFO = model_info(
    dims={
        "batch": {"min": 1, "opt": 2, "max": 8},
        "sequence": {"min": 1, "opt": 16, "max": 64},
        "past_sequence": {"min": 0, "opt": 16, "max": 128},
    },
    inputs=[
        {"name": "input_ids", "axes": ["batch", "sequence"], "dtype": "int64"},
        {"name": "attention_mask", "axes": ["batch", "total_sequence"], "dtype": "int64"},
        {"name": "past.0", "axes": ["batch", 4, "past_sequence", 16], "dtype": "float32"},
    ],
)


# Skips follow what this machine has, never assumed: the same suite runs where a GPU and
# TensorRT are (scripts/gpu_check.sh) and where they are not.
MISSING = build_engine.why_unavailable()
no_engine_here = pytest.mark.skipif(not MISSING, reason="TensorRT and a CUDA device are present")
engine_here = pytest.mark.skipif(bool(MISSING), reason=MISSING or "present")


def _engine(**kw: object) -> EngineConfig:
    return EngineConfig.model_validate(kw)


def test_profiles_come_from_the_export_ranges_with_overrides() -> None:
    cfg = _engine(
        profiles=[
            {"name": "prefill", "dims": {"sequence": {"min": 1, "opt": 16, "max": 64}}},
            {"name": "decode", "dims": {"sequence": {"min": 1, "opt": 1, "max": 1}}},
        ]
    )
    prefill, decode = build_engine.derive_profiles(cfg, INFO)
    assert prefill["shapes"]["input_ids"] == {"min": [1, 1], "opt": [2, 16], "max": [8, 64]}
    assert prefill["shapes"]["past.0"]["max"] == [8, 4, 128, 16]
    # total_sequence = past + sequence at each of min/opt/max (min clamped to 1)
    assert prefill["shapes"]["attention_mask"] == {"min": [1, 1], "opt": [2, 32], "max": [8, 192]}
    assert decode["shapes"]["input_ids"] == {"min": [1, 1], "opt": [2, 1], "max": [8, 1]}
    assert decode["shapes"]["attention_mask"]["max"] == [8, 129]


def _spec_error(ws: Workspace, engine: dict[str, object]) -> str:
    with pytest.raises(SpecError) as exc:
        ws.spec(gpt2_spec(engine=engine))
    return "\n".join(exc.value.problems)


def test_profiles_and_graph_batches_outside_the_export_are_refused(ws: Workspace) -> None:
    wide = {"profiles": [{"name": "p", "dims": {"batch": {"min": 1, "opt": 2, "max": 16}}}]}
    assert "engine.profiles[0]: (p) dim 'batch' [1, 16] lies outside the export's [1, 3]" in (
        _spec_error(ws, wide)
    )
    unknown = {"profiles": [{"name": "p", "dims": {"frames": {"min": 1, "opt": 1, "max": 2}}}]}
    assert "dim 'frames' is not in export.dims" in _spec_error(ws, unknown)
    graphs = {"cuda_graphs": {"batch_sizes": [1, 4]}}
    assert "engine.cuda_graphs.batch_sizes: has 4, outside every profile's batch range" in (
        _spec_error(ws, graphs)
    )


@no_engine_here
def test_without_tensorrt_the_stage_skips_as_optional_and_the_gate_says_n_a(
    built_gpt2: Workspace,
) -> None:
    report = built_gpt2.run("engine", gpt2_spec())
    assert report.status.value == "skipped"
    assert report.summary == f"skipped: {MISSING}"
    assert report.optional is True and "optional" not in report.details
    assert report.details["source"]["stage"] == "export"  # the example is int8-dynamic
    assert (built_gpt2.out("tiny-gpt2", "engine") / "profiles.json").is_file()
    rows = {r.check: r for r in gate(built_gpt2.root, [built_gpt2.spec(gpt2_spec())], None).rows}
    assert rows["engine"].verdict == "n/a"
    # The same skipped report is a failure once the spec requires the engine.
    required = built_gpt2.spec(gpt2_spec(engine={"required": True}))
    rows = {r.check: r for r in gate(built_gpt2.root, [required], None).rows}
    assert rows["engine"].verdict == "FAIL"
    built_gpt2.write(gpt2_spec())


@no_engine_here
def test_a_required_engine_fails_with_the_reason(built_gpt2: Workspace) -> None:
    report = built_gpt2.run("engine", gpt2_spec(engine={"required": True}))
    assert report.status.value == "failed"
    assert report.reasons[0].startswith(f"engine.required is true but {MISSING}")
    assert "engine.required: false" in report.reasons[0]
    assert built_gpt2.run("engine", gpt2_spec()).status.value == "skipped"


def test_backend_none_skips_without_looking_for_a_gpu(built_gpt2: Workspace) -> None:
    report = built_gpt2.run("engine", gpt2_spec(engine={"backend": "none"}))
    assert report.status.value == "skipped" and report.summary == "skipped: engine.backend is none"
    expected = "skipped" if MISSING else "passed"
    assert built_gpt2.run("engine", gpt2_spec()).status.value == expected


@engine_here
def test_with_tensorrt_and_a_gpu_the_engine_builds_and_passes_parity(
    built_gpt2: Workspace,
) -> None:
    report = built_gpt2.run("engine", gpt2_spec())
    assert report.status.value == "passed", report.reasons
    assert all(row["ok"] for row in report.details["parity"])
    assert all(row["ok"] for row in report.details["cuda_graphs"])
    out = built_gpt2.out("tiny-gpt2", "engine")
    assert build_engine.check_trt_layout(out / build_engine.trt_model_dir("tiny-gpt2")) == []
    assert not list(out.rglob("*.lock"))


def test_gpu_detection_asks_the_driver() -> None:
    count, how = build_engine.cuda_devices()
    assert "libnvidia-ml.so.1" in how or "libcuda.so.1" in how
    assert (count == 0) == ("no CUDA device" in MISSING)


def _values(max_batch: int | None, batches: list[int]) -> dict[str, object]:
    profiles = build_engine.derive_profiles(_engine(), INFO)
    serving = ServingConfig(max_batch_size=max_batch)
    graphs = CudaGraphs(batch_sizes=batches)
    return build_engine.triton_trt_values(profiles, serving, 8, graphs, "9.0")


def test_tensorrt_triton_config_renders_and_parses_back(tmp_path: object) -> None:
    path = build_engine.render_trt_triton(tmp_path, "tiny", _values(4, [1, 2]))  # type: ignore[arg-type]
    config = parse_triton(path.read_text())
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 4
    assert dict(config.cc_model_filenames) == {"9.0": "model_sm90.plan"}
    assert list(config.instance_group[0].profile) == ["0"]
    assert config.optimization.cuda.graphs is True
    specs = config.optimization.cuda.graph_spec
    assert [s.batch_size for s in specs] == [1, 2]
    assert list(specs[0].input["past.0"].dim) == [4, 16, 16]


def test_tensorrt_config_refuses_a_batch_beyond_the_profile() -> None:
    with pytest.raises(StageError, match="max_batch_size = 16 exceeds the engine profiles'"):
        _values(16, [1])


def test_the_example_release_declares_two_profiles() -> None:
    spec = load_release(REPO / "releases" / "tiny-gpt2.yaml")
    assert [p.name for p in spec.engine.profiles] == ["prefill", "decode"]
    assert spec.engine.required is False


def test_engine_parity_shapes_keep_the_kv_dims_consistent() -> None:
    from stages.onnx.shapes import odd_size
    from stages.tensorrt.build import parity_shapes

    [profile] = build_engine.derive_profiles(_engine(), INFO)
    shapes = parity_shapes(profile, INFO)
    assert list(shapes) == ["min", "opt", "max", "odd"]
    for label, s in shapes.items():
        batch, seq = s["input_ids"]
        past = s["past.0"][2]
        assert s["attention_mask"] == [batch, max(past + seq, 1)], label
        assert s["past.0"][0] == batch
    odd = shapes["odd"]
    assert odd["input_ids"] == [3, 5] and odd["past.0"] == [3, 4, 7, 16]
    assert odd_size(1, 1) == 1 and odd_size(2, 2) == 2 and odd_size(0, 1) == 1
    assert odd_size(1, 8) == 3 and odd_size(1, 8, avoid={3}) == 5 and odd_size(0, 4) == 1


def test_the_engine_is_built_from_a_graph_tensorrt_can_parse() -> None:
    assert build_engine.engine_source("int8-static")[0] == "quantize"
    assert build_engine.engine_source("none")[0] == "quantize"
    for method in ("int8-dynamic", "int4-weight-only"):
        source, why = build_engine.engine_source(method)
        assert source == "export" and "ONNX Runtime-only ops" in why


def test_cuda_graph_batches_beyond_the_served_batch_are_refused(ws: Workspace) -> None:
    engine = {"cuda_graphs": {"batch_sizes": [1, 3]}}
    spec = gpt2_spec(engine=engine, bundle={"serving": {"max_batch_size": 2}})
    refused = r"cuda_graphs.batch_sizes: \[3\] exceed bundle.serving.max_batch_size 2"
    with pytest.raises(SpecError, match=refused):
        ws.spec(spec)
    spec["bundle"]["serving"]["max_batch_size"] = 3  # at the limit: accepted
    assert ws.spec(spec).engine.cuda_graphs.batch_sizes == [1, 3]
