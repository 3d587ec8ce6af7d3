"""stages/quant/perchannel.py: the whole-array per-channel quantization gives onnxruntime's
own result, bit for bit, on weights built to reach every branch of its arithmetic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer

from stages.quant import perchannel


def _model(w: np.ndarray, path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, w.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    graph = helper.make_graph([node], "g", [x], [y], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def _quantized(src: Path, out: Path, fast: bool, **kw: object) -> dict[str, np.ndarray]:
    args = dict(op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8)
    args.update(kw)
    if fast:
        with perchannel.vectorized():
            quantize_dynamic(src, out, **args)  # type: ignore[arg-type]
    else:
        quantize_dynamic(src, out, **args)  # type: ignore[arg-type]
    m = onnx.load(out)
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer} | {
        "__order__": np.array([t.name for t in m.graph.initializer]),
        "__types__": np.array([t.data_type for t in m.graph.initializer]),
    }


def _same(tmp: Path, w: np.ndarray, **kw: object) -> None:
    src = _model(w, tmp / "m.onnx")
    slow = _quantized(src, tmp / "slow.onnx", False, **kw)
    fast = _quantized(src, tmp / "fast.onnx", True, **kw)
    assert slow.keys() == fast.keys()
    for name in slow:
        assert slow[name].dtype == fast[name].dtype, name
        assert slow[name].shape == fast[name].shape, name
        # bytes, not values: a NaN or a -0.0 would compare equal by value and differ
        assert slow[name].tobytes() == fast[name].tobytes(), name


def _weights(rng: np.random.Generator) -> np.ndarray:
    """A real-looking weight with every awkward channel: an outlier column, an all-zero
    one, a constant one, all-positive and all-negative ones, one of subnormal size (its
    scale is below float32's tiny: onnxruntime's fallback), one at float32's edge."""
    w = rng.normal(0, 0.02, (64, 24)).astype(np.float32)
    w[:, 1] *= 300
    w[:, 2] = 0
    w[:, 3] = 0.5
    w[:, 4] = np.abs(w[:, 4])
    w[:, 5] = -np.abs(w[:, 5])
    w[:, 6] = 1e-40
    w[:, 7] = np.float32(3e38) * np.sign(w[:, 7])
    w[0, 8] = -1e-30  # one tiny negative value in a zero column
    w[1:, 8] = 0
    return w


@pytest.mark.parametrize(
    "kw",
    [
        {},  # what the quantize stage runs: signed, symmetric, full range
        {"weight_type": QuantType.QUInt8},  # unsigned: asymmetric, a zero point per channel
        {"reduce_range": True},  # 7-bit range
        {"weight_type": QuantType.QUInt8, "reduce_range": True},
        {"extra_options": {"WeightSymmetric": False}},  # signed but asymmetric
        {"weight_type": QuantType.QUInt8, "extra_options": {"WeightSymmetric": True}},
    ],
    ids=["int8", "uint8", "int8-reduced", "uint8-reduced", "int8-asymmetric", "uint8-symmetric"],
)
def test_every_awkward_channel_quantizes_as_onnxruntime_does(tmp_path: Path, kw: dict) -> None:
    _same(tmp_path, _weights(np.random.default_rng(0)), **kw)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    log_scale=st.floats(-38, 37),
    shift=st.floats(-2, 2),
    seed=st.integers(0, 2**32 - 1),
    unsigned=st.booleans(),
)
def test_any_weight_quantizes_as_onnxruntime_does(
    tmp_path: Path, rows: int, cols: int, log_scale: float, shift: float, seed: int, unsigned: bool
) -> None:
    rng = np.random.default_rng(seed)
    w = ((rng.standard_normal((rows, cols)) + shift) * 10.0**log_scale).astype(np.float32)
    w[~np.isfinite(w)] = 0
    kw = {"weight_type": QuantType.QUInt8} if unsigned else {}
    _same(tmp_path, w, **kw)


def test_overrides_and_a_minimum_range_go_to_onnxruntime(tmp_path: Path) -> None:
    """What the fast path does not compute is left to onnxruntime's loop, which runs."""
    w = _weights(np.random.default_rng(1))
    calls: list[str] = []
    original = perchannel._per_channel

    def spy(quantizer, name, *a):  # type: ignore[no-untyped-def]
        result = original(quantizer, name, *a)
        calls.append("fast" if result else "onnxruntime")
        return result

    perchannel._per_channel = spy  # type: ignore[assignment]
    try:
        _same(tmp_path, w, extra_options={"MinimumRealRange": 0.5})
        _same(tmp_path, w, extra_options={"TensorQuantOverrides": {"w": [{"axis": 1}]}})
    finally:
        perchannel._per_channel = original
    assert calls and set(calls) == {"onnxruntime"}


def test_the_class_attribute_is_restored_even_on_an_error() -> None:
    before = ONNXQuantizer.quantize_weight_per_channel_impl
    with pytest.raises(RuntimeError), perchannel.vectorized():
        assert ONNXQuantizer.quantize_weight_per_channel_impl is not before
        raise RuntimeError("boom")
    assert ONNXQuantizer.quantize_weight_per_channel_impl is before
