"""stages/quant/pertoken.py: dynamic INT8 with one activation scale per token. A token's
result depends on its own activations only (batch-mates, free slots, chunking), equals the
per-token arithmetic done in numpy, and onnxruntime's optimizer cannot fuse it into a kernel
that reads one scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from stages.quant import pertoken

HIDDEN, OUT = 48, 40


def _two_layers(path: Path, opset: int) -> tuple[np.ndarray, np.ndarray]:
    """x -> MatMul -> Tanh -> MatMul (+ a second MatMul on the same input: a shared
    quantization), with an outlier input channel like a real decoder's."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.1, (HIDDEN, HIDDEN)).astype(np.float32)
    w2 = rng.normal(0, 0.1, (HIDDEN, OUT)).astype(np.float32)
    w1[3] *= 20
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", HIDDEN])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
        helper.make_node("Tanh", ["h"], ["t"], name="act"),
        helper.make_node("MatMul", ["t", "w2"], ["y"], name="second"),
        helper.make_node("MatMul", ["t", "w2b"], ["z"], name="sibling"),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (w2 * 2, "w2b"))]
    graph = helper.make_graph(nodes, "g", [x], [y, z], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return w1, w2


def _quantized(tmp: Path, opset: int = 17) -> tuple[Path, np.ndarray, np.ndarray]:
    w1, w2 = _two_layers(tmp / "f.onnx", opset)
    quantize_dynamic(
        tmp / "f.onnx",
        tmp / "q.onnx",
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        weight_type=QuantType.QInt8,
    )
    model = onnx.load(tmp / "q.onnx")
    assert pertoken.rewrite(model) == 2  # x and t: the sibling shares t's quantization
    onnx.save(model, tmp / "t.onnx")
    return tmp / "t.onnx", w1, w2


def _session(path: Path, optimized: bool = True) -> Any:
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _batch(rows: int, tokens: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 1, (rows, tokens, HIDDEN)).astype(np.float32)
    x[..., 3] *= 30  # an outlier channel
    return x


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMax's axes: attribute, then input
def test_a_tokens_result_does_not_depend_on_its_batch_mates(tmp_path: Path, opset: int) -> None:
    path, _, _ = _quantized(tmp_path, opset)
    session = _session(path)
    x = _batch(6, 5, 1)
    together = session.run(None, {"x": x})
    loud = x.copy()
    loud[1:] *= 1000  # neighbours a thousand times larger
    loud[0, 1:] = 0  # and padding-like zero tokens beside it in its own row
    beside = session.run(None, {"x": loud})
    alone = session.run(None, {"x": x[:1, :1]})
    for got, mates, single in zip(together, beside, alone, strict=True):
        assert np.array_equal(got[0, 0], mates[0, 0])
        assert np.array_equal(got[0, 0], single[0, 0])
    # per-call scales (onnxruntime's own graph) fail the same check
    raw = _session(tmp_path / "q.onnx")
    assert not np.array_equal(raw.run(None, {"x": x})[0][0, 0], raw.run(None, {"x": loud})[0][0, 0])


def test_the_graph_computes_per_token_int8_and_is_not_fused_into_one_scale(
    tmp_path: Path,
) -> None:
    path, w1, _ = _quantized(tmp_path)
    x = _batch(3, 4, 2)
    # numpy: each token's max|x| / 127, weights per output channel as onnxruntime stores them
    scale = np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(127), np.float32(1e-30))
    q = np.round(x / scale)
    w_scale = np.abs(w1).max(0) / np.float32(127)
    wq = np.clip(np.round(w1 / w_scale), -127, 127)
    want = np.tanh((q @ wq) * w_scale * scale)
    model = onnx.load(path)
    model.graph.output.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, None))
    onnx.save(model, tmp_path / "probe.onnx")
    for optimized in (True, False):  # onnxruntime's fusions change nothing
        got = _session(tmp_path / "probe.onnx", optimized).run(["t"], {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_a_scale_product_read_by_anything_but_a_mul_is_refused(tmp_path: Path) -> None:
    _two_layers(tmp_path / "f.onnx", 17)
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx", op_types_to_quantize=["MatMul"])
    model = onnx.load(tmp_path / "q.onnx")
    product = next(
        n.output[0] for n in model.graph.node if n.op_type == "Mul" and "scale" in n.input[0]
    )
    model.graph.node.append(helper.make_node("Relu", [product], ["leak"], name="leak"))
    with pytest.raises(ValueError, match="'leak' \\(Relu\\) reads the per-token scale product"):
        pertoken.rewrite(model)


def test_a_graph_without_dynamic_quantization_is_left_alone(tmp_path: Path) -> None:
    _two_layers(tmp_path / "f.onnx", 17)
    model = onnx.load(tmp_path / "f.onnx")
    before = model.SerializeToString()
    assert pertoken.rewrite(model) == 0
    assert model.SerializeToString() == before


def test_a_quantization_read_by_anything_but_matmulinteger_keeps_its_one_scale(
    tmp_path: Path,
) -> None:
    """ConvInteger (and QAttention) take one activation scale: a per-token one would be a
    shape error or a wrong answer there, so their DynamicQuantizeLinear stays."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.1, (8, 4, 3)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv")
    graph = helper.make_graph([conv], "g", [x], [y], [numpy_helper.from_array(w, "w")])
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "c.onnx"
    )
    quantize_dynamic(tmp_path / "c.onnx", tmp_path / "cq.onnx", op_types_to_quantize=["Conv"])
    model = onnx.load(tmp_path / "cq.onnx")
    assert "ConvInteger" in {n.op_type for n in model.graph.node}
    before = model.SerializeToString()
    assert pertoken.rewrite(model) == 0
    assert model.SerializeToString() == before


def test_the_check_view_multiplies_the_activation_before_its_rounding(tmp_path: Path) -> None:
    """kvcheck's view of a per-token graph (pertoken.unrounded): the same integer weights,
    the activation divided by its scale but not rounded; so it is the float product with
    the dequantized weights, and the shipped graph differs from it by rounding only."""
    path, w1, _ = _quantized(tmp_path)
    model = onnx.load(path)
    assert pertoken.unrounded(model) == 3  # first, second and sibling
    onnx.save(model, tmp_path / "view.onnx")
    x = _batch(2, 3, 4)
    model.graph.output.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, None))
    onnx.save(model, tmp_path / "probe.onnx")
    got = _session(tmp_path / "probe.onnx").run(["t"], {"x": x})[0]
    w_scale = np.abs(w1).max(0) / np.float32(127)
    dequantized = np.clip(np.round(w1 / w_scale), -127, 127) * w_scale
    np.testing.assert_allclose(got, np.tanh(x @ dequantized), rtol=0, atol=2e-5)
    shipped = _session(path).run(["y"], {"x": x})[0]
    view = _session(tmp_path / "view.onnx").run(["y"], {"x": x})[0]
    assert not np.array_equal(shipped, view)  # the rounding is gone, nothing else
    np.testing.assert_allclose(shipped, view, rtol=0, atol=0.05 * np.abs(view).max())
