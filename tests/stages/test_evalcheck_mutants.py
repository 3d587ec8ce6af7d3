"""evalcheck's promises at unit level, beside the trap models of test_check_eval_mode.py:
what the stage depends on, a passing model's verdict, the inputs its checks run on, where
it says randomness entered, the one-thread rerun, and the ONNX graph's random and Dropout
nodes. Fast enough to run per mutant (scripts/mutation.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from schemas.loader import load_release
from stages import evalcheck
from stages._contract import StageIO
from stages.onnx import model as m
from stages.onnx import shapes as sh
from tests.conftest import REPO, Workspace, generic_spec

SMALL_MODULES = 4  # the adapter, the user's model `Small` and its two Linear layers


def test_evalcheck_depends_on_the_exported_graph_and_the_model() -> None:
    release = load_release(REPO / "releases" / "tiny-gpt2.yaml")
    assert evalcheck.io(release) == StageIO(
        params=("model", "task", "export"),
        upstream=("export/model.onnx",),
        reads_model=True,
    )


def build(ws: Workspace, factory: str) -> dict[str, Any]:
    spec = generic_spec(factory, factory)
    for stage in ("pin", "export"):
        assert ws.run(stage, spec).status.value == "passed"
    return spec


def test_a_model_in_eval_mode_passes_with_its_module_count(ws: Workspace) -> None:
    report = ws.run("evalcheck", build(ws, "small"))
    assert report.status.value == "passed", report.reasons
    assert report.summary == (
        f"{SMALL_MODULES} modules in eval mode, two forward passes bit-identical in PyTorch "
        "and ONNX Runtime, no active random ops in the graph"
    )
    assert report.metrics == {"modules": SMALL_MODULES}


def test_the_checks_run_on_the_inputs_export_traced_with(ws: Workspace) -> None:
    """The kept evidence is the trace input of export (seed 0 at the trace sizes), so a
    failure reproduces from the spec alone."""
    spec = build(ws, "trains_in_forward")
    assert ws.run("evalcheck", spec).status.value == "failed"
    release = ws.spec(spec)
    _, lay = m.load_with_layout(ws.root, release)
    expected = sh.make_inputs(lay, sh.trace_sizes(release.export.dims), seed=0)
    kept = ws.root / "build" / spec["name"] / "failed" / "evalcheck" / "failed_inputs.npz"
    with np.load(kept) as data:
        assert data.files == list(expected)
        for name, value in expected.items():
            assert np.array_equal(data[name], value)


def test_the_first_ten_modules_in_training_mode_are_named() -> None:
    import torch

    flat = torch.nn.Module()
    flat.model = torch.nn.Sequential(*(torch.nn.Identity() for _ in range(12)))
    flat.train()
    [problem] = evalcheck._training_modules(flat, "at some point")
    assert problem == (
        "module(s) in training mode at some point: model, 0, 1, 2, 3, 4, 5, 6, 7, 8; a module "
        "that overrides train()/eval() or sets self.training must not do so at inference"
    )
    flat.eval()
    assert evalcheck._training_modules(flat, "at some point") == []


class Fake:
    """Stands for the adapter: only its model's class name is read."""

    class Root:
        pass

    model = Root()


def scripted(
    monkeypatch: pytest.MonkeyPatch, modules: list[tuple[str, Any, Any]], *, threaded: bool
) -> list[int]:
    """m.traced_run replaced: each run records `modules` (name, input, output); a value of
    None is the run's seed, so the two runs differ there. With `threaded`, they differ only
    while PyTorch uses more than one thread. Returns the thread counts the runs saw."""
    import torch

    seen: list[int] = []

    def traced_run(flat: Any, lay: Any, feeds: Any) -> tuple[list[Any], list[Any]]:
        threads = torch.get_num_threads()
        seen.append(threads)
        noise = float(torch.initial_seed()) if (threads > 1 or not threaded) else 0.0

        def value(v: Any) -> Any:
            return np.array([noise]) if v is None else np.array([v])

        mods = [(n, None if i == "none" else value(i), value(o), []) for n, i, o in modules]
        return [mods[-1][2]], mods

    monkeypatch.setattr(m, "traced_run", traced_run)
    return seen


def test_randomness_between_two_children_is_blamed_on_their_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted(
        monkeypatch,
        [("outer.block.a", 1, 2), ("outer.block.b", None, None), ("head", None, None)],
        threaded=False,
    )
    assert evalcheck._nondeterministic_modules(Fake(), None, {}) == [
        "two forward passes on the same input differ; randomness enters in module "
        "'outer.block', between 'outer.block.a' and 'outer.block.b' (dropout or sampling "
        "active at inference?)"
    ]


def test_randomness_before_the_first_module_is_blamed_on_the_root_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted(monkeypatch, [("first", None, None), ("second", None, None)], threaded=False)
    assert evalcheck._nondeterministic_modules(Fake(), None, {}) == [
        "two forward passes on the same input differ; randomness enters in the forward of "
        "the root module Root (dropout or sampling active at inference?)"
    ]
    scripted(monkeypatch, [("a", 1, 1), ("b", "none", None)], threaded=False)
    assert (
        "enters in the forward of the root module Root, between 'a' and 'b' ("
        in (evalcheck._nondeterministic_modules(Fake(), None, {})[0])
    )


def test_runs_that_differ_only_on_several_threads_are_rerun_on_one() -> None:
    import torch

    monkeypatch = pytest.MonkeyPatch()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = scripted(monkeypatch, [("a", 1, None)], threaded=True)
        assert evalcheck._nondeterministic_modules(Fake(), None, {}) == []
        assert seen == [2, 2, 1, 1]
        assert torch.get_num_threads() == 2  # restored
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads)


def save(tmp_path: Any, nodes: list[Any], initializers: list[Any]) -> Any:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=initializers)
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
    return tmp_path / "m.onnx"


def test_a_random_node_without_a_name_or_scope_is_named_by_its_op(tmp_path: Any) -> None:
    node = helper.make_node("RandomUniformLike", ["x"], ["y"])
    assert evalcheck._random_nodes(save(tmp_path, [node], [])) == [
        "random op RandomUniformLike at node 'RandomUniformLike' (from unknown): inference "
        "must be deterministic"
    ]


def test_an_active_dropout_says_its_training_mode_is_true(tmp_path: Any) -> None:
    ratio = helper.make_tensor("ratio", onnx.TensorProto.FLOAT, [], [0.5])
    mode = helper.make_tensor("mode", onnx.TensorProto.BOOL, [], [True])
    node = helper.make_node("Dropout", ["x", "ratio", "mode"], ["y"], name="/model/drop/Dropout")
    assert evalcheck._random_nodes(save(tmp_path, [node], [ratio, mode])) == [
        "active Dropout at node '/model/drop/Dropout' (from drop): training_mode is true"
    ]


def test_a_dropout_without_training_mode_and_other_three_input_ops_are_inert(
    tmp_path: Any,
) -> None:
    ratio = helper.make_tensor("ratio", onnx.TensorProto.FLOAT, [], [0.5])
    low = helper.make_tensor("low", onnx.TensorProto.FLOAT, [], [-1.0])
    high = helper.make_tensor("high", onnx.TensorProto.FLOAT, [], [1.0])
    dropout = helper.make_node("Dropout", ["x", "ratio"], ["d"], name="drop")
    clip = helper.make_node("Clip", ["d", "low", "high"], ["y"], name="clip")
    assert evalcheck._random_nodes(save(tmp_path, [dropout, clip], [ratio, low, high])) == []
