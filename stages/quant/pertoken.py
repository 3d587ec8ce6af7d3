"""Dynamic INT8 with one activation scale per token, so no row or position of a call moves
another's result.

onnxruntime's dynamic quantization (`DynamicQuantizeLinear`) takes one scale and zero point
per call from the range of the whole tensor it quantizes. In a served decode step that
tensor is the whole batch: one row's logits moved with its neighbours (free slots and
other users' tokens: logprob 0.0 alone vs 1.4e-2 after a burst, issue 41), and a prefill
chunk quantized its tokens together, so a cached decode and a full recompute of the same
sequence agreed on 65 of 256 greedy tokens on a 30-layer decoder. Here every
`DynamicQuantizeLinear` is replaced by the same quantization taken per token (over the last
axis, symmetric, as SmoothQuant's and LLM.int8's W8A8 "per-token" scales): scale =
max|x| / 127 of that token, q = round(x / scale) + 128 as uint8 with the zero point 128, so
onnxruntime's `MatMulInteger` (u8 x s8; it takes a zero point per tensor only) and the
rest of the quantized piece (the scale product, the cast) are unchanged. A token's integer
product then depends on its own activations alone, and the integer arithmetic is exact.

Symmetric costs one bit on a token whose range is one-sided; per-tensor's range over a
whole batch cost far more on real decoders (a massive activation in one token coarsened
every other token's step). What it costs in time is measured in
benchmarks/bench_continuous_batching.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

DYNAMIC = "DynamicQuantizeLinear"
LEVELS = 127.0  # a signed step each side of the zero point
ZERO = 128  # uint8 zero point: q in [1, 255]
# scale floor: an all-zero token (padding) gets a finite scale and quantizes to the zero
# point; any |x| <= 127 x FLOOR still rounds within [-127, 127]
FLOOR = 1e-30


def rewrite(model: Any) -> int:
    """Replace every DynamicQuantizeLinear of `model` (an onnx ModelProto, changed in place)
    with its per-token form; the number replaced."""
    from onnx import TensorProto, helper, numpy_helper

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    nodes: list[Any] = []
    constants: dict[str, Any] = {}

    def const(name: str, value: np.ndarray) -> str:
        constants.setdefault(name, numpy_helper.from_array(value, name))
        return name

    readers: dict[str, list[tuple[Any, int]]] = {}
    for node in model.graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, slot))

    def per_token_safe(node: Any) -> bool:
        """A scale per token over the last axis is right only where that axis is summed
        away: the quantized tensor read as MatMulInteger's left input only, its scale by
        Mul only (the dequantizing product). ConvInteger, QAttention and the rest take one
        scale: their DynamicQuantizeLinear stays as it is."""
        q, scale, _ = node.output
        return all(
            n.op_type == "MatMulInteger" and slot == 0 for n, slot in readers.get(q, [])
        ) and all(n.op_type == "Mul" for n, _ in readers.get(scale, []))

    done = 0
    for node in model.graph.node:
        if (
            node.op_type != DYNAMIC
            or node.domain not in ("", "ai.onnx")
            or not per_token_safe(node)
        ):
            nodes.append(node)
            continue
        x = node.input[0]
        q, scale, zero = node.output
        p = f"{q}/per_token"  # unique per node: its quantized output's name
        step = f"{p}/scale_unclamped"
        if opset >= 18:  # axes became an input in opset 18
            axes = const("shipyard_per_token_last_axis", np.array([-1], np.int64))
            reduce = helper.make_node(
                "ReduceMax", [f"{p}/abs", axes], [f"{p}/absmax"], name=f"{p}/absmax", keepdims=1
            )
        else:
            reduce = helper.make_node(
                "ReduceMax",
                [f"{p}/abs"],
                [f"{p}/absmax"],
                name=f"{p}/absmax",
                axes=[-1],
                keepdims=1,
            )
        levels = const("shipyard_per_token_levels", np.array(LEVELS, np.float32))
        floor = const("shipyard_per_token_floor", np.array(FLOOR, np.float32))
        shift = const("shipyard_per_token_zero", np.array(float(ZERO), np.float32))
        nodes += [
            helper.make_node("Abs", [x], [f"{p}/abs"], name=f"{p}/abs"),
            reduce,
            helper.make_node("Div", [f"{p}/absmax", levels], [step], name=step),
            helper.make_node("Max", [step, floor], [scale], name=f"{p}/scale"),
            helper.make_node("Div", [x, scale], [f"{p}/scaled"], name=f"{p}/scaled"),
            helper.make_node("Round", [f"{p}/scaled"], [f"{p}/rounded"], name=f"{p}/rounded"),
            helper.make_node("Add", [f"{p}/rounded", shift], [f"{p}/shifted"], name=f"{p}/shifted"),
            helper.make_node("Cast", [f"{p}/shifted"], [q], name=f"{p}/cast", to=TensorProto.UINT8),
            helper.make_node(
                "Constant",
                [],
                [zero],
                name=f"{p}/zero_point",
                value=numpy_helper.from_array(np.array(ZERO, np.uint8), zero),
            ),
        ]
        done += 1
    if done:
        nodes = _unfused(nodes, {n.output[0] for n in nodes if n.name.endswith("/per_token/scale")})
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(constants.values())
        # shapes inferred for the per-call scale and what it multiplies are per token now
        scales = {n.output[0] for n in nodes if n.name.endswith("/per_token/scale")}
        stale = scales | {o for n in nodes if set(n.input) & scales for o in n.output}
        kept = [v for v in model.graph.value_info if v.name not in stale]
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)
    return done


def _unfused(nodes: list[Any], scales: set[str]) -> list[Any]:
    """onnxruntime's quantizer dequantizes as Mul(Cast(MatMulInteger(..)), Mul(x_scale,
    w_scale)), and onnxruntime's MatMulIntegerToFloatFusion turns that into one kernel that
    reads x_scale as one number: with a scale per token it took the first token's for every
    row (3 dB SNR on a 4-layer toy, where the unfused graph gives 24 dB). So the scales are
    applied one after the other, Mul(Mul(Cast(..), w_scale), x_scale), which that fusion
    does not match (its scale must come from a Mul of two scales). A product of a per-token
    scale read by anything but a Mul is refused: it would reach a kernel that takes one."""
    from onnx import helper

    products = _products(nodes, scales)
    out: list[Any] = []
    for node in nodes:
        if node.op_type == "Mul" and node.output[0] in products:
            continue  # the product: its reader multiplies by each scale instead
        hit = [i for i in node.input if i in products]
        if not hit:
            out.append(node)
            continue
        if node.op_type != "Mul" or len(hit) != 1:
            raise ValueError(
                f"node {node.name!r} ({node.op_type}) reads the per-token scale product "
                f"{hit[0]!r}: only a Mul may (a fused kernel would take one scale)"
            )
        scale, weight_scale = products[hit[0]]
        other = next(i for i in node.input if i != hit[0])
        partial = f"{node.output[0]}/per_channel"
        out.append(
            helper.make_node(
                "Mul", [other, weight_scale], [partial], name=f"{node.name}/per_channel"
            )
        )
        out.append(helper.make_node("Mul", [partial, scale], list(node.output), name=node.name))
    return out


def _products(nodes: list[Any], scales: set[str]) -> dict[str, tuple[str, str]]:
    """Mul(per-token scale, other scale) nodes: product name -> (the token scale, the other)."""
    out: dict[str, tuple[str, str]] = {}
    for node in nodes:
        if node.op_type == "Mul" and len(node.input) == 2:
            a, b = node.input
            if a in scales and b not in scales:
                out[node.output[0]] = (a, b)
            elif b in scales and a not in scales:
                out[node.output[0]] = (b, a)
    return out


INT8_PATH = 4  # MatMulNBits' accuracy_level for onnxruntime's int8 kernels


def on_int8_path(node: Any) -> bool:
    """A MatMulNBits on onnxruntime's int8 kernels (accuracy_level 4): each row's activations
    quantized alone in blocks along K. Any other level runs the float path."""
    level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
    return bool(node.op_type == "MatMulNBits" and level == INT8_PATH)


def unrounded(model: Any) -> int:
    """The shipped graph as kvcheck holds it to a float tolerance (in place; the number of
    products changed): each MatMulInteger fed by a per-token quantization computes the same
    product on the activation divided by its scale *before* rounding, against the same
    integer weights as floats, and each MatMulNBits on the int8 path (accuracy_level 4)
    runs on the float path (its weights' blocks dequantized, the activation unrounded).
    Everything else (the weights' quantization, the pasts, masks
    and positions, whatever the quantizer rewrote) stays as shipped.

    Why: a cached decode and a full recompute differ in float rounding (the attention of a
    prefill chunk ends at the chunk, a full pass's at the sequence), and a per-token
    quantizer turns that last bit into one quantization step where an activation sits on a
    rounding boundary (on the tiny-gpt2 example: 0.004 on a logit at past 65). The step
    is the quantizer's, per token (its own test shows a token's result never depends on
    the others); what kvcheck proves is the cache path, which this view keeps."""
    from onnx import TensorProto, helper

    cast_of = {n.output[0]: n for n in model.graph.node if n.name.endswith("/per_token/cast")}
    readers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    weights = {t.name for t in model.graph.initializer}
    nodes: list[Any] = []
    done = 0
    drop: set[str] = set()
    for node in model.graph.node:
        if node.name in drop:
            continue
        q = node.input[0] if node.op_type == "MatMulInteger" else ""
        after = readers.get(node.output[0], []) if q in cast_of else []
        if not (len(after) == 1 and after[0].op_type == "Cast" and node.input[1] in weights):
            nodes.append(node)
            continue
        scaled = cast_of[q].name.removesuffix("/cast") + "/scaled"  # x / its scale
        p = f"{node.output[0]}/unrounded"
        w = node.input[1]
        nodes.append(helper.make_node("Cast", [w], [f"{p}/w"], name=f"{p}/w", to=TensorProto.FLOAT))
        if len(node.input) > 3 and node.input[3]:  # the weights' zero point
            zero = f"{p}/w_zero"
            nodes.append(
                helper.make_node("Cast", [node.input[3]], [zero], name=zero, to=TensorProto.FLOAT)
            )
            nodes.append(
                helper.make_node("Sub", [f"{p}/w", zero], [f"{p}/w_centered"], name=f"{p}/c")
            )
            w_float = f"{p}/w_centered"
        else:
            w_float = f"{p}/w"
        # what Cast(MatMulInteger(..)) gave, without the activation's rounding
        nodes.append(helper.make_node("MatMul", [scaled, w_float], list(after[0].output), name=p))
        drop.add(after[0].name)
        done += 1
    del model.graph.node[:]
    model.graph.node.extend(n for n in nodes if n.name not in drop)
    # weight-only graphs on onnxruntime's int8 path (accuracy_level 4) round each row's
    # activations inside MatMulNBits: its float path is the same product on the same integer
    # weights before that rounding
    for node in model.graph.node:
        if on_int8_path(node):
            next(a for a in node.attribute if a.name == "accuracy_level").i = 0
            done += 1
    return done


def rows_independent(path: Path) -> bool:
    """Whether a graph's rows cannot move each other: no per-call dynamic quantization
    (one scale spanning the batch), no attention softmax left unrewritten (its sums move
    with a row's padding: stages/onnx/invariant.py) and no MatMulNBits on onnxruntime's
    float path (`compute: float`: its kernel changes with the batch's rows, and a row's last
    bit with it; the int8 path quantizes and sums each row alone)."""
    from stages.onnx import stream

    for node in stream.skeleton(path).graph.node:
        if node.op_type in {"DynamicQuantizeLinear", "Softmax"}:
            return False
        if node.op_type == "MatMulNBits" and not on_int8_path(node):
            return False
    return True
