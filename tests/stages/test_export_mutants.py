"""export's dynamic-axis guarantees at unit level, on the small trap models and on graphs
made by hand: which shapes the graph is probed at (min, max and an odd size, one dim at a
time and all together), which dim a failure is blamed on, and what a passing export says.
Fast enough to run per mutant (scripts/mutation.py); the tiny-gpt2 probes are in
test_export_onnx.py (a whole release)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from schemas.details import ExportDetails
from stages.onnx import exporter
from stages.onnx import shapes as sh
from tests.conftest import Workspace, generic_spec

BATCH = {"min": 1, "opt": 2, "max": 4}
LENGTH = {"min": 2, "opt": 4, "max": 6}


def test_the_plans_are_the_corners_then_one_dim_at_a_time() -> None:
    """The corners move every dim together; each one-dim plan names the one dim it moved
    from the trace sizes (the one a failure blames). The odd corner gives each dim its own
    size: length skips 3, batch's."""
    dims = {"batch": BATCH, "length": LENGTH}
    trace = sh.trace_sizes(dims)
    assert trace == {"batch": 2, "length": 4}
    assert exporter._plans(dims, trace, odd=True) == (
        [
            ("all min", {"batch": 1, "length": 2}, None),
            ("all max", {"batch": 4, "length": 6}, None),
            ("all odd", {"batch": 3, "length": 5}, None),
        ],
        [
            ("only batch=1", {"batch": 1, "length": 4}, "batch"),
            ("only batch=4", {"batch": 4, "length": 4}, "batch"),
            ("only batch=3", {"batch": 3, "length": 4}, "batch"),
            ("only length=2", {"batch": 2, "length": 2}, "length"),
            ("only length=6", {"batch": 2, "length": 6}, "length"),
            ("only length=5", {"batch": 2, "length": 5}, "length"),
        ],
    )
    corners, one_dim = exporter._plans(dims, trace, odd=False)
    assert [label for label, _, _ in corners] == ["all min", "all max"]
    assert [label for label, _, _ in one_dim] == [
        "only batch=1",
        "only batch=4",
        "only length=2",
        "only length=6",
    ]


def test_the_odd_sizes_are_low_in_the_range_and_differ_between_dims() -> None:
    """past and sequence share a range: the odd corner still gives them different sizes
    (a graph that confuses them fails there), a sixteenth of the way up (cheap to run)."""
    same = {"min": 1, "opt": 16, "max": 1024}
    odd = sh.corners({"past_sequence": {**same, "min": 0}, "sequence": same}, (), {})["odd"]
    assert odd == {"past_sequence": 63, "sequence": 65}
    assert odd["past_sequence"] != odd["sequence"]
    with_trace = sh.corners({"sequence": same}, (), {"sequence": 65})["odd"]
    assert with_trace == {"sequence": 63}
    # the same range and the same trace size: only the distinctness rule parts them
    twins = sh.corners({"a": same, "b": same}, (), {"a": 16, "b": 16})["odd"]
    assert twins == {"a": 65, "b": 63}
    # one odd size in range for both: the second dim shares it rather than lose its odd
    # probe to the max (3 is the only odd size strictly inside [2, 4])
    narrow = {"min": 2, "opt": 2, "max": 4}
    assert sh.corners({"a": narrow, "b": narrow}, (), {"a": 2, "b": 2})["odd"] == {
        "a": 3,
        "b": 3,
    }


def test_a_size_probed_twice_is_run_once_and_the_trace_size_never_alone() -> None:
    """A range with no odd size inside probes its max as the odd one: its one-dim run once."""
    dims = {"batch": {"min": 2, "opt": 2, "max": 3}}
    assert exporter._plans(dims, {"batch": 2}, odd=True) == (
        [
            ("all min", {"batch": 2}, None),
            ("all max", {"batch": 3}, None),
            ("all odd", {"batch": 3}, None),
        ],
        [("only batch=3", {"batch": 3}, "batch")],
    )


def test_a_small_models_export_probes_the_odd_sizes_and_says_so(ws: Workspace) -> None:
    spec = generic_spec("small", "small")
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "passed", report.reasons
    details = ExportDetails.model_validate(report.details)
    probed = [(r.shape, r.sizes, r.ok) for r in details.probed]
    assert probed == [
        ("all min", {"batch": 1}, True),
        ("all max", {"batch": 4}, True),
        ("all odd", {"batch": 3}, True),
    ]
    size = (ws.out("small", "export") / "model.onnx").stat().st_size
    assert report.summary == (
        f"1 inputs, 1 dims symbolic, ran at 3 shapes in ONNX Runtime ({size / 1e6:.1f} MB)"
    )
    assert report.metrics == {"onnx_bytes": size, "shapes_run": 3}
    assert details.trace_sizes == {"batch": 2}
    spec["export"]["odd_sizes"] = False
    report = ws.run("export", spec)
    assert [r.shape for r in ExportDetails.model_validate(report.details).probed] == [
        "all min",
        "all max",
    ]


class Ctx:
    """What probe uses of a StageContext: a progress counter."""

    def __init__(self) -> None:
        self.advanced = 0
        self.described: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def progress(self, what: str, total: int) -> Iterator[Any]:
        self.described.append((what, total))

        def advance() -> None:
            self.advanced += 1

        yield advance


def graph(tmp_path: Path, nodes: list[Any], inits: list[Any], out_shape: list[Any]) -> Path:
    """x [batch, length] float -> y."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "length"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], initializer=inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    onnx.save(model, tmp_path / "m.onnx")
    return tmp_path / "m.onnx"


LAYOUT = sh.Layout(
    inputs=(sh.Tensor("x", "float32", ("batch", "length")),),
    outputs=(sh.Tensor("y", "float32", ("batch", "length")),),
)
DIMS = {"batch": BATCH, "length": LENGTH}
TRACE = {"batch": 2, "length": 4}


def test_a_dynamic_graph_runs_at_every_probe(tmp_path: Path) -> None:
    path = graph(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [], ["batch", "length"])
    ctx = Ctx()
    found = exporter.probe(ctx, path, LAYOUT, DIMS, TRACE, True)  # type: ignore[arg-type]
    assert found.problems == []
    # every corner passes: no one-dim run is needed (each one's size was run at a corner)
    assert [r.ok for r in found.runs] == [True] * 3 and ctx.advanced == 3
    first = {"shape": "all min", "sizes": {"batch": 1, "length": 2}, "ok": True}
    assert found.runs[0].dump() == first


def test_a_corner_whose_batch_was_lowered_leaves_batch_max_to_its_own_run(
    tmp_path: Path,
) -> None:
    """A cost that fits batch 4 only at the trace length: `all max` runs at batch 2, so
    batch=4 is run alone at the trace sizes, and nothing else (batch 1 and 3 ran at the
    min and odd corners)."""
    path = graph(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [], ["batch", "length"])
    cost = lambda s: s["batch"] * s["length"]  # noqa: E731
    found = exporter.probe(Ctx(), path, LAYOUT, DIMS, TRACE, True, cost, 16)  # type: ignore[arg-type]
    assert found.problems == []
    assert [(r.shape, r.sizes) for r in found.runs] == [
        ("all min", {"batch": 1, "length": 2}),
        ("all max, batch 2 (probe memory)", {"batch": 2, "length": 6}),
        ("all odd", {"batch": 3, "length": 5}),
        ("only batch=4", {"batch": 4, "length": 4}),
    ]


def test_a_batch_max_only_a_lowered_corner_skipped_is_still_blamed(tmp_path: Path) -> None:
    """y = x[:3]: right for batch 1 to 3, three rows at batch 4. The max corner is lowered
    to batch 2 (probe memory) and passes; batch=4 alone fails and is blamed."""
    starts, ends, axes = (
        helper.make_tensor(n, TensorProto.INT64, [1], [v])
        for n, v in (("starts", 0), ("ends", 3), ("axes", 0))
    )
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])
    path = graph(tmp_path, [node], [starts, ends, axes], ["batch", "length"])
    cost = lambda s: s["batch"] * s["length"]  # noqa: E731
    found = exporter.probe(Ctx(), path, LAYOUT, DIMS, TRACE, True, cost, 16)  # type: ignore[arg-type]
    assert found.problems == [
        "dim 'batch' is baked into the graph: it runs at the trace size batch=2 but not at "
        "batch=4: output y has shape [3, 4], axis 0 (batch) should be 4"
    ]
    assert [r.shape for r in found.runs if not r.ok] == ["only batch=4"]


def test_a_graph_baked_at_the_trace_length_blames_length_once(tmp_path: Path) -> None:
    """y = x + a constant [1, 4]: it broadcasts over any batch, only at length 4."""
    bias = helper.make_tensor("bias", TensorProto.FLOAT, [1, 4], [0.0] * 4)
    path = graph(
        tmp_path, [helper.make_node("Add", ["x", "bias"], ["y"])], [bias], ["batch", "length"]
    )
    found = exporter.probe(Ctx(), path, LAYOUT, DIMS, TRACE, True)  # type: ignore[arg-type]
    [problem] = found.problems
    assert problem.startswith(
        "dim 'length' is baked into the graph: it runs at the trace size length=4 but not at "
        "length=2: "
    ), problem
    assert [r.shape for r in found.runs if not r.ok] == [
        "all min",
        "all max",
        "all odd",
        "only length=2",
        "only length=6",
        "only length=5",
    ]


def test_a_wrong_output_size_fails_the_probe_naming_the_axis(tmp_path: Path) -> None:
    """y = x[:, :4] declared [batch, length]: it runs everywhere, with the wrong length."""
    starts, ends, axes = (
        helper.make_tensor(n, TensorProto.INT64, [1], [v])
        for n, v in (("starts", 0), ("ends", 4), ("axes", 1))
    )
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])
    path = graph(tmp_path, [node], [starts, ends, axes], ["batch", 4])
    found = exporter.probe(Ctx(), path, LAYOUT, DIMS, TRACE, False)  # type: ignore[arg-type]
    [problem] = found.problems
    assert problem == (
        "dim 'length' is baked into the graph: it runs at the trace size length=4 but not at "
        "length=6: output y has shape [2, 4], axis 1 (length) should be 6"
    )


def test_failures_no_single_dim_explains_are_listed_by_shape(tmp_path: Path) -> None:
    """x reshaped to pairs and back: it runs wherever batch * length is even, so only the
    odd corner (3, 5) fails, where both dims moved: no dim is blamed, the shape is named."""
    pairs = helper.make_tensor("pairs", TensorProto.INT64, [2], [-1, 2])
    nodes = [
        helper.make_node("Reshape", ["x", "pairs"], ["t"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Reshape", ["t", "s"], ["y"]),
    ]
    path = graph(tmp_path, nodes, [pairs], ["batch", "length"])
    found = exporter.probe(Ctx(), path, LAYOUT, DIMS, TRACE, True)  # type: ignore[arg-type]
    assert found.problems == ["graph fails at all odd {'batch': 3, 'length': 5}"]


def test_one_run_checks_every_declared_output_axis(tmp_path: Path) -> None:
    import onnxruntime as ort

    path = graph(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [], ["batch", "length"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert exporter._run_once(session, LAYOUT, TRACE) is None
    longer = sh.Layout(
        inputs=LAYOUT.inputs, outputs=(sh.Tensor("y", "float32", ("batch", "length", 3)),)
    )
    assert exporter._run_once(session, longer, TRACE) == (
        "output y has shape [2, 4], axis 2 (3) should be 3"
    )
    fixed = sh.Layout(inputs=LAYOUT.inputs, outputs=(sh.Tensor("y", "float32", ("batch", 5)),))
    assert exporter._run_once(session, fixed, TRACE) == (
        "output y has shape [2, 4], axis 1 (5) should be 5"
    )


def test_a_static_axis_in_the_saved_graph_is_named(tmp_path: Path) -> None:
    path = graph(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [], [2, "length"])
    assert exporter.static_axes(path, LAYOUT) == [
        "y axis 0 (batch) is baked in as 2; it must be symbolic"
    ]
    path = graph(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [], ["batch", "length"])
    assert exporter.static_axes(path, LAYOUT) == []


def test_the_report_json_of_a_baked_length_blames_it_only(ws: Workspace) -> None:
    spec = generic_spec("baked-len", "baked_length")
    spec["export"] = {
        "dims": {"batch": BATCH, "length": LENGTH},
        "inputs": [{"name": "x", "shape": ["batch", "length", 8]}],
        "outputs": [{"name": "y", "shape": ["batch", 32]}],
    }
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "failed"
    assert report.summary == "1 dynamic-axis problem(s)"
    saved = json.loads((ws.out("baked-len", "export") / "report.json").read_text())
    assert saved["reasons"] == report.reasons


def test_a_graph_onnx_runtime_cannot_load_is_refused_with_its_first_line(tmp_path: Path) -> None:
    import onnxruntime as ort

    from schemas import Refused

    path = tmp_path / "m.onnx"
    path.write_bytes(b"not a graph")
    with pytest.raises(Exception) as first:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with pytest.raises(Refused) as info:
        exporter.probe(Ctx(), path, LAYOUT, DIMS, TRACE, True)  # type: ignore[arg-type]
    assert info.value.message == (
        "ONNX Runtime cannot load the exported graph: " + str(first.value).splitlines()[0][:400]
    )
    assert info.value.hint == (
        "try the other export.exporter or another export.opset; report the message"
    )


def test_the_probe_progress_says_what_runs(tmp_path: Path) -> None:
    path = graph(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [], ["batch", "length"])
    ctx = Ctx()
    exporter.probe(ctx, path, LAYOUT, DIMS, TRACE, False)  # type: ignore[arg-type]
    assert ctx.described == [("running the graph at its corners", 2)]
    bias = helper.make_tensor("bias", TensorProto.FLOAT, [1, 4], [0.0] * 4)
    baked = graph(
        tmp_path, [helper.make_node("Add", ["x", "bias"], ["y"])], [bias], ["batch", "length"]
    )
    ctx = Ctx()
    exporter.probe(ctx, baked, LAYOUT, DIMS, TRACE, False)  # type: ignore[arg-type]
    assert ctx.described == [
        ("running the graph at its corners", 2),
        ("a corner failed: moving one dim at a time to blame it", 4),
    ]


def test_a_failed_run_keeps_onnx_runtimes_first_line(tmp_path: Path) -> None:
    import onnxruntime as ort

    bias = helper.make_tensor("bias", TensorProto.FLOAT, [1, 4], [0.0] * 4)
    path = graph(
        tmp_path, [helper.make_node("Add", ["x", "bias"], ["y"])], [bias], ["batch", "length"]
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    error = exporter._run_once(session, LAYOUT, {"batch": 2, "length": 5})
    assert error is not None and error.startswith("[ONNXRuntimeError]") and "\n" not in error


def test_the_dynamo_dims_carry_the_spec_ranges_and_fixed_dims_are_left_out() -> None:
    from types import SimpleNamespace

    lay = sh.Layout(
        inputs=(
            sh.Tensor("x", "float32", ("batch", "length", "width")),
            sh.Tensor("mask", "int64", ("batch", sh.TOTAL)),
        ),
        outputs=(sh.Tensor("y", "float32", ("batch",)),),
    )
    dims = {
        "batch": SimpleNamespace(min=1, max=4),
        "length": SimpleNamespace(min=2, max=6),
        "width": SimpleNamespace(min=8, max=8),  # fixed: not dynamic
    }
    x, mask = exporter._dynamic_shapes(lay, dims)
    assert sorted(x) == [0, 1] and sorted(mask) == [0, 1]
    assert (x[0].__name__, x[0].min, x[0].max) == ("batch", 1, 4)
    assert (x[1].__name__, x[1].min, x[1].max) == ("length", 2, 6)
    assert mask[0] is x[0]
    assert str(mask[1]) == "DimHint(DYNAMIC)"


def test_normalize_names_the_declared_axes_and_strips_source_paths() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["s0", "s1"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["s0", 7])
    other = helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["s9"])
    node = helper.make_node("Relu", ["x"], ["y"])
    for key, value in (("pkg.torch.onnx.stack_trace", "/home/me/x.py"), ("keep", "k")):
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value
    model = helper.make_model(helper.make_graph([node], "g", [x], [y, other]))
    lay = sh.Layout(
        inputs=(sh.Tensor("x", "float32", ("batch", "length")),),
        outputs=(sh.Tensor("y", "float32", ("batch", "length")),),
    )
    exporter._normalize(model, lay)
    dims = [
        [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (*model.graph.input, *model.graph.output)
    ]
    assert dims == [["batch", "length"], ["batch", 7], ["s9"]]
    assert [(p.key, p.value) for p in model.graph.node[0].metadata_props] == [("keep", "k")]


def test_the_external_weights_are_the_large_ones_wherever_they_are_stored(
    tmp_path: Path,
) -> None:
    import numpy as np
    from onnx import numpy_helper

    floats = numpy_helper.from_array(np.ones(64, np.float32), "floats")  # raw_data
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [64], [1.0] * 64)  # float_data
    ints = numpy_helper.from_array(np.ones(64, np.int64), "ints")  # a shape-like constant
    scalar = numpy_helper.from_array(np.ones(1, np.float32), "scalar")
    model = helper.make_model(
        helper.make_graph([], "g", [], [], initializer=[floats, typed, ints, scalar])
    )
    assert exporter._external_names(model, tmp_path) == {"floats", "typed"}


class LoggingCtx(Ctx):
    def __init__(self, work: Path) -> None:
        super().__init__()
        self.work = work
        self.logged: list[str] = []

    def log(self, message: str) -> None:
        self.logged.append(message)


def raw_graph(tmp_path: Path, nodes: list[Any], inits: list[Any]) -> Path:
    """A raw export as trace_graph leaves it: its weights in a data file beside it."""
    raw = tmp_path / "_raw"
    raw.mkdir()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], initializer=inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    onnx.save_model(
        model,
        str(raw / "model.onnx"),
        save_as_external_data=True,
        location="weights.bin",
        size_threshold=0,
    )
    return raw / "model.onnx"


def test_finish_stores_a_copied_weight_once_and_says_so(tmp_path: Path) -> None:
    import numpy as np
    import onnxruntime as ort
    from onnx import numpy_helper

    w = (np.arange(1024, dtype=np.float32) / 1024).reshape(32, 32)  # a weight: 1024 values
    inits = [numpy_helper.from_array(w, "a"), numpy_helper.from_array(w.copy(), "b")]
    nodes = [
        helper.make_node("MatMul", ["x", "a"], ["h"]),
        helper.make_node("MatMul", ["h", "b"], ["y"]),
    ]
    work = tmp_path / "work"
    work.mkdir()
    ctx = LoggingCtx(work)
    path, tied = exporter.finish(ctx, raw_graph(work, nodes, inits), LAYOUT_32, False)  # type: ignore[arg-type]
    assert path == work / "model.onnx" and not (work / "_raw").exists()
    assert len(tied) == 1
    assert ctx.logged == [
        f"tied weight stored once: {tied[0]['dropped']} is {tied[0]['how']} of {tied[0]['kept']}"
    ]
    assert {tied[0]["dropped"], tied[0]["kept"]} == {"a", "b"}
    shipped = onnx.load(str(path))
    assert len(shipped.graph.initializer) == 1
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.ones((2, 32), np.float32)
    assert np.allclose(session.run(None, {"x": x})[0], x @ w @ w)


LAYOUT_32 = sh.Layout(
    inputs=(sh.Tensor("x", "float32", ("batch", 32)),),
    outputs=(sh.Tensor("y", "float32", ("batch", 32)),),
)


def test_finish_refuses_a_graph_that_is_not_valid_onnx(tmp_path: Path) -> None:
    import numpy as np
    from onnx import numpy_helper

    from schemas import Refused

    w = numpy_helper.from_array(np.ones((32, 32), np.float32), "w")
    node = helper.make_node("NoSuchOp", ["x", "w"], ["y"])
    work = tmp_path / "work"
    work.mkdir()
    raw = raw_graph(work, [node], [w])
    with pytest.raises(onnx.checker.ValidationError) as expected:
        onnx.checker.check_model(str(raw))
    with pytest.raises(Refused) as info:
        exporter.finish(LoggingCtx(work), raw, LAYOUT_32, False)  # type: ignore[arg-type]
    assert info.value.message == f"exported graph is not valid ONNX: {str(expected.value)[:300]}"


class Raises:
    """A model whose forward raises `error` (what an exporter does on an untraceable op)."""

    def __init__(self, error: Exception) -> None:
        import torch

        class Model(torch.nn.Module):
            def forward(self, x: Any) -> Any:
                raise error

        self.model = Model()


EXPORT_SPEC = {"opset": 17, "dims": {"batch": BATCH}}


def trace(tmp_path: Path, model: Any, exporter_name: str) -> Path:
    from types import SimpleNamespace

    lay = sh.Layout(
        inputs=(sh.Tensor("x", "float32", ("batch", 32)),),
        outputs=(sh.Tensor("y", "float32", ("batch", 32)),),
    )
    dims = {"batch": SimpleNamespace(**BATCH)}
    export = SimpleNamespace(opset=17, exporter=exporter_name, dims=dims)
    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    return exporter.trace_graph(LoggingCtx(work), model, lay, export, {"batch": 2})  # type: ignore[arg-type]


def test_an_export_that_raises_is_refused_with_the_first_line_of_its_message(
    tmp_path: Path,
) -> None:
    from schemas import Refused

    long = "x" * 500
    with pytest.raises(Refused) as info:
        trace(tmp_path, Raises(ValueError(f"\n  \n{long}\nsecond")).model, "legacy")
    assert info.value.message == f"torch.onnx.export (legacy) failed: {'x' * 400}"
    assert info.value.hint == (
        "a dim the model treats as constant cannot be dynamic; see the exporter message "
        "above, or try the other export.exporter"
    )
    with pytest.raises(Refused) as info:
        trace(tmp_path / "b", Raises(KeyError()).model, "legacy")
    assert info.value.message == "torch.onnx.export (legacy) failed: KeyError"


def test_the_dynamo_export_leaves_its_weights_in_a_side_file(tmp_path: Path) -> None:
    """What finish reads without loading the weights: the raw graph holds none."""
    import numpy as np
    import torch

    class Flat(torch.nn.Module):  # as the adapter takes the inputs: positionally, *args
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())

        def forward(self, *inputs: Any) -> Any:
            return self.model(*inputs)

    raw = trace(tmp_path, Flat().eval(), "dynamo")
    graph = onnx.load(str(raw), load_external_data=False).graph
    weights = [t for t in graph.initializer if np.prod(t.dims) >= 1024]
    assert weights and all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)
    assert raw.stat().st_size < 32 * 32 * 4
