"""The shipped graph with its dynamic quantization scales pinned, for the KV check.

Dynamic INT8 (`DynamicQuantizeLinear`) takes one scale per call from the range of the whole
tensor it quantizes. A cached step quantizes one token's activations; a full pass quantizes
every position's together. So even a quantized graph whose cache path is exactly right does
not decode the same through its cache as in one pass: on tiny-gpt2 the two differ by 0.006
to 0.016, about half of what a dropped or clipped past changes. That cross-position
coupling lives in the scale alone, and the scale is per-call arithmetic that no cache can
hold. Pinning each node's scale and zero point to constants (wide enough for every pass the
check makes) removes it: each element is then quantized the same way in both decodes, the
integer matrix products are exact, and what is left is the graph's own wiring (its pasts,
masks, positions, and whatever the quantizer rewrote), held to the float tolerance.

Every other node of the shipped graph is kept as it is, weights included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas import Refused

DYNAMIC = "DynamicQuantizeLinear"
LEVELS = 255.0  # uint8: DynamicQuantizeLinear's only output type
# ONNX Runtime's fused ops that take their activation scale inside the kernel: nothing to pin
INSIDE = ("DynamicQuantizeMatMul", "DynamicQuantizeLSTM", "QAttention")


@dataclass
class Ranges:
    """Per dynamic-quantization node, the widest [low, high] its scale covered in any pass."""

    low: dict[str, float] = field(default_factory=dict)
    high: dict[str, float] = field(default_factory=dict)

    def add(self, node: str, scale: float, zero_point: int) -> None:
        # DynamicQuantizeLinear: scale = (max(0, x.max) - min(0, x.min)) / 255 and
        # zero_point = round(-min / scale): the range it covered is recovered from both
        low, high = -zero_point * scale, (LEVELS - zero_point) * scale
        self.low[node] = min(self.low.get(node, 0.0), low)
        self.high[node] = max(self.high.get(node, 0.0), high)

    def pinned(self, node: str) -> tuple[float, int]:
        low, high = self.low[node], self.high[node]
        scale = (high - low) / LEVELS or 1.0
        return scale, int(np.clip(np.round(-low / scale), 0, LEVELS))


def refuse_unpinnable(path: Path) -> None:
    """A graph whose dynamic scales sit inside fused kernels cannot be held to the check."""
    from stages.onnx.stream import skeleton

    fused = [n for n in skeleton(path).graph.node if n.op_type in INSIDE]
    if fused:
        raise Refused(
            f"{path.name}: node {fused[0].name!r} ({fused[0].op_type}, {len(fused)} such) "
            "quantizes its input with a per-call scale inside the kernel, so its cached "
            "decode cannot be compared with a full recompute",
            "ship DynamicQuantizeLinear + MatMulInteger (onnxruntime.quantization."
            "quantize_dynamic's output, unfused) or a static or weight-only method",
        )


def dynamic_nodes(model: Any) -> list[Any]:
    return [n for n in model.graph.node if n.op_type == DYNAMIC and n.domain in ("", "ai.onnx")]


def expose_scales(model: Any) -> list[tuple[str, str, str]]:
    """Make every dynamic node's scale and zero point graph outputs (in place); returns
    (node, scale output, zero-point output) for each."""
    from onnx import TensorProto, helper

    out = []
    for i, node in enumerate(dynamic_nodes(model)):
        name = node.name or f"{DYNAMIC}_{i}"
        scale, zero = node.output[1], node.output[2]
        model.graph.output.append(helper.make_tensor_value_info(scale, TensorProto.FLOAT, []))
        model.graph.output.append(helper.make_tensor_value_info(zero, TensorProto.UINT8, []))
        out.append((name, scale, zero))
    return out


def collector(
    run_all: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    scales: Iterable[tuple[str, str, str]],
    ranges: Ranges,
) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """A Run over the exposed graph that records each dynamic node's range as it goes."""
    scales = list(scales)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = run_all(feeds)
        for node, scale, zero in scales:
            ranges.add(node, float(out[scale]), int(out[zero]))
        return out

    return run


def pin(model: Any, ranges: Ranges) -> int:
    """Replace every dynamic node by a QuantizeLinear with constant scale and zero point
    (in place; the node's scale and zero-point outputs become those constants). Returns
    how many nodes were pinned."""
    from onnx import TensorProto, helper

    nodes = dynamic_nodes(model)
    for i, node in enumerate(nodes):
        name = node.name or f"{DYNAMIC}_{i}"
        scale, zero = ranges.pinned(name)
        x, (y, y_scale, y_zero) = node.input[0], node.output
        consts = [
            helper.make_node(
                "Constant",
                [],
                [y_scale],
                name=f"{name}/pinned_scale",
                value=helper.make_tensor(f"{name}/s", TensorProto.FLOAT, [], [scale]),
            ),
            helper.make_node(
                "Constant",
                [],
                [y_zero],
                name=f"{name}/pinned_zero_point",
                value=helper.make_tensor(f"{name}/z", TensorProto.UINT8, [], [zero]),
            ),
        ]
        quant = helper.make_node("QuantizeLinear", [x, y_scale, y_zero], [y], name=name)
        at = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        for k, new in enumerate([*consts, quant]):
            model.graph.node.insert(at + k, new)
    return len(nodes)
