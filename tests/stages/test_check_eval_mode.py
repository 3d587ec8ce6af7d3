from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from stages.evalcheck import _random_nodes
from tests.conftest import Workspace, generic_spec, gpt2_spec


def build(ws: Workspace, factory: str, exporter: str = "legacy") -> dict:
    spec = generic_spec(factory, factory)
    spec["export"]["exporter"] = exporter
    for stage in ("pin", "export"):
        assert ws.run(stage, spec).status.value == "passed"
    return spec


def test_eval_mode_passes_for_tiny_gpt2(built_gpt2) -> None:
    report = built_gpt2.run("evalcheck", gpt2_spec())
    assert report.status.value == "passed"


def test_forced_dropout_fails_naming_where_randomness_enters(ws: Workspace) -> None:
    report = ws.run("evalcheck", build(ws, "forced_dropout"))
    assert report.status.value == "failed"
    assert report.reasons[0] == (
        "two forward passes on the same input differ; randomness enters in the forward of the "
        "root module ForcedDropout, between 'proj' and 'head' (dropout or sampling active at "
        "inference?)"
    )


def test_random_submodule_is_named_as_the_source(ws: Workspace) -> None:
    report = ws.run("evalcheck", build(ws, "noisy_inside"))
    assert "randomness enters in module 'noise' (same input, different output)" in report.reasons[0]


def test_forced_dropout_in_dynamo_graph_is_named_as_an_active_dropout_node(ws: Workspace) -> None:
    report = ws.run("evalcheck", build(ws, "forced_dropout", "dynamo"))
    assert any(r.startswith("active Dropout at node") for r in report.reasons), report.reasons


def test_random_op_in_the_graph_is_named(ws: Workspace) -> None:
    report = ws.run("evalcheck", build(ws, "noisy"))
    assert report.status.value == "failed"
    assert any(r.startswith("random op RandomUniformLike at node") for r in report.reasons)
    assert any("ONNX Runtime gives different results" in r for r in report.reasons)


def test_module_stuck_in_training_mode_is_named(ws: Workspace, monkeypatch) -> None:
    import traps  # the workspace put it on sys.path in build()

    build(ws, "small")
    original = traps.Small.train

    def stubborn(self, mode=True):  # eval() calls train(False): this one refuses
        original(self, mode)
        self.second.training = True
        return self

    monkeypatch.setattr(traps.Small, "train", stubborn)
    report = ws.run("evalcheck", generic_spec("small", "small"))
    assert report.reasons[0].startswith("module(s) in training mode after model.eval(): second")


def test_a_forward_pass_that_switches_a_module_to_training_mode_is_named(ws: Workspace) -> None:
    """eval() holds, the two forward passes agree (a Linear ignores the mode), but a
    forward puts `proj` in training mode: the check after the passes names it."""
    report = ws.run("evalcheck", build(ws, "trains_in_forward"))
    assert report.status.value == "failed"
    assert report.reasons[:-1] == [
        "module(s) in training mode after a forward pass: proj; a module that overrides "
        "train()/eval() or sets self.training must not do so at inference"
    ]
    # the inputs the checks ran on are kept beside the report, outside DVC's outputs
    assert "kept in build/trains_in_forward/failed/evalcheck/" in report.reasons[-1]
    kept = ws.root / "build" / "trains_in_forward" / "failed" / "evalcheck" / "failed_inputs.npz"
    with np.load(kept) as data:
        assert data.files == ["x"] and data["x"].shape[1:] == (4, 8)


def test_dropout_node_with_constant_false_training_mode_is_inert(tmp_path) -> None:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    ratio = helper.make_tensor("ratio", onnx.TensorProto.FLOAT, [], [0.5])
    for flag, expected in ((False, 0), (True, 1)):
        mode = helper.make_tensor("mode", onnx.TensorProto.BOOL, [], [flag])
        node = helper.make_node("Dropout", ["x", "ratio", "mode"], ["y"], name="drop")
        graph = helper.make_graph([node], "g", [x], [y], initializer=[ratio, mode])
        onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
        assert len(_random_nodes(tmp_path / "m.onnx")) == expected


def test_dropout_whose_training_mode_is_a_graph_input_is_flagged(tmp_path) -> None:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    mode_in = helper.make_tensor_value_info("training", onnx.TensorProto.BOOL, [])
    ratio = helper.make_tensor("ratio", onnx.TensorProto.FLOAT, [], [0.5])
    default = helper.make_tensor("training", onnx.TensorProto.BOOL, [], [False])
    node = helper.make_node("Dropout", ["x", "ratio", "training"], ["y"], name="drop")
    # a plain input, and an input whose initializer is only an overridable default
    for initializers in ([ratio], [ratio, default]):
        graph = helper.make_graph([node], "g", [x, mode_in], [y], initializer=initializers)
        onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
        [problem] = _random_nodes(tmp_path / "m.onnx")
        assert problem.startswith("active Dropout at node 'drop'")
        assert "training_mode is computed at run time" in problem
