"""ONNX graph helpers shared by the checking stages: module scopes, constants, all tensors."""

from __future__ import annotations

import ast
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

    The weights are never loaded into Python: the marked graph is saved beside links to the
    original's external data files, so a model beyond protobuf's 2 GiB works too (Polygraphy
    serializes the whole model to bytes, which fails there)."""
    import os
    import shutil
    import tempfile

    import onnx
    import onnxruntime as ort

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    known = {o.name for o in graph.output}
    marked = [out for node in graph.node for out in node.output if out and out not in known]
    graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in dict.fromkeys(marked))
    files = {
        entry.value
        for t in graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    # beside the model's folder (same file system, so the data files are linked, not copied)
    with tempfile.TemporaryDirectory(prefix=".all-tensors-", dir=path.parent.parent) as tmp:
        for name in files:
            try:
                os.link(path.parent / name, Path(tmp) / name)
            except OSError:
                shutil.copyfile(path.parent / name, Path(tmp) / name)
        onnx.save(model, str(Path(tmp) / path.name))
        del model
        session = ort.InferenceSession(
            str(Path(tmp) / path.name), providers=["CPUExecutionProvider"]
        )
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds), strict=True))


def scoped_outputs(path: Path) -> list[tuple[str, str]]:
    """(module scope, tensor name) for every node output, in graph (topological) order."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return [(node_scope(node), out) for node in graph.node for out in node.output if out]


TIED_MIN_ELEMENTS = 1 << 10  # weights, not small constants


def share_tied_weights(model: Any) -> list[dict[str, Any]]:
    """Store a tied weight once. An exporter folds `lm_head = embedding.T` into a second,
    transposed initializer (GPT-2: 154 MB of 652 MB) and may keep exact copies; each such
    initializer is replaced by the one it copies (an exact copy: its uses are renamed; a
    transposed copy: a Transpose node computes it, which ONNX Runtime folds at load).
    Returns what was shared. Initializers a subgraph, a graph input or output names stay."""
    from onnx import helper, numpy_helper

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
            arrays[t.name] = numpy_helper.to_array(t)
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
                got = array(b)
                if np.array_equal(want[:1], got[:1]) and np.array_equal(want, got):
                    dropped.add(b.name)
                    shared.append({"dropped": b.name, "kept": a.name, "how": how})
                    break
            if b.name in dropped:
                break
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
