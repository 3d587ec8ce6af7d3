from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

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
    report = json.loads((built_gpt2.out("tiny-gpt2", "export") / "report.json").read_text())
    probed = {r["shape"]: r["sizes"] for r in report["details"]["probed"]}
    assert probed["all min"] == {"batch": 1, "sequence": 1, "past_sequence": 0}
    assert probed["all max"] == {"batch": 3, "sequence": 64, "past_sequence": 24}
    assert "only batch=3" in probed and all(r["ok"] for r in report["details"]["probed"])


def test_kv_cache_graph_decodes_like_a_full_forward(built_gpt2: Workspace) -> None:
    """Prefill 5 tokens, then feed the 6th with the cache: same logits as 6 at once."""
    session = ort.InferenceSession(str(built_gpt2.out("tiny-gpt2", "export") / "model.onnx"))
    ids = np.array([[5, 9, 2, 7, 1, 3]], dtype=np.int64)
    empty = {
        f"past_key_values.{i}.{k}": np.zeros((1, 4, 0, 16), np.float32)
        for i in range(2)
        for k in ("key", "value")
    }
    full = session.run(
        ["logits"], {"input_ids": ids, "attention_mask": np.ones((1, 6), np.int64), **empty}
    )[0]
    names = [o.name for o in session.get_outputs()]
    prefill = dict(
        zip(
            names,
            session.run(
                None,
                {"input_ids": ids[:, :5], "attention_mask": np.ones((1, 5), np.int64), **empty},
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
        ["logits"], {"input_ids": ids[:, 5:], "attention_mask": np.ones((1, 6), np.int64), **past}
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
