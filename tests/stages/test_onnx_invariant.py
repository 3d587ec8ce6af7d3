"""stages/onnx/invariant.py: attention whose rows do not depend on their padding. A toy
attention (scores, additive mask, softmax, a no-op Cast, probabilities x V) gives bit for
bit the same row at every left padding once rewritten, where onnxruntime's Softmax and its
one-row MatMul do not; the rewrite computes the same softmax, in float16 too, and leaves
what it does not cover alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from stages.onnx import invariant

HEAD = 32


def _attention(opset: int = 17, dtype: int = TensorProto.FLOAT, axis: int = -1) -> Any:
    """q [b, 1|m, d], k/v [b, L, d], bias [b, 1, L] -> softmax(q k^T + bias) v."""
    inputs = [
        helper.make_tensor_value_info(n, dtype, ["b", r, HEAD if n != "bias" else "L"])
        for n, r in (("q", "m"), ("k", "L"), ("v", "L"), ("bias", 1))
    ]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=axis),
        helper.make_node("Cast", ["probs"], ["probs_cast"], to=dtype),  # as the exporter does
        helper.make_node("MatMul", ["probs_cast", "v"], ["out"]),
    ]
    out = helper.make_tensor_value_info("out", dtype, ["b", "m", HEAD])
    graph = helper.make_graph(nodes, "attention", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


THREADS = [1]  # set by the test below: onnxruntime splits work by thread count


def _run(model: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS[0]
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return np.asarray(session.run(["out"], feeds)[0])


def _feeds(pad: int, queries: int, keys: int = 37, dtype: Any = np.float32) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    q = rng.normal(0, 1, (1, queries, HEAD))
    k, v = rng.normal(0, 1, (2, 1, keys, HEAD))
    lead = np.zeros((1, pad, HEAD))
    bias = np.concatenate([np.full(pad, np.finfo(dtype).min), np.zeros(keys)])[None, None]
    return {
        "q": q.astype(dtype),
        "k": np.concatenate([lead, k], 1).astype(dtype),
        "v": np.concatenate([lead, v], 1).astype(dtype),
        "bias": bias.astype(dtype),
    }


PADS = [*range(1, 40), 255, 256, 257, 300, 511, 700]


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("keys", [37, 300, 600, 1100])  # within and past a 256-key block
@pytest.mark.parametrize("queries", [1, 3], ids=["decode step", "prefill chunk"])
def test_a_row_is_bit_identical_at_every_padding_once_rewritten(
    queries: int, keys: int, threads: int
) -> None:
    THREADS[0] = threads
    plain, model = _attention(), _attention()
    assert invariant.rewrite(model) == (1, 1)
    alone = _run(model, _feeds(0, queries, keys))
    reference = _run(plain, _feeds(0, queries, keys))
    moved = [
        p for p in PADS if not np.array_equal(_run(plain, _feeds(p, queries, keys)), reference)
    ]
    if keys == 37:
        assert moved  # onnxruntime's own kernels do move with the padding (here, always)
    for pad in PADS:
        assert np.array_equal(_run(model, _feeds(pad, queries, keys)), alone), pad
    np.testing.assert_allclose(alone, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [15, 17, 18, 21])
def test_every_supported_opset_computes_the_softmax(opset: int) -> None:
    plain, model = _attention(opset), _attention(opset)
    assert invariant.rewrite(model) == (1, 1)
    onnx.checker.check_model(model, full_check=True)
    feeds = _feeds(5, 2)
    np.testing.assert_allclose(_run(model, feeds), _run(plain, feeds), rtol=0, atol=1e-6)


def test_a_float16_graph_takes_ones_of_its_own_type() -> None:
    plain = _attention(dtype=TensorProto.FLOAT16)
    model = _attention(dtype=TensorProto.FLOAT16)
    assert invariant.rewrite(model) == (1, 1)
    feeds = _feeds(3, 1, dtype=np.float16)
    got, want = _run(model, feeds), _run(plain, feeds)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-3)


def test_what_the_rewrite_does_not_cover_is_left_as_it_was() -> None:
    for model in (_attention(opset=14), _attention(axis=1)):  # old opset; not the last axis
        before = model.SerializeToString()
        assert invariant.rewrite(model) == (0, 0)
        assert model.SerializeToString() == before


def test_static_quantization_never_takes_the_sum_of_exponentials() -> None:
    """Quantized to 8 bits, small exponentials would round to 0 in the sum and not in the
    numerator; the scores and probabilities x V products stay candidates by their names."""
    from types import SimpleNamespace

    from stages.quant.methods import Quantizer

    model = _attention()
    invariant.rewrite(model)
    quantizer = Quantizer.__new__(Quantizer)
    quantizer.cfg = SimpleNamespace(op_types=["MatMul"], method="int8-static")  # type: ignore[assignment]
    quantizer.static, quantizer._skeleton = True, model
    names = quantizer.candidates()
    matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    assert [n for n in matmuls if n.endswith(invariant.SUMS)] and not [
        n for n in names if n.endswith(invariant.SUMS)
    ]
    assert len(names) == len(matmuls) - 1


@pytest.mark.parametrize("opset", [17, 18])
def test_onnxruntimes_symbolic_shape_inference_follows_the_rewrite(opset: int) -> None:
    """Quantization's pre-processing runs it: where it stops (a Mod, a CastLike, ReduceMax's
    axes input), every decoder fell back to plain ONNX shape inference."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = _attention(opset)
    assert invariant.rewrite(model) == (1, 1)
    inferred = SymbolicShapeInference.infer_shapes(model, 2**31 - 1, False, False, 0)
    shapes = {v.name for v in inferred.graph.value_info}
    assert "probs" in shapes and "out" in {o.name for o in inferred.graph.output}


@pytest.mark.parametrize("keys", [37, 300])
@pytest.mark.parametrize("queries", [2, 17, 66])
def test_a_decode_steps_query_equals_the_same_query_in_a_full_pass(queries: int, keys: int) -> None:
    """A cached decode step asks one query; a full recompute asks every position's at once.
    The same query must come out the same either way (kvcheck's comparison, bit for bit)."""
    THREADS[0] = 2
    model = _attention()
    invariant.rewrite(model)
    full = _feeds(0, queries, keys)
    last = {**full, "q": full["q"][:, -1:]}
    assert np.array_equal(_run(model, full)[:, -1:], _run(model, last))
