"""Attention written so that a row's result does not depend on its padding (issue 41).

A served batch left-pads every row to the longest cache, so the same request's keys sit at
other columns beside other requests than alone. Masked columns weigh exactly 0, but
onnxruntime's CPU kernels sum over the key axis in ways that depend on where the keys sit:
`Softmax` sums its exponentials in vector lanes (a shift by 8 columns is exact here, 1-7
are not), a one-row `MatMul` (a decode step's probabilities x V) sums K in lanes, and every
`MatMul` sums K in blocks of 256 and splits K between threads by its length. Moving the
real keys by a few columns regroups the sum and its last bit moves. Harmless in float, but
in an INT8 graph it can move an activation across a rounding step: the same greedy request
gave other logprobs beside 15 others than alone.

So both sums over the keys are taken in an order padding cannot change:
1. the keys are left-padded with zeros to a multiple of KEY_BLOCK (64), so the blocks end
   where the row ends, wherever it starts;
2. each block is one MatMul of K = KEY_BLOCK, inside one of onnxruntime's K blocks (256)
   and never split between threads (its keys at the same place in it whatever the
   padding: the same arithmetic, and a zero block gives exactly 0);
3. the blocks' results are added in order by CumSum (left to right: leading zero blocks
   add exactly 0) and the last is taken.
Each `Softmax` over the last axis becomes max, exp, that sum of the exponentials (against a
column of ones) and a division; each MatMul reading its probabilities (directly or through
a Cast or Identity) becomes that sum of probabilities x V. Bit-identical rows at any
padding, with 1, 2 or 4 threads, up to at least 1,100 keys x 1,500 padding
(tests/stages/test_onnx_invariant.py), and through the engine in FP32 and INT8
(tests/runtime/test_generation_rows.py). The cost: up to KEY_BLOCK - 1 zero keys per row in
both products and a copy of V per attention; on gpt2-small, a decode step of 16 rows on a
256-token past 1.12x FP32's own and a 256-token prefill 1.13x (blocks of 256 were 1.30x
and 1.21x: benchmarks/bench_row_invariance.py, docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

KEY_BLOCK = 64  # keys summed a block at a time: within one of onnxruntime's GEMM K blocks (256)
SUM_WIDTH = 16  # columns of ones the exponentials are summed against (the GEMM path)
PASS_THROUGH = ("Cast", "Identity")  # value-preserving hops between a softmax and its MatMul
MIN_OPSET = 15  # Shape start/end
SUMS = "/row_invariant/sum_blocks"  # the exponentials' sum: never quantized


class Rewritten(NamedTuple):
    softmaxes: int  # normalized with a padding-proof sum
    products: int  # probabilities x V MatMuls summed the same way

    def __bool__(self) -> bool:
        return bool(self.softmaxes)


def rewrite(model: Any) -> Rewritten:
    """Rewrite `model` (an onnx ModelProto, weightless is enough) in place; what it
    rewrote (nothing when its opset predates what the rewrite needs)."""
    import onnx
    from onnx import helper, numpy_helper

    opset = _opset(model)
    if opset < MIN_OPSET:
        return Rewritten(0, 0)
    graph = model.graph
    # nodes by their index in the graph (protobuf hands out new wrappers: no id())
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    ranks, types = _ranks(inferred), _types(inferred)
    # the padding and the ones are made in the scores' own float type (no CastLike:
    # onnxruntime's symbolic shape inference, which quantization runs, cannot follow it)
    softmax = [
        i
        for i, n in enumerate(graph.node)
        if n.op_type == "Softmax" and _last_axis(n) and n.input[0] in types
    ]
    if not softmax:
        return Rewritten(0, 0)
    rewritten = set(softmax)
    scores = _score_products(graph, [graph.node[i].input[0] for i in softmax])
    probs = {graph.node[i].output[0] for i in softmax}
    for node in graph.node:  # through value-preserving hops, in graph order
        if node.op_type in PASS_THROUGH and node.input and node.input[0] in probs:
            probs.add(node.output[0])

    consts: dict[str, Any] = {}

    def const(name: str, value: Any) -> str:
        name = f"shipyard_invariant_{name}"
        consts.setdefault(name, numpy_helper.from_array(np.array(value, np.int64), name))
        return name

    def make(op: str, inputs: list[str], output: str, **attrs: Any) -> Any:
        return helper.make_node(op, inputs, [output], name=output, **attrs)

    def typed(name: str, value: np.ndarray) -> str:
        consts.setdefault(name, numpy_helper.from_array(value, name))
        return name

    def blocks(
        x: str, axis: int, p: str, extra: int = 0, fill: float = 0.0, split: bool = True
    ) -> tuple[list[Any], str, str]:
        """x with `fill` before its key axis (-1: scores or probabilities, -2: V) to a
        multiple of KEY_BLOCK keys (and `extra` more blocks of it), then that axis split in
        two: [blocks, KEY_BLOCK]. The nodes, the result, and the padded x."""
        block = const("block", [KEY_BLOCK])
        around = {"start": axis, "end": axis + 1} if axis < -1 else {"start": axis}
        lead, halves = f"{p}/lead", [f"{p}/blocks", block]
        nodes = [
            make("Shape", [x], f"{p}/keys", **around),
            # ceil(keys / block) (+ extra) blocks, in the arithmetic onnxruntime's symbolic
            # shape inference follows (Add, Div, Mul, Sub: no Mod), so quantization's
            # pre-processing keeps its symbolic shapes
            make("Add", [f"{p}/keys", const("block_less_one", [KEY_BLOCK - 1])], f"{p}/up"),
            make("Div", [f"{p}/up", block], f"{p}/whole"),
            make("Add", [f"{p}/whole", const(f"extra_{extra}", [extra])], f"{p}/blocks"),
            make("Mul", [f"{p}/blocks", block], f"{p}/padded"),
            make("Sub", [f"{p}/padded", f"{p}/keys"], f"{p}/pad"),
            make("Shape", [x], lead, end=axis),
        ]
        if axis < -1:
            nodes.append(make("Shape", [x], f"{p}/trail", start=axis + 1))
            zeros = [lead, f"{p}/pad", f"{p}/trail"]
            target = [lead, *halves, f"{p}/trail"]
        else:
            zeros, target = [lead, f"{p}/pad"], [lead, *halves]
        nodes += [
            make("Concat", zeros, f"{p}/zeros_shape", axis=0),
            make("ConstantOfShape", [f"{p}/zeros_shape"], f"{p}/zeros",
                 value=numpy_helper.from_array(np.array([fill], types[x]))),
            make("Concat", [f"{p}/zeros", x], f"{p}/aligned", axis=axis),
            make("Concat", target, f"{p}/split_shape", axis=0),
        ]  # fmt: skip
        if split:
            nodes.append(make("Reshape", [f"{p}/aligned", f"{p}/split_shape"], f"{p}/split"))
        return nodes, f"{p}/split", f"{p}/aligned"

    def in_order(parts: str, axis: int, out: str, p: str) -> list[Any]:
        """Block results along `axis` added left to right (CumSum), the last one kept."""
        return [
            make("CumSum", [parts, const(f"scalar_axis_{axis}", axis)], f"{p}/running"),
            make(
                "Slice",
                [
                    f"{p}/running",
                    const("minus_one", [-1]),
                    const("end", [2**62]),
                    const(f"axis_{axis}", [axis]),
                ],
                f"{p}/last",
            ),  # fmt: skip
            helper.make_node(
                "Squeeze", [f"{p}/last", const(f"axis_{axis}", [axis])], [out], name=f"{p}/total"
            ),  # fmt: skip
        ]

    def one_more_row(node: Any) -> list[Any]:
        """A MatMul run on its left input's rows and one more (the last again), then cut
        back: a one-row MatMul on a transposed right side (Q x K^T in a decode step) gives
        each key column by another path at another place, two rows never do."""
        a, out = node.input[0], node.output[0]
        p = f"{out}/row_invariant"
        last = make("Slice", [a, const("minus_one", [-1]), const("end", [2**62]),
                              const("axis_-2", [-2])], f"{p}/last_row")  # fmt: skip
        return [
            last,
            make("Concat", [a, f"{p}/last_row"], f"{p}/rows_plus_one", axis=-2),
            helper.make_node("MatMul", [f"{p}/rows_plus_one", *node.input[1:]],
                             [f"{p}/product_plus_one"], name=node.name),  # fmt: skip
            make("Shape", [a], f"{p}/rows", start=-2, end=-1),
            helper.make_node("Slice", [f"{p}/product_plus_one", const("zero", [0]), f"{p}/rows",
                                       const("axis_-2", [-2])], [out], name=f"{p}/first_rows"),
        ]  # fmt: skip

    nodes: list[Any] = []
    products = 0
    for index, node in enumerate(graph.node):
        if index in scores:
            nodes += one_more_row(node)
            continue
        if index in rewritten:
            x, y = node.input[0], node.output[0]
            p = f"{y}/row_invariant"
            # the scores padded with -inf (exp gives exactly 0 there) before exp, so every
            # score meets exp at the same place in its vector whatever the padding (the
            # vector and the scalar tail of exp differ in the last bit); one more block:
            # at least two rows in the sum's GEMM (its one-row path sums K in lanes)
            pad, _, aligned = blocks(x, -1, f"{p}/scores", 1, float("-inf"), split=False)
            blocks_shape = f"{p}/scores/split_shape"  # [..., m, blocks, KEY_BLOCK]
            nodes += [
                *pad,
                # the max of the real scores, taken where it is (ArgMax's axis is an
                # attribute in every opset; ReduceMax-18's axes input is a value onnxruntime's
                # symbolic shape inference does not read, and it stops there)
                make("ArgMax", [x], f"{p}/argmax", axis=-1, keepdims=1),
                make("GatherElements", [x, f"{p}/argmax"], f"{p}/max", axis=-1),
                make("Sub", [aligned, f"{p}/max"], f"{p}/shifted"),
                make("Exp", [f"{p}/shifted"], f"{p}/exp_aligned"),
                make("Reshape", [f"{p}/exp_aligned", blocks_shape], f"{p}/exp_blocks"),
                make("MatMul", [f"{p}/exp_blocks", typed(
                    f"shipyard_invariant_ones_{types[x].name}",
                    np.ones((KEY_BLOCK, SUM_WIDTH), types[x]),
                )], f"{y}{SUMS}"),  # [..., m, blocks, SUM_WIDTH]
                *in_order(f"{y}{SUMS}", -2, f"{p}/sums", p),  # [..., m, SUM_WIDTH]
                make("Slice", [f"{p}/sums", const("zero", [0]), const("one", [1]),
                               const("minus_one", [-1])], f"{p}/sum"),
                # the real keys' exponentials: the last L of the padded row
                make("Shape", [x], f"{p}/real_keys", start=-1),
                make("Neg", [f"{p}/real_keys"], f"{p}/from_end"),
                make("Slice", [f"{p}/exp_aligned", f"{p}/from_end", const("end", [2**62]),
                               const("minus_one", [-1])], f"{p}/exp"),
                helper.make_node("Div", [f"{p}/exp", f"{p}/sum"], [y], name=f"{p}/normalize"),
            ]  # fmt: skip
            continue
        rank = ranks.get(node.input[0]) if node.op_type == "MatMul" else None
        if (
            rank is None
            or node.input[0] not in probs
            or ranks.get(node.input[1]) != rank
            or not {node.input[0], node.input[1]} <= types.keys()
        ):
            nodes.append(node)
            continue
        a, v, out = node.input[0], node.input[1], node.output[0]
        p = f"{out}/row_invariant"
        split_a, a_blocks, _ = blocks(a, -1, f"{p}/probs")  # [..., m, blocks, KEY_BLOCK]
        split_v, v_blocks, _ = blocks(v, -2, f"{p}/values")  # [..., blocks, KEY_BLOCK, d]
        # [..., m, blocks, KEY_BLOCK] -> [..., blocks, m, KEY_BLOCK]: one GEMM a block
        perm = [*range(rank - 2), rank - 1, rank - 2, rank]
        nodes += [
            *split_a,
            *split_v,
            make("Transpose", [a_blocks], f"{p}/by_block", perm=perm),
            # one more row (the last again): a decode step's one query would take the
            # one-row path, which sums K otherwise than a prefill's many rows do (a cached
            # decode would then differ from a full recompute in the last bit)
            make("Slice", [f"{p}/by_block", const("minus_one", [-1]), const("end", [2**62]),
                           const("axis_-2", [-2])], f"{p}/last_query"),
            make("Concat", [f"{p}/by_block", f"{p}/last_query"], f"{p}/queries", axis=-2),
            # the product keeps the MatMul's own name: exclusions by name still apply
            helper.make_node("MatMul", [f"{p}/queries", v_blocks], [f"{p}/parts_plus"],
                             name=node.name),  # [..., blocks, m + 1, d]
            make("Shape", [a], f"{p}/rows", start=-2, end=-1),
            helper.make_node("Slice", [f"{p}/parts_plus", const("zero", [0]), f"{p}/rows",
                                       const("axis_-2", [-2])], [f"{p}/parts"],
                             name=f"{p}/first_rows"),
            *in_order(f"{p}/parts", -3, out, p),
        ]  # fmt: skip
        products += 1
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(consts.values())
    return Rewritten(len(softmax), products)


ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Where", "Cast", "Identity", "Max", "Min")


def _score_products(graph: Any, softmax_inputs: list[str]) -> set[int]:
    """The MatMuls whose result reaches a softmax's input through elementwise steps only
    (scaling, masking, casting): the attention scores Q x K^T (by index in the graph)."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output}
    found: set[int] = set()
    todo = [(name, 0) for name in softmax_inputs]
    while todo:
        name, depth = todo.pop()
        index = producer.get(name)
        if index is None or depth > 8:
            continue
        node = graph.node[index]
        if node.op_type == "MatMul":
            found.add(index)
        elif node.op_type in ELEMENTWISE:
            todo += [(i, depth + 1) for i in node.input if i]
    return found


def _opset(model: Any) -> int:
    return int(next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0))


def _ranks(graph: Any) -> dict[str, int]:
    """Ranks shape inference knows, by tensor name."""
    out = {}
    for info in (*graph.value_info, *graph.input, *graph.output):
        t = info.type
        if t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
            out[info.name] = len(t.tensor_type.shape.dim)
    return out


def _types(graph: Any) -> dict[str, np.dtype]:
    """Float element types shape inference knows, by tensor name."""
    from onnx import helper

    out = {}
    for info in (*graph.value_info, *graph.input, *graph.output):
        t = info.type
        if t.HasField("tensor_type") and t.tensor_type.elem_type:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type))
            if dtype.kind == "f":
                out[info.name] = dtype
    return out


def _last_axis(node: Any) -> bool:
    """Whether the softmax normalizes over the last axis (opset 13+, which MIN_OPSET
    implies: one axis, default -1). A positive axis is not taken for the last."""
    return bool(next((a.i for a in node.attribute if a.name == "axis"), -1) == -1)
