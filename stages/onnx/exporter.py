"""The export stage's machinery: torch.onnx.export with named dynamic dims (legacy or dynamo),
the static-axis check, and probing the graph in ONNX Runtime at every corner and odd size."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

from schemas import StageError
from stages._runtime import StageContext
from stages.onnx import shapes as sh

STAGE = "export"
STRIPPED_METADATA = ("pkg.torch.onnx.stack_trace",)  # absolute source paths: not reproducible


def trace_graph(
    ctx: StageContext, flat: Any, lay: sh.Layout, export: Any, trace: dict[str, int], external: bool
) -> Path:
    """torch.onnx.export into a scratch folder; `finish` turns it into the shipped graph.
    Two steps so that the caller can free the PyTorch model in between (peak memory)."""
    import torch

    feeds = sh.make_inputs(lay, trace, seed=0)
    args = tuple(torch.from_numpy(feeds[t.name]) for t in lay.inputs)
    raw = ctx.work / "_raw"
    raw.mkdir()
    kwargs: dict[str, Any] = {
        "input_names": [t.name for t in lay.inputs],
        "output_names": [t.name for t in lay.outputs],
        "opset_version": export.opset,
    }
    if export.exporter == "dynamo":
        kwargs.update(
            dynamo=True,
            dynamic_shapes=(_dynamic_shapes(lay, export.dims),),
            external_data=external,
            optimize=True,
            verbose=False,
        )
    else:
        kwargs.update(dynamo=False, dynamic_axes=_legacy_axes(lay, export.dims))
    try:
        # The tracer's warnings are about transformers internals the probes below re-check.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(flat, args, str(raw / "model.onnx"), **kwargs)
    except Exception as exc:  # the exporters raise many types; all mean "cannot export"
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise StageError(
            STAGE,
            f"torch.onnx.export ({export.exporter}) failed: {first[:400]}",
            "a dim the model treats as constant cannot be dynamic; see the "
            "exporter message above, or try the other export.exporter",
        ) from None
    return raw / "model.onnx"


def finish(
    ctx: StageContext, raw_path: Path, lay: sh.Layout, external: bool
) -> tuple[Path, list[dict[str, Any]]]:
    """Name the dims, drop unreproducible metadata, store tied weights once, save (external
    data when asked), check. Returns the graph's path and the weights it shares."""
    import onnx

    from stages.onnx.graph import share_tied_weights

    raw = raw_path.parent

    model = onnx.load(str(raw_path))
    _normalize(model, lay)
    tied = share_tied_weights(model)
    for t in tied:
        ctx.log(f"tied weight stored once: {t['dropped']} is {t['how']} of {t['kept']}")
    path = ctx.work / "model.onnx"
    if external:
        _to_external(model, "model.onnx.data")
    onnx.save_model(model, str(path))  # writes the tensors marked external to their file
    del model  # the checker reads the saved file; one copy of the graph at a time
    shutil.rmtree(raw)
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise StageError(STAGE, f"exported graph is not valid ONNX: {str(exc)[:300]}") from None
    return path, tied


INLINE_DTYPES = (6, 7, 9)  # INT32, INT64, BOOL: shape constants, indices, mode flags
INLINE_BYTES = 1 << 20
SCALAR_BYTES = 8


def _to_external(model: Any, location: str) -> None:
    """Mark the weights for one external data file. Integer and bool tensors under 1 MiB and
    scalars stay inline: ONNX Runtime's shape inference reads the constant inputs of
    Reshape/Unsqueeze/Slice and cannot from external data (dynamo's graphs hold them as
    initializers), and the eval-mode check reads flags such as Dropout's training_mode. A
    plain size threshold would instead leave a small model's weights inline under `always`."""
    from onnx import TensorProto, numpy_helper
    from onnx.external_data_helper import set_external_data

    for tensor in model.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            continue
        if not tensor.HasField("raw_data"):  # typed fields (float_data, ...) -> raw bytes
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
        size = len(tensor.raw_data)
        if size <= SCALAR_BYTES or (tensor.data_type in INLINE_DTYPES and size < INLINE_BYTES):
            continue
        set_external_data(tensor, location)


def _legacy_axes(lay: sh.Layout, dims: dict[str, Any]) -> dict[str, dict[int, str]]:
    static = {n for n, d in dims.items() if d.min == d.max}
    return {
        name: {i: a for i, a in axes.items() if a not in static}
        for name, axes in lay.dynamic_axes().items()
    }


def _dynamic_shapes(lay: sh.Layout, dims: dict[str, Any]) -> tuple[dict[int, Any], ...]:
    from torch.export import Dim

    made = {n: Dim(n, min=d.min, max=d.max) for n, d in dims.items() if d.min < d.max}
    made[sh.TOTAL] = Dim.DYNAMIC  # past + sequence: torch.export derives it
    return tuple({i: made[a] for i, a in enumerate(t.axes) if a in made} for t in lay.inputs)


def _normalize(model: Any, lay: sh.Layout) -> None:
    """Give every declared symbolic axis its spec name; drop non-reproducible metadata."""
    by_name = {t.name: t for t in (*lay.inputs, *lay.outputs)}
    for value in (*model.graph.input, *model.graph.output):
        t = by_name.get(value.name)
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if t and i < len(t.axes) and isinstance(t.axes[i], str) and dim.dim_param:
                dim.dim_param = t.axes[i]
    for node in model.graph.node:
        keep = [p for p in node.metadata_props if p.key not in STRIPPED_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)


def static_axes(path: Path, lay: sh.Layout) -> list[str]:
    """Every declared dim must be symbolic in the saved graph."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    declared = {t.name: t for t in (*lay.inputs, *lay.outputs)}
    problems = []
    for value in (*graph.input, *graph.output):
        t = declared.get(value.name)
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if t and i < len(t.axes) and isinstance(t.axes[i], str) and not dim.dim_param:
                problems.append(
                    f"{value.name} axis {i} ({t.axes[i]}) is baked in as "
                    f"{dim.dim_value}; it must be symbolic"
                )
    return problems


def probe(
    ctx: StageContext,
    path: Path,
    lay: sh.Layout,
    dims: dict[str, Any],
    trace: dict[str, int],
    odd: bool,
) -> dict[str, Any]:
    """Run the graph at min/max/odd sizes, all together and one dim at a time."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        raise StageError(
            STAGE,
            f"ONNX Runtime cannot load the exported graph: {str(exc).splitlines()[0][:400]}",
            "try the other export.exporter or another export.opset; report the message",
        ) from None
    plans = _plans(dims, trace, odd)
    runs, problems, blamed = [], [], set()
    with ctx.progress("running the graph at other shapes", len(plans)) as advance:
        for label, sizes in plans:
            error = _run_once(session, lay, sizes)
            runs.append({"shape": label, "sizes": sizes, "ok": error is None})
            changed = sorted(d for d in sizes if sizes[d] != trace[d])
            if error and label.startswith("only ") and changed[0] not in blamed:
                blamed.add(changed[0])
                d = changed[0]
                problems.append(
                    f"dim {d!r} is baked into the graph: it runs at the trace size "
                    f"{d}={trace[d]} but not at {d}={sizes[d]}: {error}"
                )
            advance()
    if not problems:
        problems = [f"graph fails at {r['shape']} {r['sizes']}" for r in runs if not r["ok"]]
    return {"runs": runs, "problems": problems}


def _plans(dims: dict[str, Any], trace: dict[str, int], odd: bool) -> list[tuple[str, dict]]:
    at = sh.corners(dims, ("min", "max"), odd_avoid=trace if odd else None)
    plans = [
        (f"only {n}={c[n]}", {**trace, n: c[n]})
        for n in dims
        for c in at.values()
        if c[n] != trace[n]
    ]
    plans = list({str(s): (label, s) for label, s in plans}.values())
    return plans + [(f"all {k}", sizes) for k, sizes in at.items()]


def _run_once(session: Any, lay: sh.Layout, sizes: dict[str, int]) -> str | None:
    """None if the graph ran and every declared output axis has the right size."""
    feeds = sh.make_inputs(lay, sizes, seed=1)
    try:
        outs = session.run(None, feeds)
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument types
        return str(exc).splitlines()[0][:300]
    full = sh.with_total(sizes)
    for t, out in zip(lay.outputs, outs, strict=True):
        for i, a in enumerate(t.axes):
            want = full[a] if isinstance(a, str) else a
            if i >= out.ndim or out.shape[i] != want:
                return (
                    f"output {t.name} has shape {list(out.shape)}, axis {i} ({a}) should be {want}"
                )
    return None
