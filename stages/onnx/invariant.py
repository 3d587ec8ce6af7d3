"""Attention written so that a row's result does not depend on its padding (issue 41).

A served batch left-pads every row to the longest cache, so the same request's keys sit at
other columns beside other requests than alone. Masked columns weigh exactly 0, but two of
onnxruntime's CPU kernels sum over the key axis in vector lanes, so moving the real keys by
a few columns regroups the sum and its last bit moves:
- `Softmax` (its sum of exponentials; a shift by a multiple of 8 columns is exact here);
- `MatMul` with one row on the left (a decode step's probabilities x V): its M = 1 path
  sums along K in lanes (a shift by 4 is exact), where its M >= 2 path accumulates each
  output over K in order, so leading zeros change nothing.
A 1e-7 difference is harmless in float, but in an INT8 graph it can move an activation
across a rounding step, and the same greedy request gave other logprobs beside 15 others
than alone. So each `Softmax` over the last axis becomes max, exp, a sum taken as a MatMul
against ones (M >= 2, in order) and a division; and a MatMul reading its probabilities
(through a Cast or Identity) runs on one extra row (the last repeated) and drops it. On
tiny-gpt2 the decode step of a row is then bit-identical at any padding and batch size,
in FP32 and INT8 (tests/stages/test_engine_rows.py). What it costs is one small MatMul per
attention and one extra row in the decode-step product (V is read once either way).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SUM_WIDTH = 16  # columns of ones the sum is taken against: the GEMM path, not a dot product
PASS_THROUGH = ("Cast", "Identity")  # value-preserving hops between a softmax and its MatMul
MIN_OPSET = 15  # CastLike (the ones take the probabilities' float type), Shape start/end


def rewrite(model: Any) -> int:
    """Rewrite `model` (an onnx ModelProto) in place; the number of softmaxes rewritten
    (0 when its opset predates what the rewrite needs: the graph is left as it was)."""
    from onnx import helper, numpy_helper

    opset = _opset(model)
    if opset < MIN_OPSET:
        return 0
    graph = model.graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in _infos(graph) if _has_shape(v)}
    softmax = [n for n in graph.node if n.op_type == "Softmax" and _last_axis(n, ranks, opset)]
    if not softmax:
        return 0
    rewritten = {id(n) for n in softmax}
    probs = {n.output[0] for n in softmax}
    for node in graph.node:  # through value-preserving hops, in graph order
        if node.op_type in PASS_THROUGH and node.input and node.input[0] in probs:
            probs.add(node.output[0])

    consts: dict[str, Any] = {}

    def const(name: str, value: list[int]) -> str:
        name = f"shipyard_invariant_{name}"
        consts.setdefault(name, numpy_helper.from_array(np.array(value, np.int64), name))
        return name

    def make(op: str, inputs: list[str], output: str, **attrs: Any) -> Any:
        return helper.make_node(op, inputs, [output], name=output, **attrs)

    def one_more_row(x: str, p: str) -> tuple[list[Any], str]:
        """x [..., m, n] -> [..., m + 1, n]: its last row again."""
        last = make("Slice", [x, const("minus_one", [-1]), const("end", [2**62]),
                              const("minus_two", [-2])], f"{p}/last_row")  # fmt: skip
        return [last, make("Concat", [x, f"{p}/last_row"], f"{p}/plus_one", axis=-2)], (
            f"{p}/plus_one"
        )

    def first_rows(x: str, like: str, out: str, p: str) -> list[Any]:
        """x's first m rows (axis -2), m = like's rows."""
        return [
            make("Shape", [like], f"{p}/rows", start=-2, end=-1),
            helper.make_node(
                "Slice", [x, const("zero", [0]), f"{p}/rows", const("minus_two", [-2])], [out],
                name=f"{p}/first_rows",
            ),
        ]  # fmt: skip

    def reduce_max(x: str, out: str) -> Any:
        if opset >= 18:  # axes became an input
            return make("ReduceMax", [x, const("minus_one", [-1])], out, keepdims=1)
        return make("ReduceMax", [x], out, axes=[-1], keepdims=1)

    nodes: list[Any] = []
    for node in graph.node:
        if id(node) in rewritten:
            x, y = node.input[0], node.output[0]
            p = f"{y}/row_invariant"
            extra, exp_plus = one_more_row(f"{p}/exp", p)
            nodes += [
                reduce_max(x, f"{p}/max"),
                make("Sub", [x, f"{p}/max"], f"{p}/shifted"),
                make("Exp", [f"{p}/shifted"], f"{p}/exp"),
                make("Shape", [x], f"{p}/keys", start=-1),
                make("Concat", [f"{p}/keys", const("width", [SUM_WIDTH])], f"{p}/ones_shape",
                     axis=0),
                make("ConstantOfShape", [f"{p}/ones_shape"], f"{p}/ones_float",
                     value=numpy_helper.from_array(np.array([1.0], np.float32))),
                make("CastLike", [f"{p}/ones_float", x], f"{p}/ones"),
                *extra,
                make("MatMul", [exp_plus, f"{p}/ones"], f"{p}/sums"),
                make("Slice", [f"{p}/sums", const("zero", [0]), const("one", [1]),
                               const("minus_one", [-1])], f"{p}/sum_plus"),
                *first_rows(f"{p}/sum_plus", x, f"{p}/sum", p),
                helper.make_node("Div", [f"{p}/exp", f"{p}/sum"], [y], name=f"{p}/normalize"),
            ]  # fmt: skip
        elif node.op_type == "MatMul" and node.input[0] in probs:
            a, out = node.input[0], node.output[0]
            p = f"{out}/row_invariant"
            extra, a_plus = one_more_row(a, p)
            nodes += [
                *extra,
                make("MatMul", [a_plus, node.input[1]], f"{p}/product"),
                *first_rows(f"{p}/product", a, out, p),
            ]
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(consts.values())
    return len(softmax)


def _opset(model: Any) -> int:
    return int(next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0))


def _infos(graph: Any) -> list[Any]:
    return [*graph.value_info, *graph.input, *graph.output]


def _has_shape(info: Any) -> bool:
    return bool(info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"))


def _last_axis(node: Any, ranks: dict[str, int], opset: int) -> bool:
    """Whether the softmax normalizes over the last axis (opset 13+, which MIN_OPSET
    implies: one axis, default -1)."""
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    rank = ranks.get(node.input[0])
    return bool(axis == -1 or (rank is not None and axis == rank - 1))
