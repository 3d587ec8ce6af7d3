from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from schemas import StageReport
from schemas.details import ExportDetails
from tests.conftest import Workspace, generic_spec, gpt2_spec


def dims_of(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_causal_lm_export_has_kv_cache_io_with_named_dims(built_gpt2: Workspace) -> None:
    graph = onnx.load(built_gpt2.out("tiny-gpt2", "export") / "model.onnx").graph
    inputs = {v.name: dims_of(v) for v in graph.input}
    outputs = {v.name: dims_of(v) for v in graph.output}
    assert inputs["input_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"] == ["batch", "total_sequence"]
    assert inputs["past_key_values.1.value"] == ["batch", 4, "past_sequence", 16]
    assert outputs["logits"] == ["batch", "sequence", 512]
    assert outputs["present.0.key"] == ["batch", 4, "total_sequence", 16]


def test_export_probes_min_max_and_odd_sizes_including_empty_cache(built_gpt2: Workspace) -> None:
    report = StageReport.model_validate_json(
        (built_gpt2.out("tiny-gpt2", "export") / "report.json").read_text()
    )
    details = ExportDetails.model_validate(report.details)
    probed = {r.shape: r.sizes for r in details.probed}
    assert probed["all min"] == {"batch": 1, "sequence": 1, "past_sequence": 0}
    assert probed["all max"] == {"batch": 3, "sequence": 64, "past_sequence": 24}
    # the corners only: every one passed, so no one-dim run was needed to blame a dim
    assert list(probed) == ["all min", "all max", "all odd"] and all(r.ok for r in details.probed)
    # and at an odd size strictly inside each range, unlike the trace's (export.odd_sizes)
    trace = details.trace_sizes
    odd = probed["all odd"]
    assert odd != trace and any(odd[d] % 2 == 1 and odd[d] != trace[d] for d in odd)


def test_kv_cache_graph_decodes_like_a_full_forward(built_gpt2: Workspace) -> None:
    """Prefill 5 tokens, then feed the 6th with the cache: same logits as 6 at once."""
    session = ort.InferenceSession(str(built_gpt2.out("tiny-gpt2", "export") / "model.onnx"))
    ids = np.array([[5, 9, 2, 7, 1, 3]], dtype=np.int64)
    empty = {
        f"past_key_values.{i}.{k}": np.zeros((1, 4, 0, 16), np.float32)
        for i in range(2)
        for k in ("key", "value")
    }
    positions = np.arange(6, dtype=np.int64)[None]
    full = session.run(
        ["logits"],
        {
            "input_ids": ids,
            "attention_mask": np.ones((1, 6), np.int64),
            "position_ids": positions,
            **empty,
        },
    )[0]
    names = [o.name for o in session.get_outputs()]
    prefill = dict(
        zip(
            names,
            session.run(
                None,
                {
                    "input_ids": ids[:, :5],
                    "attention_mask": np.ones((1, 5), np.int64),
                    "position_ids": positions[:, :5],
                    **empty,
                },
            ),
            strict=True,
        )
    )
    past = {
        f"past_key_values.{i}.{k}": prefill[f"present.{i}.{k}"]
        for i in range(2)
        for k in ("key", "value")
    }
    step = session.run(
        ["logits"],
        {
            "input_ids": ids[:, 5:],
            "attention_mask": np.ones((1, 6), np.int64),
            "position_ids": positions[:, 5:],
            **past,
        },
    )[0]
    np.testing.assert_allclose(step[:, -1], full[:, -1], atol=1e-5)


def test_export_is_byte_reproducible(built_gpt2: Workspace) -> None:
    first = (built_gpt2.out("tiny-gpt2", "export") / "model.onnx").read_bytes()
    assert built_gpt2.run("export", gpt2_spec()).status.value == "passed"
    assert (built_gpt2.out("tiny-gpt2", "export") / "model.onnx").read_bytes() == first


def test_baked_batch_fails_export_naming_the_dim(ws: Workspace) -> None:
    ws.run("pin", generic_spec("baked", "baked_batch"))
    report = ws.run("export", generic_spec("baked", "baked_batch"))
    assert report.status.value == "failed"
    assert report.reasons[0].startswith(
        "dim 'batch' is baked into the graph: it runs at the trace size batch=2 but not at batch=1"
    )
    assert list(ws.out("baked", "export").iterdir()) == [ws.out("baked", "export") / "report.json"]


def test_a_baked_dim_after_the_first_is_the_one_named(ws: Workspace) -> None:
    """The batch runs at every size, the length only at the trace's: the report blames
    `length`, not the first dim of the input."""
    spec = generic_spec("baked-len", "baked_length")
    spec["export"] = {
        "dims": {"batch": {"min": 1, "opt": 2, "max": 4}, "length": {"min": 2, "opt": 4, "max": 6}},
        "inputs": [{"name": "x", "shape": ["batch", "length", 8]}],
        "outputs": [{"name": "y", "shape": ["batch", 32]}],
    }
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "failed"
    assert report.reasons[0].startswith(
        "dim 'length' is baked into the graph: it runs at the trace size length=4 but not at "
        "length=2"
    ), report.reasons
    assert not any("'batch'" in r for r in report.reasons)


def test_dynamo_exporter_gives_the_same_named_dims(ws: Workspace) -> None:
    spec = generic_spec("small", "small")
    spec["export"]["exporter"] = "dynamo"
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "passed", report.reasons
    model = onnx.load(ws.out("small", "export") / "model.onnx")
    assert dims_of(model.graph.input[0]) == ["batch", 4, 8]
    assert b"/traps.py" not in (ws.out("small", "export") / "model.onnx").read_bytes()


def test_dynamo_exporter_baked_batch_fails_naming_the_axis(ws: Workspace) -> None:
    spec = generic_spec("baked", "baked_batch")
    spec["export"]["exporter"] = "dynamo"
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "failed"
    assert report.reasons[0] == "y axis 0 (batch) is baked in as 2; it must be symbolic"


def test_external_data_always_writes_a_side_file_that_runs(ws: Workspace) -> None:
    spec = generic_spec("small", "small")
    spec["export"]["external_data"] = "always"
    ws.run("pin", spec)
    assert ws.run("export", spec).status.value == "passed"
    out = ws.out("small", "export")
    assert (out / "model.onnx.data").stat().st_size > 16 * 8 * 4
    assert (out / "model.onnx").stat().st_size < 4096


@pytest.mark.parametrize("field,value", [("sequence", 300)])
def test_context_beyond_model_positions_is_refused(ws: Workspace, field: str, value: int) -> None:
    spec = gpt2_spec()
    spec["export"]["dims"][field] = {"min": 1, "opt": 4, "max": value}
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "failed"
    assert "exceeds the model's 256 positions" in report.reasons[0]


def _sharded_copy(ws: Workspace) -> dict[str, str]:
    """tiny-gpt2 saved as 3+ safetensors shards with an index; returns {file: sha256}."""
    import hashlib

    from transformers import AutoModelForCausalLM

    source, folder = ws.root / "models" / "tiny-gpt2", ws.root / "models" / "sharded"
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    model.save_pretrained(folder, max_shard_size="200KB", safe_serialization=True)
    for name in ("tokenizer.json",):
        (folder / name).write_bytes((source / name).read_bytes())
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 3 and (folder / "model.safetensors.index.json").is_file()
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in shards}


def test_a_sharded_checkpoint_exports_the_same_graph_as_the_single_file(ws: Workspace) -> None:
    digests = _sharded_copy(ws)
    single = gpt2_spec()
    sharded = gpt2_spec(name="sharded")
    sharded["model"] = {"kind": "hf", "path": "models/sharded"}
    sharded["pins"]["checkpoints"] = digests
    sharded["engine"] = {}
    for spec in (single, sharded):
        for stage in ("pin", "export", "evalcheck", "parity"):
            report = ws.run(stage, spec)
            assert report.status.value == "passed", (spec["name"], stage, report.reasons)
    pinned = json.loads((ws.out("sharded", "pin") / "lock.json").read_text())
    assert set(digests) <= set(pinned["checkpoints"])
    assert "model.safetensors.index.json" in pinned["checkpoints"]  # the index is hashed too
    one, many = ws.out("tiny-gpt2", "export"), ws.out("sharded", "export")
    assert (one / "model.onnx").read_bytes() == (many / "model.onnx").read_bytes()


def test_a_missing_shard_is_refused_naming_it(ws: Workspace) -> None:
    digests = _sharded_copy(ws)
    spec = gpt2_spec(name="sharded")
    spec["model"] = {"kind": "hf", "path": "models/sharded"}
    spec["pins"]["checkpoints"] = {}
    gone = sorted(digests)[1]
    (ws.root / "models" / "sharded" / gone).unlink()
    report = ws.run("export", spec)
    assert report.status.value == "failed"
    assert f"missing: {gone}" in report.summary + " ".join(report.reasons)
    assert "copy every shard" in " ".join(report.reasons) + report.summary


def test_the_tied_embedding_is_stored_once(built_gpt2: Workspace) -> None:
    """GPT-2 ties lm_head to the token embedding: the graph holds it once, so the file is
    below the weights plus one more vocab x hidden."""
    out = built_gpt2.out("tiny-gpt2", "export")
    report = StageReport.model_validate_json((out / "report.json").read_text())
    tied = ExportDetails.model_validate(report.details).tied_weights
    assert tied is not None
    assert [t.how for t in tied] == ["transpose"] and "wte" in tied[0].kept
    graph = onnx.load(str(out / "model.onnx"))
    shapes = [tuple(t.dims) for t in graph.graph.initializer]
    assert (512, 64) in shapes and (64, 512) not in shapes
    info = json.loads((out / "model_info.json").read_text())
    tied_bytes = 512 * 64 * 4  # a second copy would add this (plus buffers: the causal mask)
    assert (out / "model.onnx").stat().st_size < info["weight_bytes"] + tied_bytes


def _tied_graph(b_value: np.ndarray) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype("f4")
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(b_value, "w_t"),  # the exporter's folded transpose
        numpy_helper.from_array(w.copy(), "w_copy"),  # an exact copy
    ]
    nodes = [
        helper.make_node("Gather", ["w", "ids"], ["emb"]),
        helper.make_node("MatMul", ["emb", "w_t"], ["logits"]),
        helper.make_node("Gather", ["w_copy", "ids"], ["emb2"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 64]),
            helper.make_tensor_value_info("emb2", TensorProto.FLOAT, ["n", 32]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"ids": np.array([0, 5, 63], dtype=np.int64)})


def test_tied_and_copied_weights_are_shared_and_the_graph_computes_the_same() -> None:
    from stages.onnx.graph import share_tied_weights

    w = np.random.default_rng(0).standard_normal((64, 32)).astype("f4")
    model = _tied_graph(np.ascontiguousarray(w.T))
    before = _run(model)
    shared = share_tied_weights(model)
    assert sorted((s["dropped"], s["how"], s["kept"]) for s in shared) == [
        ("w_copy", "copy", "w"),
        ("w_t", "transpose", "w"),
    ]
    assert [t.name for t in model.graph.initializer] == ["w"]
    onnx.checker.check_model(model)
    for a, b in zip(before, _run(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_nearly_tied_weight_is_kept() -> None:
    """One element off is a different weight: sharing it would change the model."""
    from stages.onnx.graph import share_tied_weights

    w = np.random.default_rng(0).standard_normal((64, 32)).astype("f4")
    near = np.ascontiguousarray(w.T)
    near[-1, -1] += 1e-3
    model = _tied_graph(near)
    shared = share_tied_weights(model)
    assert [s["dropped"] for s in shared] == ["w_copy"]  # only the exact copy
    assert "w_t" in [t.name for t in model.graph.initializer]


def test_dynamo_with_external_data_keeps_shape_constants_inline_and_runs(ws: Workspace) -> None:
    """dynamo holds Reshape/Unsqueeze constants as initializers; written to the side file,
    ONNX Runtime could not load the graph (a real failure on gpt2-small). The weights go to
    model.onnx.data, the int64 constants stay in the graph, and parity passes."""
    from onnx import TensorProto

    spec = gpt2_spec()
    spec["export"].update(exporter="dynamo", external_data="always")
    ws.run("pin", spec)
    for stage in ("export", "evalcheck", "parity"):  # evalcheck crashed on external tensors
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    out = ws.out("tiny-gpt2", "export")
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    where = [(t.data_type, t.data_location, int(np.prod(t.dims))) for t in graph.initializer]
    ints = [loc for dtype, loc, _ in where if dtype == TensorProto.INT64]
    floats = [loc for dtype, loc, n in where if dtype == TensorProto.FLOAT and n > 2]
    assert ints and all(loc == TensorProto.DEFAULT for loc in ints)
    assert floats and all(loc == TensorProto.EXTERNAL for loc in floats)
    assert (out / "model.onnx.data").stat().st_size > 500_000
