"""The streaming ONNX writer and reader (stages/onnx/stream.py): byte for byte what onnx
writes, weights never parsed into Python, and what the legacy exporter hands over."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from stages.onnx import exporter, stream

DTYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "bool": TensorProto.BOOL,
    "uint8": TensorProto.UINT8,
}


def _model(tensors: list[TensorProto]) -> onnx.ModelProto:
    """A graph that reads every tensor (Identity per initializer), with the fields around
    the initializers filled: doc strings, value_info, metadata, a function."""
    nodes = [helper.make_node("Identity", [t.name], [f"out{i}"]) for i, t in enumerate(tensors)]
    outputs = [
        helper.make_tensor_value_info(f"out{i}", t.data_type, list(t.dims))
        for i, t in enumerate(tensors)
    ]
    graph = helper.make_graph(nodes, "g", [], outputs, tensors, doc_string="graph doc")
    graph.value_info.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.doc_string = "model doc"
    helper.set_model_props(model, {"k": "v"})
    return model


def _tensors(rng: np.random.Generator) -> list[TensorProto]:
    big = rng.standard_normal((300, 40)).astype("f4")  # over the scalar and int thresholds
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])  # float_data
    doc = numpy_helper.from_array(rng.standard_normal((5, 7)).astype("f2"), "half")
    doc.doc_string = "a tensor doc string after raw_data"
    return [
        numpy_helper.from_array(big, "big"),
        numpy_helper.from_array(np.array(3, dtype="i8"), "scalar"),
        numpy_helper.from_array(np.arange(10, dtype="i8"), "shape_const"),
        numpy_helper.from_array(np.zeros((0, 4), dtype="f4"), "empty"),
        numpy_helper.from_array(rng.integers(0, 2, (1_100_000,)).astype(bool), "mask"),
        typed,
        doc,
    ]


def _externalized(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """`model` saved with its raw tensors in one data file, loaded back without them
    (onnx.save_model moves the bytes out of the model it is given: it gets a copy)."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(
        copy,
        str(folder / "raw.onnx"),
        save_as_external_data=True,
        location="raw.bin",
        size_threshold=0,
    )
    return onnx.load(str(folder / "raw.onnx"), load_external_data=False)


def test_inline_save_is_byte_identical_to_onnx(tmp_path: Path) -> None:
    model = _model(_tensors(np.random.default_rng(0)))
    want = model.SerializeToString()
    raw = _externalized(model, tmp_path / "raw")
    assert any(t.data_location == TensorProto.EXTERNAL for t in raw.graph.initializer)
    stream.save(raw, tmp_path / "raw", tmp_path / "out.onnx", set(), "out.onnx.data")
    assert (tmp_path / "out.onnx").read_bytes() == want
    assert not (tmp_path / "out.onnx.data").exists()


def test_external_save_matches_onnx_layout(tmp_path: Path) -> None:
    """The same files as marking the tensors external and calling onnx.save_model."""
    model = _model(_tensors(np.random.default_rng(1)))
    names = {
        t.name
        for t in model.graph.initializer
        if stream.goes_external(t.data_type, numpy_helper.to_array(t).nbytes)
    }
    assert names == {"big", "mask", "typed", "half"}  # ints and the scalar stay inline
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    for t in ref.graph.initializer:
        if t.name in names:
            if not t.HasField("raw_data"):
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))
            onnx.external_data_helper.set_external_data(t, "m.onnx.data")
    (tmp_path / "ref").mkdir()
    onnx.save_model(ref, str(tmp_path / "ref" / "m.onnx"))
    raw = _externalized(model, tmp_path / "raw")
    (tmp_path / "ours").mkdir()
    stream.save(raw, tmp_path / "raw", tmp_path / "ours" / "m.onnx", names, "m.onnx.data")
    for name in ("m.onnx", "m.onnx.data"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shapes=st.lists(
        st.tuples(
            st.sampled_from(sorted(DTYPES)),
            st.lists(st.integers(0, 300), min_size=0, max_size=3),
        ),
        min_size=0,
        max_size=6,
    )
)
def test_save_and_skeleton_round_trip_any_tensors(
    tmp_path_factory: pytest.TempPathFactory, shapes: list[tuple[str, list[int]]]
) -> None:
    """Any mix of dtypes and shapes (empty, scalar, big): the inline save equals onnx's
    bytes, and its skeleton points at exactly each weight's bytes in the file."""
    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(len(shapes))
    tensors = [
        numpy_helper.from_array((rng.random(dims) * 3).astype(dtype), f"t{i}")
        for i, (dtype, dims) in enumerate(shapes)
    ]
    model = _model(tensors)
    raw = _externalized(model, tmp / "raw")
    stream.save(raw, tmp / "raw", tmp / "m.onnx", set(), "m.onnx.data")
    data = (tmp / "m.onnx").read_bytes()
    assert data == model.SerializeToString()
    skeleton = stream.skeleton(tmp / "m.onnx")
    assert skeleton.graph.node == model.graph.node
    for got, want in zip(skeleton.graph.initializer, model.graph.initializer, strict=True):
        if got.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in got.external_data}
            assert info["location"] == "m.onnx"
            start, length = int(info["offset"]), int(info["length"])
            assert data[start : start + length] == want.raw_data
            assert stream.goes_external(want.data_type, len(want.raw_data))
        else:
            assert got == want


def test_view_runs_the_same_in_onnx_runtime(tmp_path: Path) -> None:
    """ONNX Runtime on the view (weights read from the file) computes what it computes on
    the file itself; the view is a small graph; nothing is left behind."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((512, 256)).astype("f4")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 256])],
        [numpy_helper.from_array(w, "w")],
    )
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    x = rng.standard_normal((3, 512)).astype("f4")
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with stream.external_view(path) as view:
        assert view.stat().st_size < 1000 < path.stat().st_size
        got = ort.InferenceSession(str(view), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
    np.testing.assert_array_equal(got[0], want[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["model.onnx"]


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    model = _model(_tensors(np.random.default_rng(3)))
    data = model.SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception):  # noqa: B017,PT011 (onnx's DecodeError or ours)
        stream.skeleton(tmp_path / "cut.onnx")
    (tmp_path / "group.onnx").write_bytes(bytes([0x0B]))  # wire type 3 (a group)
    with pytest.raises(ValueError, match="wire type"):
        stream.skeleton(tmp_path / "group.onnx")


def test_external_data_outside_the_folder_is_refused(tmp_path: Path) -> None:
    tensor = numpy_helper.from_array(np.ones(4, "f4"), "w")
    onnx.external_data_helper.set_external_data(tensor, "../escape.bin", 0, 16)
    tensor.ClearField("raw_data")
    with pytest.raises(ValueError, match="outside"):
        stream.source(tensor, tmp_path)


class _Tied(torch.nn.Module):
    """Parameters of several dtypes, a tied head, a bool buffer and a folded constant; the
    embedding is over 1 MiB, so shape inference is handed the graph without it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(4200, 64)
        self.proj = torch.nn.Linear(64, 64)
        self.scale = torch.nn.Parameter(torch.rand(64, dtype=torch.float64))
        self.register_buffer("keep", torch.rand(64) > 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.emb(ids)) * self.scale.float() * self.keep
        return h @ self.emb.weight.T  # lm_head tied to the embedding


def test_held_back_weights_make_the_same_graph_as_torch(tmp_path: Path) -> None:
    """The legacy exporter handed no weights, plus `_weights_to_file`, then the inline save:
    the bytes torch.onnx.export writes itself."""
    net, ids = _Tied().eval(), torch.tensor([[1, 2, 3]])
    assert net.emb.weight.numel() * 4 > exporter.SHAPE_VALUE_BYTES  # the filter drops it
    kwargs: dict[str, Any] = {"input_names": ["ids"], "output_names": ["logits"], "dynamo": False}
    kwargs["dynamic_axes"] = {"ids": {1: "sequence"}}
    with torch.no_grad():
        torch.onnx.export(net, (ids,), str(tmp_path / "plain.onnx"), **kwargs)
        (tmp_path / "raw").mkdir()
        held: dict = {}
        with exporter._weights_held_back(held):
            torch.onnx.export(net, (ids,), str(tmp_path / "raw" / "model.onnx"), **kwargs)
    assert held, "the exporter no longer calls Graph._export_onnx: update _weights_held_back"
    assert not onnx.load(str(tmp_path / "raw" / "model.onnx")).graph.initializer
    exporter._weights_to_file(tmp_path / "raw" / "model.onnx", held, "weights.bin")
    raw = onnx.load(str(tmp_path / "raw" / "model.onnx"), load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in raw.graph.initializer)
    assert [i.name for i in raw.graph.input] == ["ids"]
    stream.save(raw, tmp_path / "raw", tmp_path / "out.onnx", set(), "unused")
    assert (tmp_path / "out.onnx").read_bytes() == (tmp_path / "plain.onnx").read_bytes()
    shutil.rmtree(tmp_path / "raw")


def test_an_unstorable_weight_dtype_is_a_stage_error(tmp_path: Path) -> None:
    from schemas import StageError

    onnx.save_model(
        helper.make_model(
            helper.make_graph(
                [helper.make_node("Identity", ["c"], ["y"])],
                "g",
                [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
            )
        ),
        str(tmp_path / "model.onnx"),
    )
    with pytest.raises(StageError, match="complex64"):
        exporter._weights_to_file(
            tmp_path / "model.onnx", {"c": torch.zeros(2, dtype=torch.complex64)}, "w.bin"
        )


@pytest.mark.parametrize("kernel", ["copy_file_range", "refused", "not a file"])
def test_weights_copied_between_buffered_writes_land_where_python_would_put_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """`_copy` appends a weight's bytes at the writer's position whether the kernel copies
    them (between bytes still in Python's buffer and bytes written after), refuses to
    (EXDEV: Python copies, from the same position), or the target is not a file; a source
    that ends early is an error either way."""
    import errno
    import io

    rng = np.random.default_rng(5)
    blob = rng.integers(0, 256, 3 * stream.COPY_BYTES // 2 + 17, dtype=np.uint8).tobytes()
    (tmp_path / "weights.bin").write_bytes(blob)
    parts = [(7, 1000), (0, len(blob)), (len(blob) - 5, 5)]
    if kernel == "refused":

        def refuse(*args: object) -> int:
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    want = b"".join(b"head" + blob[o : o + n] + b"tail" for o, n in parts)
    target: Any = io.BytesIO() if kernel == "not a file" else open(tmp_path / "out", "wb")  # noqa: SIM115
    with target:
        for offset, length in parts:
            target.write(b"head")
            stream._copy(stream.Source(tmp_path / "weights.bin", offset, length), target)
            target.write(b"tail")
        assert target.tell() == len(want)
        got = target.getvalue() if kernel == "not a file" else None
    assert (got if got is not None else (tmp_path / "out").read_bytes()) == want
    with open(tmp_path / "short", "wb") as short, pytest.raises(ValueError, match="ends before"):
        stream._copy(stream.Source(tmp_path / "weights.bin", len(blob) - 3, 10), short)
