"""ONNX graph helpers shared by the checking stages: module scopes, constants, all tensors."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ADAPTER_PREFIX = "model."  # stages.onnx.model.adapter wraps the user's module as `model`


def node_scope(node: Any) -> str:
    """Dotted path of the PyTorch module a node came from ('' when unknown).

    dynamo: the `pkg.torch.onnx.name_scopes` metadata (last entry is the op itself);
    legacy: the node name `/model/transformer/h.0/attn/Gemm` carries the path.
    """
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            return _strip(scopes[-2] if len(scopes) >= 2 else "")
    if node.name.startswith("/"):
        return _strip(".".join(node.name.split("/")[1:-1]))
    return ""


def _strip(path: str) -> str:
    return path.removeprefix(ADAPTER_PREFIX) if path != "model" else ""


def constant_values(graph: Any) -> dict[str, np.ndarray]:
    """Initializers and Constant-node outputs by tensor name. An initializer that is also a
    graph input is only a default the caller may override: not a constant."""
    from onnx import TensorProto, helper, numpy_helper

    inputs = {i.name for i in graph.input}
    # External tensors are weights (the exporter keeps bool/int flags and shape constants
    # inline); reading them would load a >2 GB model's weights to find a scalar. Left out,
    # they count as not constant, which only makes the checks stricter.
    values = {
        t.name: numpy_helper.to_array(t)
        for t in graph.initializer
        if t.name not in inputs and t.data_location != TensorProto.EXTERNAL
    }
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])
            values[node.output[0]] = (
                numpy_helper.to_array(value) if hasattr(value, "raw_data") else np.asarray(value)
            )
    return values


def all_tensors(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every intermediate tensor of the graph: each node output becomes a graph output (what
    Polygraphy's MARK_ALL does) and ONNX Runtime runs it once.

    The weights are never loaded into Python: the marked graph is an external view of the
    file (`stream.external_view`), so a model beyond protobuf's 2 GiB works too (Polygraphy
    serializes the whole model to bytes, which fails there)."""
    import onnx
    import onnxruntime as ort

    from stages.onnx import stream

    def mark_all(model: Any) -> None:
        graph = model.graph
        known = {o.name for o in graph.output}
        marked = [out for node in graph.node for out in node.output if out and out not in known]
        graph.output.extend(
            onnx.helper.make_empty_tensor_value_info(n) for n in dict.fromkeys(marked)
        )

    with stream.external_view(path, edit=mark_all) as view:
        session = ort.InferenceSession(str(view), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds), strict=True))


def marked_runs(
    path: Path, names: list[str], samples: list[dict[str, np.ndarray]]
) -> Iterator[dict[str, np.ndarray]]:
    """The named intermediate tensors for each sample, one ONNX Runtime run per sample, on an
    external view of the file (weights neither parsed nor held twice). Graph optimization is
    off so every named tensor still exists."""
    import onnx
    import onnxruntime as ort

    from stages.onnx import stream

    if not names:  # ONNX Runtime runs every output when asked for none
        return

    def mark(model: Any) -> None:
        known = {o.name for o in model.graph.output}
        model.graph.output.extend(
            onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in known
        )

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with stream.external_view(path, edit=mark) as view:
        session = ort.InferenceSession(str(view), options, providers=["CPUExecutionProvider"])
    for feeds in samples:
        yield dict(zip(names, session.run(names, feeds), strict=True))


def scoped_outputs(path: Path) -> list[tuple[str, str]]:
    """(module scope, tensor name) for every node output, in graph (topological) order."""
    from stages.onnx import stream

    graph = stream.skeleton(path).graph
    return [(node_scope(node), out) for node in graph.node for out in node.output if out]


def boundary_outputs(path: Path, module: str) -> list[str]:
    """The tensors computed inside `module`'s scope that leave it: read by a node outside
    the scope, or graph outputs. These are what the module returns, in graph order."""
    from stages.onnx import stream

    graph = stream.skeleton(path).graph

    def inside(node: Any) -> bool:
        scope = node_scope(node)
        return scope == module or scope.startswith(module + ".")

    made = [out for node in graph.node if inside(node) for out in node.output if out]
    read_outside = {i for node in graph.node if not inside(node) for i in node.input}
    leaving = read_outside | {o.name for o in graph.output}
    return [t for t in made if t in leaving]


TIED_MIN_ELEMENTS = 1 << 10  # weights, not small constants


def share_tied_weights(model: Any, base: Path | None = None) -> list[dict[str, Any]]:
    """Store a tied weight once. An exporter folds `lm_head = embedding.T` into a second,
    transposed initializer (GPT-2: 154 MB of 652 MB) and may keep exact copies; each such
    initializer is replaced by the one it copies (an exact copy: its uses are renamed; a
    transposed copy: a Transpose node computes it, which ONNX Runtime folds at load).
    Returns what was shared. Initializers a subgraph, a graph input or output names stay.
    External weights (under `base`) are memory-mapped and compared a block at a time."""
    from onnx import helper

    from stages.onnx import stream

    graph = model.graph
    pinned = {v.name for v in (*graph.input, *graph.output)} | _subgraph_names(graph)
    big = [
        t for t in graph.initializer if np.prod(t.dims) >= TIED_MIN_ELEMENTS and len(t.dims) >= 1
    ]
    by_shape: dict[tuple[int, tuple[int, ...]], list[Any]] = {}
    for t in big:
        by_shape.setdefault((t.data_type, tuple(t.dims)), []).append(t)
    arrays: dict[str, np.ndarray] = {}

    def array(t: Any) -> np.ndarray:
        if t.name not in arrays:
            arrays[t.name] = stream.array(t, base or Path("."))
        return arrays[t.name]

    shared: list[dict[str, Any]] = []
    dropped: set[str] = set()
    for b in big:
        if b.name in pinned:
            continue
        for how, shape in (("copy", tuple(b.dims)), ("transpose", tuple(b.dims)[::-1])):
            if how == "transpose" and len(b.dims) != 2:
                continue
            for a in by_shape.get((b.data_type, shape), []):
                if a.name == b.name or a.name in dropped or b.name in dropped:
                    continue
                if _keep_order(b) < _keep_order(a):
                    continue  # b is the one to keep; a is dropped when its turn comes
                want = array(a).T if how == "transpose" else array(a)
                if _equal(want, array(b)):
                    dropped.add(b.name)
                    shared.append({"dropped": b.name, "kept": a.name, "how": how})
                    break
            if b.name in dropped:
                break
    arrays.clear()  # unmaps the weights
    if not shared:
        return []
    drop = {s["dropped"]: s for s in shared}
    kept = [t for t in graph.initializer if t.name not in drop]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    transposes: list[Any] = []
    for s in shared:
        if s["how"] == "copy":
            for node in graph.node:
                node.input[:] = [s["kept"] if i == s["dropped"] else i for i in node.input]
        else:
            transposes.append(
                helper.make_node(
                    "Transpose",
                    [s["kept"]],
                    [s["dropped"]],
                    name=f"/tied/Transpose_{len(transposes)}",
                    perm=[1, 0],
                )
            )
    for i, node in enumerate(transposes):
        graph.node.insert(i, node)
    return shared


TIED_BLOCK_BYTES = 16 << 20


def _equal(want: np.ndarray, got: np.ndarray) -> bool:
    """np.array_equal a block of rows at a time, the first row alone first: it decides
    most pairs, and no comparison makes a temporary the size of the weight."""
    if want.shape != got.shape:
        return False
    if got.ndim == 0 or got.size == 0:
        return bool(np.array_equal(want, got))
    if not np.array_equal(want[:1], got[:1]):  # different weights differ in the first row:
        return False  # 9,316 same-shape pairs on a 30-layer decoder took 6 s compared whole
    rows = max(1, TIED_BLOCK_BYTES // got[:1].nbytes)
    return all(
        np.array_equal(want[i : i + rows], got[i : i + rows]) for i in range(0, len(got), rows)
    )


def _keep_order(t: Any) -> tuple[bool, str]:
    """Of two tied initializers the first in this order stays: a named parameter before an
    exporter's folded constant (`onnx::MatMul_608`), then by name."""
    return (t.name.startswith("onnx::"), t.name)


def _subgraph_names(graph: Any) -> set[str]:
    """Every name a node's subgraph (If/Loop/Scan body) reads: left alone."""
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                for inner in sub.node:
                    names.update(inner.input)
                names |= _subgraph_names(sub)
    return names
