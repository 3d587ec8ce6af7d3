"""TensorRT control flow that needs no GPU, with a fake `tensorrt` module."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from schemas import StageError
from stages.tensorrt.build import compatibility_level


def fake_trt(*levels: str) -> SimpleNamespace:
    return SimpleNamespace(
        __version__="10.8.0", HardwareCompatibilityLevel=SimpleNamespace(**{n: n for n in levels})
    )


def test_a_tensorrt_before_10_9_builds_with_level_none() -> None:
    trt = fake_trt("NONE", "AMPERE_PLUS")  # 10.0-10.8: no SAME_COMPUTE_CAPABILITY
    assert compatibility_level(trt, "none") == "NONE"
    assert compatibility_level(trt, "ampere_plus") == "AMPERE_PLUS"


def test_a_level_the_installed_tensorrt_lacks_is_a_stage_error_naming_the_version() -> None:
    with pytest.raises(StageError, match="needs a newer TensorRT than 10.8.0"):
        compatibility_level(fake_trt("NONE", "AMPERE_PLUS"), "same_compute_capability")
    trt = fake_trt("NONE", "AMPERE_PLUS", "SAME_COMPUTE_CAPABILITY")
    assert compatibility_level(trt, "same_compute_capability") == "SAME_COMPUTE_CAPABILITY"


# --------------------------------------------------------------------------- comparator
def _identity_model(tmp_path, names=("a", "b")):
    import onnx
    from onnx import TensorProto, helper

    nodes, inputs, outputs = [], [], []
    for n in names:
        inputs.append(helper.make_tensor_value_info(f"in_{n}", TensorProto.FLOAT, ["n"]))
        outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]))
        nodes.append(helper.make_node("Relu", [f"in_{n}"], [f"mid_{n}"], name=f"relu_{n}"))
        nodes.append(helper.make_node("Identity", [f"mid_{n}"], [n], name=f"id_{n}"))
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path


def _ort(path, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _parity(**kw):
    from schemas.release import ParityConfig

    return ParityConfig.model_validate(kw)


def test_engine_parity_fails_an_all_nan_output_that_used_to_pass(tmp_path) -> None:
    from stages.tensorrt.build import judge

    path = _identity_model(tmp_path)
    feeds = {"in_a": np.linspace(-1, 1, 8, dtype="f4"), "in_b": np.ones(8, dtype="f4")}
    want = _ort(path, feeds)
    nan = {"a": np.full(8, np.nan, dtype="f4"), "b": want["b"]}
    row = judge("p", "opt", want, nan, _parity())
    assert row.ok is False and "a out of tolerance" in row.why
    assert judge("p", "opt", want, dict(want), _parity()).ok is True


def test_engine_parity_handles_empty_missing_and_misshaped_outputs(tmp_path) -> None:
    from stages.tensorrt.build import judge

    path = _identity_model(tmp_path)
    empty = {"in_a": np.zeros(0, dtype="f4"), "in_b": np.zeros(0, dtype="f4")}
    want = _ort(path, empty)
    assert judge("p", "min", want, dict(want), _parity()).ok is True  # empty = empty
    row = judge("p", "min", want, {"a": want["a"]}, _parity())
    assert not row.ok and "b out of tolerance: missing from the outputs" in row.why
    row = judge("p", "min", want, {"a": want["a"], "b": np.zeros(1, "f4")}, _parity())
    assert not row.ok and "shape [1] != reference [0]" in row.why


def test_engine_parity_uses_per_output_tolerances_and_the_statistic(tmp_path) -> None:
    from stages.tensorrt.build import judge

    path = _identity_model(tmp_path)
    feeds = {"in_a": np.ones(8, dtype="f4"), "in_b": np.ones(8, dtype="f4")}
    want = _ort(path, feeds)
    have = {"a": want["a"] + 0.05, "b": want["b"]}
    strict = _parity(tolerance={"atol": 0.01, "rtol": 0})
    assert judge("p", "opt", want, have, strict).ok is False
    loose_a = _parity(tolerance={"atol": 0.01, "rtol": 0}, outputs={"a": {"atol": 0.1, "rtol": 0}})
    assert judge("p", "opt", want, have, loose_a).ok is True
    # exactly at the limit passes, just past it fails (normalized error 1.0 vs 1.0000x)
    edge = {"a": want["a"] + np.float32(0.05), "b": want["b"]}
    at = float(np.max(np.abs(edge["a"].astype("f8") - want["a"])))
    assert judge("p", "o", want, edge, _parity(tolerance={"atol": at, "rtol": 0})).ok
    assert not judge("p", "o", want, edge, _parity(tolerance={"atol": at * 0.999, "rtol": 0})).ok
    # engine.parity replaces only the default tolerance
    default = _parity(tolerance={"atol": 0.0, "rtol": 0}).tolerance
    assert judge("p", "o", want, have, loose_a, default).ok is True


def test_every_tensor_loader_gives_ort_bytes_not_a_model_proto(tmp_path) -> None:
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from stages.tensorrt.build import onnx_with_every_tensor

    path = _identity_model(tmp_path)
    feeds = {"in_a": np.ones(4, dtype="f4"), "in_b": np.ones(4, dtype="f4")}
    with OnnxrtRunner(onnx_with_every_tensor(path)) as runner:
        outputs = runner.infer(feeds)
    assert set(outputs) == {"a", "b", "mid_a", "mid_b"}


# --------------------------------------------------------------------------- CUDA graphs
class _FakeRuntime:
    def __init__(self, logger, engine):
        self.engine = engine
        self.engine_host_code_allowed = False

    def deserialize_cuda_engine(self, plan):
        return self.engine if self.engine_host_code_allowed else None


def _fake_trt(engine):
    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    return SimpleNamespace(Logger=Logger, Runtime=lambda logger: _FakeRuntime(logger, engine))


def test_cuda_graph_check_allows_host_code_and_refuses_a_none_engine() -> None:
    from stages.tensorrt.cuda_graphs import deserialize

    assert deserialize(_fake_trt("engine"), b"plan") == "engine"  # only with the flag set
    with pytest.raises(StageError, match="could not deserialize the engine"):
        deserialize(_fake_trt(None), b"plan")


def test_tensorrt_calls_that_return_false_are_errors() -> None:
    from stages.tensorrt.cuda_graphs import _check

    _check(True, "set_input_shape(x)")
    with pytest.raises(StageError, match=r"set_input_shape\(x\) returned False"):
        _check(False, "set_input_shape(x)")


def test_a_missing_cuda_binding_is_found_before_the_build() -> None:
    from stages.engine import module_present

    assert module_present("json.decoder") is True
    assert module_present("no_such_parent_package.bindings") is False  # no exception


# --------------------------------------------------------------------------- Q/DQ
def _matmul_model(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype("f4"), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [w],
    )
    path = tmp_path / "fp32.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _static(src, out, **kw):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):  # positive activations: an asymmetric range would shift its zero
            rng = np.random.default_rng(1)
            self.items = iter([{"x": rng.uniform(0, 3, (4, 8)).astype("f4")} for _ in range(4)])

        def get_next(self):
            return next(self.items, None)

    quantize_static(src, out, Reader(), quant_format=QuantFormat.QDQ, **kw)


def test_asymmetric_qdq_is_caught_and_the_int8_static_settings_are_symmetric(tmp_path) -> None:
    from onnxruntime.quantization import QuantType

    from stages.engine import asymmetric_qdq

    src = _matmul_model(tmp_path)
    _static(src, tmp_path / "asym.onnx", activation_type=QuantType.QUInt8)
    flagged = asymmetric_qdq(tmp_path / "asym.onnx")
    assert flagged and "zero point [" in flagged[0]
    # what stages/quant/methods.py now passes for int8-static
    _static(
        src,
        tmp_path / "sym.onnx",
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    assert asymmetric_qdq(tmp_path / "sym.onnx") == []


def test_the_int8_static_quantizer_asks_for_symmetric_int8() -> None:
    import inspect

    from stages.quant import methods as _quantizers

    source = inspect.getsource(_quantizers._static)
    assert "activation_type=QuantType.QInt8" in source
    assert '"ActivationSymmetric": True' in source and '"WeightSymmetric": True' in source


# --------------------------------------------------------------------------- Triton layout
def _trt_values(portable: bool = False):
    from schemas.release import CudaGraphs, EngineConfig, ServingConfig
    from stages import engine as build_engine
    from tests.conftest import model_info

    cfg = EngineConfig.model_validate({"profiles": [{"name": "prefill"}, {"name": "decode"}]})
    info = model_info(
        dims={"batch": {"min": 1, "opt": 2, "max": 8}},
        inputs=[{"name": "x", "axes": ["batch", 4], "dtype": "float32"}],
    )
    profiles = build_engine.derive_profiles(cfg, info)
    return build_engine.triton_trt_values(
        profiles, ServingConfig(max_batch_size=4), 8, CudaGraphs(batch_sizes=[1]), "9.0", portable
    )


def test_the_tensorrt_triton_entry_resolves_every_file_it_names(tmp_path) -> None:
    from stages import engine as build_engine

    folder = tmp_path / build_engine.trt_model_dir("tiny")
    build_engine.render_trt_triton(tmp_path, "tiny", _trt_values())
    assert build_engine.check_trt_layout(folder) == [
        "model_sm90.plan: not in tiny-trt/1/ (Triton could not load it)"
    ]
    (folder / "1").mkdir()
    (folder / "1" / "model_sm90.plan").write_bytes(b"plan")
    assert build_engine.check_trt_layout(folder) == []
    config = build_engine.render_serving_parse(folder / "config.pbtxt")
    assert list(config.instance_group[0].profile) == ["0", "1"]  # decode is served too
    assert not config.default_model_filename


def test_a_hardware_compatible_engine_is_the_default_for_other_gpus(tmp_path) -> None:
    from stages import engine as build_engine

    build_engine.render_trt_triton(tmp_path, "tiny", _trt_values(portable=True))
    folder = tmp_path / build_engine.trt_model_dir("tiny")
    config = build_engine.render_serving_parse(folder / "config.pbtxt")
    assert config.default_model_filename == "model_sm90.plan"


def test_the_shared_timing_cache_is_replaced_atomically_and_the_lock_file_dropped(
    tmp_path, monkeypatch
) -> None:
    import os

    from stages.tensorrt import build as _tensorrt

    local = tmp_path / "work" / "timing.cache"
    local.parent.mkdir()
    local.write_bytes(b"new cache")
    (tmp_path / "work" / "timing.cache.lock").write_text("")
    shared = tmp_path / "caches" / "tiny.cache"
    shared.parent.mkdir()
    shared.write_bytes(b"old cache")
    seen = []
    real_replace = os.replace

    def replace(src, dst):  # the shared file is only ever swapped in whole
        seen.append((shared.read_bytes(), os.path.basename(src)))
        real_replace(src, dst)

    monkeypatch.setattr(_tensorrt.os, "replace", replace)
    _tensorrt.save_timing_cache(local, shared)
    assert seen == [(b"old cache", f".tiny.cache.{os.getpid()}.tmp")]
    assert shared.read_bytes() == b"new cache"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "timing.cache",
        "tiny.cache",
    ]
