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
    from onnx import helper, numpy_helper

    inputs = {i.name for i in graph.input}
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name not in inputs}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])
            values[node.output[0]] = (
                numpy_helper.to_array(value) if hasattr(value, "raw_data") else np.asarray(value)
            )
    return values


def all_tensors(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every intermediate tensor of the graph, via Polygraphy's MARK_ALL on ONNX Runtime."""
    from polygraphy import constants
    from polygraphy.backend.onnx import BytesFromOnnx, ModifyOutputs, OnnxFromPath
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    marked = BytesFromOnnx(ModifyOutputs(OnnxFromPath(str(path)), outputs=constants.MARK_ALL))
    with OnnxrtRunner(SessionFromOnnx(marked, providers=["CPUExecutionProvider"])) as runner:
        return dict(runner.infer(feeds))


def scoped_outputs(path: Path) -> list[tuple[str, str]]:
    """(module scope, tensor name) for every node output, in graph (topological) order."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return [(node_scope(node), out) for node in graph.node for out in node.output if out]
