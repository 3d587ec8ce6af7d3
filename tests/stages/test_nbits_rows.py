"""Weight-only graphs (MatMulNBits) with `compute: int8` (onnxruntime's accuracy_level 4):
the kernel quantizes each row's activations alone, in blocks along K, so a row's result is
the same to the bit alone and beside any batch-mates, at any batch size and thread count
(issue 41: a served row never depends on its neighbours). The method writes the level the
spec asks for."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def _graph(k: int, n: int, bits: int, level: int, seed: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", n])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(
        model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=level
    )
    q.process()
    out: bytes = q.model.model.SerializeToString()
    assert "MatMulNBits" in {node.op_type for node in q.model.model.graph.node}
    return out


def _session(model: bytes, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@settings(max_examples=12, deadline=None)
@given(
    k=st.sampled_from([32, 48, 96, 576]),
    n=st.sampled_from([8, 64, 200]),
    bits=st.sampled_from([4, 8]),
    rows=st.integers(2, 40),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_an_int8_compute_row_is_the_same_alone_and_beside_any_batch(
    k: int, n: int, bits: int, rows: int, seed: int, threads: int
) -> None:
    rng = np.random.default_rng(seed)
    session = _session(_graph(k, n, bits, 4, seed), threads)
    probe = rng.standard_normal((1, k)).astype(np.float32)
    # batch-mates on other scales, an outlier channel among them, the probe at any row
    mates = rng.standard_normal((rows - 1, k)).astype(np.float32) * 10.0 ** rng.uniform(
        -3, 3, (rows - 1, 1)
    ).astype(np.float32)
    mates[:, int(rng.integers(k))] *= 300.0
    at = int(rng.integers(rows))
    batch = np.concatenate([mates[:at], probe, mates[at:]])
    alone = session.run(None, {"X": probe})[0]
    beside = session.run(None, {"X": batch})[0][at : at + 1]
    assert np.array_equal(alone, beside)


@pytest.mark.parametrize("compute,level", [("int8", 4), ("float", 0)])
def test_the_method_writes_the_accuracy_level_compute_asks_for(
    tmp_path: Any, compute: str, level: int
) -> None:
    import onnx

    from schemas.spec.quantization import Int4WeightOnly
    from stages.quant import methods

    src = tmp_path / "fp32.onnx"
    src.write_bytes(
        onnx.helper.make_model(
            onnx.helper.make_graph(
                [onnx.helper.make_node("MatMul", ["X", "W"], ["Y"])],
                "g",
                [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["b", 64])],
                [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["b", 16])],
                [
                    onnx.numpy_helper.from_array(
                        np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32),
                        "W",
                    )
                ],
            ),
            opset_imports=[onnx.helper.make_opsetid("", 18)],
        ).SerializeToString()
    )
    # the method's own fields (a whole spec's calibration is not what this is about)
    cfg = Int4WeightOnly.model_construct(method="int4-weight-only", compute=compute)

    class Q:  # what _int4 reads of the quantizer
        pass

    q = Q()
    q.cfg = cfg  # type: ignore[attr-defined]
    out = tmp_path / "q.onnx"
    methods._METHODS["int4-weight-only"](q, src, out, [], None, False)  # type: ignore[arg-type]
    (node,) = [n for n in onnx.load(out).graph.node if n.op_type == "MatMulNBits"]
    assert {a.name: a.i for a in node.attribute}.get("accuracy_level", 0) == level


def test_evaluate_decodes_a_float_path_graph_one_prompt_a_call(tmp_path: Any) -> None:
    """evaluate batches the shipped graph's greedy decoding only when its rows cannot move
    each other: MatMulNBits on the int8 path can be batched, on the float path it cannot."""
    from stages import evaluate

    for level, apart in ((4, True), (0, False)):
        path = tmp_path / f"level{level}.onnx"
        path.write_bytes(_graph(64, 16, 4, level, 0))
        assert evaluate.rows_independent(path) is apart
