"""The export stage's machinery: torch.onnx.export with named dynamic dims (legacy or dynamo),
the static-axis check, and probing the graph in ONNX Runtime at every corner and odd size."""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import Refused
from schemas.details import Probed
from stages._contract import StageContext
from stages.onnx import shapes as sh

if TYPE_CHECKING:
    from schemas.spec.export import DimRange, ExportConfig

STRIPPED_METADATA = ("pkg.torch.onnx.stack_trace",)  # absolute source paths: not reproducible


def trace_graph(
    ctx: StageContext, flat: Any, lay: sh.Layout, export: ExportConfig, trace: dict[str, int]
) -> Path:
    """torch.onnx.export into a scratch folder, every weight in an external data file there;
    `finish` turns it into the shipped graph. Two steps so that the caller can free the
    PyTorch model in between (peak memory)."""
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
            external_data=True,
            optimize=True,
            verbose=False,
        )
    else:
        kwargs.update(dynamo=False, dynamic_axes=_legacy_axes(lay, export.dims))
    weights: dict[str, Any] = {}
    try:
        # The tracer's warnings are about transformers internals the probes below re-check.
        with torch.no_grad(), warnings.catch_warnings(), _weights_held_back(weights):
            warnings.simplefilter("ignore")
            torch.onnx.export(flat, args, str(raw / "model.onnx"), **kwargs)
    except Exception as exc:  # the exporters raise many types; all mean "cannot export"
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise Refused(
            f"torch.onnx.export ({export.exporter}) failed: {first[:400]}",
            "a dim the model treats as constant cannot be dynamic; see the "
            "exporter message above, or try the other export.exporter",
        ) from None
    if export.exporter != "dynamo":
        _weights_to_file(raw / "model.onnx", weights, RAW_DATA)
    return raw / "model.onnx"


RAW_DATA = "weights.bin"


@contextlib.contextmanager
def _weights_held_back(into: dict[str, Any]) -> Iterator[None]:
    """Two places where the TorchScript exporter copies every weight, made to copy none
    (gpt2-small, 0.5 GB checkpoint: its peak went from 2.9 GB to 1.1 GB):

    - It encodes the graph with the weights inline: a C++ proto, its bytes, and onnx's
      parse of those bytes in Python. Handed no weights, it leaves them as graph inputs,
      and `_weights_to_file` writes them one at a time. What it would have been handed
      (after constant folding and deduplication) is kept in `into`.
    - Its whole-graph shape inference builds an ONNX model holding every weight. Shape
      inference reads constant values only for shape-like inputs (integers, and small
      float scales such as Resize's), so it is given the integer and small tensors only.

    Both are checked against torch's own output by the tests (same bytes). The dynamo
    exporter writes external data itself and calls neither."""
    import torch

    graph, jit = torch._C.Graph, torch._C
    export_original = getattr(graph, "_export_onnx", None)
    infer_original = getattr(jit, "_jit_pass_onnx_graph_shape_type_inference", None)
    if export_original is None or infer_original is None:  # another torch: it copies
        yield
        return

    def export_onnx(self: Any, params: dict[str, Any], *rest: Any) -> Any:
        into.update(params)
        return export_original(self, {}, *rest)

    def infer(g: Any, params: dict[str, Any], *rest: Any) -> Any:
        small = {
            k: v
            for k, v in params.items()
            if not v.is_floating_point() or v.numel() * v.element_size() < SHAPE_VALUE_BYTES
        }
        return infer_original(g, small, *rest)

    setattr(graph, "_export_onnx", export_onnx)  # noqa: B010 (C++ classes: no stub to type)
    setattr(jit, "_jit_pass_onnx_graph_shape_type_inference", infer)  # noqa: B010
    try:
        yield
    finally:
        setattr(graph, "_export_onnx", export_original)  # noqa: B010
        setattr(jit, "_jit_pass_onnx_graph_shape_type_inference", infer_original)  # noqa: B010


SHAPE_VALUE_BYTES = 1 << 20


def _weights_to_file(path: Path, weights: dict[str, Any], location: str) -> None:
    """Turn the graph inputs that are weights into initializers whose bytes are in
    `location`, in graph-input order (the order the exporter gives its initializers)."""
    import onnx
    import torch

    from stages.onnx import stream

    model = onnx.load(str(path))  # small: no weights in it
    graph = model.graph
    inputs = [v for v in graph.input if v.name not in weights]
    held = [v.name for v in graph.input if v.name in weights]
    dtypes = _torch_to_onnx()
    with open(path.parent / location, "wb") as data:
        for name in held:
            value = weights[name].detach().contiguous()
            if value.dtype not in dtypes:
                raise Refused(
                    f"weight {name} has dtype {value.dtype}, which ONNX cannot store",
                    "cast the model to float32, float16 or bfloat16 before exporting",
                )
            tensor = graph.initializer.add()
            tensor.dims.extend(value.shape)
            tensor.data_type = dtypes[value.dtype]
            tensor.name = name
            offset = data.tell()
            data.write(value.reshape(-1).view(torch.uint8).numpy().data)
            stream.point(tensor, location, offset, data.tell() - offset)
    del graph.input[:]
    graph.input.extend(inputs)
    weights.clear()
    onnx.save_model(model, str(path))


def _torch_to_onnx() -> dict[Any, int]:
    import torch
    from onnx import TensorProto as T

    return {
        torch.float32: T.FLOAT,
        torch.float16: T.FLOAT16,
        torch.bfloat16: T.BFLOAT16,
        torch.float64: T.DOUBLE,
        torch.int64: T.INT64,
        torch.int32: T.INT32,
        torch.int16: T.INT16,
        torch.int8: T.INT8,
        torch.uint8: T.UINT8,
        torch.bool: T.BOOL,
    }


def finish(
    ctx: StageContext, raw_path: Path, lay: sh.Layout, external: bool
) -> tuple[Path, list[dict[str, Any]]]:
    """Name the dims, drop unreproducible metadata, store tied weights once, check, save
    (external data when asked). Returns the graph's path and the weights it shares. The
    weights stay on disk: they are memory-mapped to find ties and copied a step at a time
    into the shipped graph (`stream.save`), so no step holds a second copy of them."""
    import onnx

    from stages.onnx import invariant, stream
    from stages.onnx.graph import share_tied_weights

    raw = raw_path.parent
    model = onnx.load(str(raw_path), load_external_data=False)
    _normalize(model, lay)
    tied = share_tied_weights(model, raw)
    for t in tied:
        ctx.log(f"tied weight stored once: {t['dropped']} is {t['how']} of {t['kept']}")
    # a served row's result must not depend on its padding (issue 41: stages/onnx/invariant)
    done = invariant.rewrite(model)
    if done:
        ctx.log(
            f"{done.softmaxes} softmax(es) and {done.products} probabilities x V product(s) "
            "summed in an order padding cannot change"
            + (
                "" if done.products >= done.softmaxes else
                f"; {done.softmaxes - done.products} softmax(es) reach no MatMul directly: "
                "rows there may still move in the last bit with their padding"
            )
        )  # fmt: skip
    checked = raw / "checked.onnx"  # the graph as shipped, its weights in the raw data files
    onnx.save_model(model, str(checked))
    try:
        onnx.checker.check_model(str(checked))
    except onnx.checker.ValidationError as exc:
        raise Refused(f"exported graph is not valid ONNX: {str(exc)[:300]}") from None
    path = ctx.work / "model.onnx"
    outside = _external_names(model, raw) if external else set()
    stream.save(model, raw, path, outside, "model.onnx.data")
    del model
    shutil.rmtree(raw)
    return path, tied


def _external_names(model: Any, base: Path) -> set[str]:
    """The weights that go to the external data file (`stream.goes_external`)."""
    from onnx import numpy_helper

    from stages.onnx import stream

    names = set()
    for tensor in model.graph.initializer:
        where = stream.source(tensor, base)
        if where is not None:
            size = where.length
        elif tensor.HasField("raw_data"):
            size = len(tensor.raw_data)
        else:  # typed fields (float_data, ...): their size as raw bytes
            size = numpy_helper.to_array(tensor).nbytes
        if stream.goes_external(tensor.data_type, size):
            names.add(tensor.name)
    return names


def _legacy_axes(lay: sh.Layout, dims: dict[str, DimRange]) -> dict[str, dict[int, str]]:
    static = {n for n, d in dims.items() if d.min == d.max}
    return {
        name: {i: a for i, a in axes.items() if a not in static}
        for name, axes in lay.dynamic_axes().items()
    }


def _dynamic_shapes(lay: sh.Layout, dims: dict[str, DimRange]) -> tuple[dict[int, Any], ...]:
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
    from stages.onnx import stream

    graph = stream.skeleton(path).graph
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


@dataclass(frozen=True)
class Probes:
    """What `probe` found: every run (its label, sizes, and whether the graph ran with every
    output axis right), in run order, and the problems it names."""

    runs: list[Probed]
    problems: list[str]


def probe(
    ctx: StageContext,
    path: Path,
    lay: sh.Layout,
    dims: dict[str, DimRange],
    trace: dict[str, int],
    odd: bool,
    cost: Callable[[Mapping[str, int]], int] | None = None,
    budget: int = 0,
) -> Probes:
    """Run the graph at its corners (every dim at its min, at its max, at an odd size); when
    a corner fails, one dim at a time from the trace sizes too, to blame the dim baked into
    the graph. With a `cost` (a run's activation bytes) each run's batch is lowered until it
    fits `budget` (`sh.within_budget`), and the run's label says so.

    The one-dim runs only at a failure (and where a corner's batch was lowered: batch.max
    then runs alone at the trace sizes): each takes its size from a corner, so a graph that
    passes every corner has run every dim at every probed size, and the odd corner gives
    each dim its own size, so two dims the graph confuses (past and sequence) cannot pass
    it together. On a 30-layer decoder the one-dim runs were 11 of 22 s (issue 40)."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        raise Refused(
            f"ONNX Runtime cannot load the exported graph: {str(exc).splitlines()[0][:400]}",
            "try the other export.exporter or another export.opset; report the message",
        ) from None
    corners, blame = _plans(dims, trace, odd)
    if cost is not None:
        fitted = cost

        def fit(plans: list[Plan]) -> list[Plan]:
            return [(*_fit(lb, s, dims, fitted, budget), n) for lb, s, n in plans]

        corners, blame = fit(corners), fit(blame)
    runs: list[Probed] = []
    problems: list[str] = []
    blamed: set[str] = set()

    def run(plans: list[tuple[str, dict[str, int], str | None]], what: str) -> None:
        with ctx.progress(what, len(plans)) as advance:
            for label, sizes, moved in plans:
                error = _run_once(session, lay, sizes)
                runs.append(Probed(shape=label, sizes=sizes, ok=error is None))
                if error and moved and moved not in blamed:
                    blamed.add(moved)
                    problems.append(
                        f"dim {moved!r} is baked into the graph: it runs at the trace size "
                        f"{moved}={trace[moved]} but not at {moved}={sizes[moved]}: {error}"
                    )
                advance()

    # a corner whose batch was lowered (probe memory) leaves that batch to its one-dim run
    ran = {(n, v) for _, sizes, _ in corners for n, v in sizes.items()}
    uncovered = [p for p in blame if p[2] is not None and (p[2], p[1][p[2]]) not in ran]
    run(corners + uncovered, "running the graph at its corners")
    rest = [p for p in blame if p not in uncovered]
    if not all(r.ok for r in runs) and rest:
        run(rest, "a corner failed: moving one dim at a time to blame it")
    if not problems:
        problems = [f"graph fails at {r.shape} {r.sizes}" for r in runs if not r.ok]
    return Probes(runs, problems)


def _fit(
    label: str,
    sizes: dict[str, int],
    dims: dict[str, DimRange],
    cost: Callable[[Mapping[str, int]], int],
    budget: int,
) -> tuple[str, dict[str, int]]:
    fitted = sh.within_budget(sizes, dims, cost, budget)
    if fitted == sizes:
        return label, sizes
    return f"{label}, batch {fitted['batch']} (probe memory)", fitted


Plan = tuple[str, dict[str, int], str | None]


def _plans(
    dims: dict[str, DimRange], trace: dict[str, int], odd: bool
) -> tuple[list[Plan], list[Plan]]:
    """(the corners, the one-dim runs that blame a failing corner): (label, sizes, the one
    dim moved from the trace sizes or None) per run, each size run once."""
    at = sh.corners(dims, ("min", "max"), odd_avoid=trace if odd else None)
    plans: list[Plan] = [
        (f"only {n}={c[n]}", {**trace, n: c[n]}, n)
        for n in dims
        for c in at.values()
        if c[n] != trace[n]
    ]
    one_dim = list({str(s): (label, s, n) for label, s, n in plans}.values())
    return [(f"all {k}", sizes, None) for k, sizes in at.items()], one_dim


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
