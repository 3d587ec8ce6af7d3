"""SmoothQuant (Xiao et al. 2023) on an ONNX graph: move activation outliers into the weights.

A per-tensor activation scale is set by the largest value in the tensor; Llama-family
`down_proj` inputs carry channels 1000x the median, so INT8 activations keep ~1 bit for every
other channel. For `Y = X W`, any per-input-channel s gives `Y = (X / s) (s W)`: with
`s_c = max|X_c|^alpha / max|W_c|^(1 - alpha)` the activation's channels are evened out and
the weight, quantized per output channel, absorbs the rest. The graph computes the same
function in float; only what INT8 sees changes.

`1/s` is folded into the op that produces X where that op is per-channel linear and feeds
only the smoothed MatMuls: a Mul by a constant vector (RMSNorm's weight), LayerNormalization
(scale and bias), or `a * (x W_up)` (SwiGLU's up projection, whose weight columns take it).
Anywhere else a `Mul(X, 1/s)` node is inserted (an elementwise op, cheap beside the MatMul).
ONNX Runtime's own SmoothQuant needs neural_compressor, which is not a dependency here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHAPE_ONLY = {"Shape", "Size"}
LIMIT = 1e4  # s is clipped to [1/LIMIT, LIMIT]: a dead channel must not blow up its weight row


@dataclass
class Smoothing:
    """What `smooth` did: activation tensors smoothed, how many had 1/s folded into their
    producer and how many got a Mul inserted, and the largest channel ratio (max / median
    of a tensor's per-channel max |x|) over the smoothed tensors before and after."""

    tensors: int = 0
    folded: int = 0
    inserted: int = 0
    max_ratio_before: float = 0.0
    max_ratio_after: float = 0.0


def smooth(
    src: Path,
    dst: Path,
    samples: list[dict[str, np.ndarray]],
    alpha: float,
    data: str,
    op_types: Sequence[str] = ("MatMul",),
) -> Smoothing:
    """Write the smoothed model to dst (weights in the external file `data` beside it);
    returns what was done: tensors smoothed, folded vs inserted, the largest channel ratio
    before and after. The source's weights are read memory-mapped, and only the smoothed
    ones are held, until they are written (stages/onnx/stream.py)."""
    import onnx

    from stages.onnx import stream

    model = onnx.load(str(src), load_external_data=False)
    base = src.parent
    spill = base / f".{dst.name}.smoothed-weights"  # under base: stream.source reads it
    try:
        with open(spill, "wb") as held:
            report = _smooth(model, src, held, spill.name, samples, alpha, op_types)
        big = {t.name for t in model.graph.initializer if stream.nbytes(t) > 1024}
        stream.save(model, base, dst, big, data)
    finally:
        spill.unlink(missing_ok=True)
    return report


def _smooth(
    model: Any,
    src: Path,
    held: Any,
    location: str,
    samples: list[dict[str, np.ndarray]],
    alpha: float,
    op_types: Sequence[str],
) -> Smoothing:
    """`smooth` on the loaded graph, in place: each smoothed weight is written to `held`
    (the file `location` under the source's folder) as it is made and the graph points at
    it, so no step holds the smoothed weights together (on a 30-layer decoder they were
    0.55 GB on top of the rest of the stage)."""
    import onnx

    from stages._contract import in_child
    from stages.onnx import stream
    from stages.onnx.invariant import SUMS

    base = src.parent
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    groups: dict[str, list[Any]] = {}  # activation tensor -> the MatMuls that read it
    for node in graph.node:
        if (
            node.op_type in op_types
            and node.op_type == "MatMul"
            and node.input[1] in inits
            and len(inits[node.input[1]].dims) == 2
            and not node.name.endswith(SUMS)  # a softmax's sum against ones: no weight
        ):
            groups.setdefault(node.input[0], []).append(node)
    # in a child process: the session that records the activations goes with it (in this
    # process 0.83 GB of it stayed resident after it was freed, 1.3x this checkpoint)
    absmax = in_child(_channel_absmax, src, list(groups), samples)
    consumers = _consumers(graph)
    producers = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    report = Smoothing()
    after = 0.0
    new_nodes: dict[str, Any] = {}  # activation -> Mul node to insert after its producer
    for x, matmuls in groups.items():
        act = absmax.get(x)
        if act is None or not np.any(act > 0):
            continue
        weights = [stream.array(inits[n.input[1]], base) for n in matmuls]
        wmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
        scale = np.where(
            (act > 0) & (wmax > 0),
            act**alpha / np.maximum(wmax, 1e-12) ** (1 - alpha),
            1.0,
        )
        scale = np.clip(scale, 1 / LIMIT, LIMIT).astype(np.float32)
        median = float(np.median(act)) or 1.0
        report.max_ratio_before = max(report.max_ratio_before, float(act.max()) / median)
        smoothed = act / scale
        after = max(after, float(smoothed.max()) / (float(np.median(smoothed)) or 1.0))
        for node, w in zip(matmuls, weights, strict=True):
            name = _fresh(inits, node.input[1] + "_smoothed")
            _add(graph, inits, _spilled(held, location, name, w * scale[:, None]))
            node.input[1] = name
        readers = consumers.get(x, [])
        # a Shape reader does not see the values: folding cannot change what it computes
        others = [r for r in readers if r not in matmuls and r.op_type not in SHAPE_ONLY]
        only_ours = x not in outputs and not others
        if only_ours and _fold(
            graph, inits, producers.get(x), producers, consumers, 1 / scale, base
        ):
            report.folded += 1
        else:
            inv = _fresh(inits, x + "_smooth_inv")
            _add(graph, inits, onnx.numpy_helper.from_array((1 / scale).astype(np.float32), inv))
            out = x + "_smoothed"
            new_nodes[x] = onnx.helper.make_node("Mul", [x, inv], [out], name=f"{x}_SmoothQuant")
            for node in matmuls:
                node.input[0] = out
            report.inserted += 1
        report.tensors += 1
    _insert(graph, new_nodes)
    _drop_unused(graph)
    report.max_ratio_after = after
    return report


def _spilled(held: Any, location: str, name: str, value: np.ndarray) -> Any:
    """An initializer whose bytes are appended to `held` (external data at `location`)."""
    from onnx import TensorProto, helper

    from stages.onnx import stream

    tensor = TensorProto()
    tensor.name = name
    tensor.dims.extend(value.shape)
    tensor.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
    offset = held.tell()
    held.write(np.ascontiguousarray(value).tobytes())
    stream.point(tensor, location, offset, held.tell() - offset)
    return tensor


def _channel_absmax(
    src: Path, tensors: list[str], samples: list[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """max |x| per last-axis channel of each tensor over the samples."""
    from stages.onnx.graph import marked_runs

    out: dict[str, np.ndarray] = {}
    for values in marked_runs(src, tensors, samples):
        for name, value in values.items():
            channels = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
            out[name] = channels if name not in out else np.maximum(out[name], channels)
    return out


def _fold(
    graph: Any,
    inits: dict[str, Any],
    producer: Any,
    producers: dict[str, Any],
    consumers: dict[str, Any],
    inv: np.ndarray,
    base: Path,
) -> bool:
    """Multiply the producer's per-channel factor by inv; False when it has none we can use."""
    from stages.onnx import stream

    if producer is None:
        return False
    if producer.op_type == "LayerNormalization":
        given = [i for i in (1, 2) if len(producer.input) > i and producer.input[i]]
        if any(producer.input[i] not in inits for i in given):
            return False
        for i in given:
            _scaled_input(graph, inits, producer, i, inv, -1, base)
        return True
    if producer.op_type != "Mul":
        return False
    for i in (0, 1):
        name = producer.input[i]
        if name in inits:
            value = stream.array(inits[name], base)
            if value.ndim >= 1 and value.shape[-1] == inv.size and value.size == inv.size:
                _scaled_input(graph, inits, producer, i, inv, -1, base)
                return True
            return False
    for i in (1, 0):  # a * (x W): the MatMul's weight columns take the factor
        up = producers.get(producer.input[i])
        if (
            up is not None
            and up.op_type == "MatMul"
            and up.input[1] in inits
            and [r for r in consumers.get(up.output[0], []) if r.op_type not in SHAPE_ONLY]
            == [producer]
        ):
            w = stream.array(inits[up.input[1]], base)
            if w.ndim == 2 and w.shape[1] == inv.size:
                _scaled_input(graph, inits, up, 1, inv, -1, base)
                return True
    return False


def _scaled_input(
    graph: Any, inits: dict[str, Any], node: Any, i: int, inv: np.ndarray, axis: int, base: Path
) -> None:
    """node.input[i] (a constant) times inv along `axis`, as a new initializer (the old one
    may feed other nodes)."""
    from onnx import numpy_helper

    from stages.onnx import stream

    value = stream.array(inits[node.input[i]], base)
    shape = [1] * value.ndim
    shape[axis] = inv.size
    name = _fresh(inits, node.input[i] + "_smoothed")
    scaled = (value * inv.reshape(shape)).astype(value.dtype)
    _add(graph, inits, numpy_helper.from_array(scaled, name))
    node.input[i] = name


def _consumers(graph: Any) -> dict[str, list[Any]]:
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _fresh(inits: dict[str, Any], name: str) -> str:
    candidate, n = name, 0
    while candidate in inits:
        n += 1
        candidate = f"{name}_{n}"
    return candidate


def _add(graph: Any, inits: dict[str, Any], tensor: Any) -> None:
    graph.initializer.append(tensor)
    inits[tensor.name] = tensor


def _insert(graph: Any, new: dict[str, Any]) -> None:
    """Each new Mul right after the node producing its input (a graph input: first)."""
    if not new:
        return
    nodes = list(graph.node)
    order = [n for x, n in new.items() if x not in {o for m in nodes for o in m.output}]
    for node in nodes:
        order.append(node)
        order.extend(new[o] for o in node.output if o in new)
    del graph.node[:]
    graph.node.extend(order)


def _drop_unused(graph: Any) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
