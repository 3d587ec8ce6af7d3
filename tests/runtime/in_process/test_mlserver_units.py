"""The runtime's request checks and batcher, in-process (issue 16: the HTTP tests reach the
runtime in a server process, which mutation testing cannot attribute). The requests are
real Open Inference Protocol objects (mlserver.types), the graph a real ONNX Runtime
session over a small ONNX model built here; the batcher runs on a real event loop."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from mlserver.types import InferenceRequest
from onnx import TensorProto, helper

from shipyard_runtime import mlserver as rt
from shipyard_runtime import session as rt_session
from shipyard_runtime.mlserver import Batcher, QueueFull, TimedOut, decode


def tensor(name: str, shape: list[Any], data: Any, datatype: str = "FP32") -> Any:
    request = InferenceRequest.model_validate(
        {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]}
    )
    return request.inputs[0]


def bad(inp: Any) -> str:
    with pytest.raises(rt.BadRequest) as exc:
        decode(inp)
    assert exc.value.status_code == 400
    return str(exc.value)


# --------------------------------------------------------------------------- decode
def test_a_tensor_that_fills_its_shape_decodes_exactly() -> None:
    array = decode(tensor("x", [2, 3], [[1, 2, 3], [4, 5, 6]], "INT64"))
    assert array.dtype == np.int64 and array.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert decode(tensor("x", [1, 2], [0.5, 1], "FP32")).tolist() == [[0.5, 1.0]]
    assert decode(tensor("m", [2], [True, 0], "BOOL")).tolist() == [True, False]
    assert decode(tensor("e", [0, 3], [], "FP32")).shape == (0, 3)


@pytest.mark.parametrize(
    ("shape", "data", "datatype", "message"),
    [
        ([], [1], "FP32", "input 'x': a 0-d tensor; send shape [batch, ...]"),
        ([2, -1], [1, 2], "FP32", "input 'x': shape [2, -1] must be non-negative integers"),
        ([2], ["a", "b"], "BYTES", "input 'x': BYTES is not accepted here; send numbers"),
        ([2, 2], [1, 2, 3], "FP32", "input 'x': 3 values do not fill shape [2, 2] (4 needed)"),
        ([2], [1, 2, 3], "FP32", "input 'x': 3 values do not fill shape [2] (2 needed)"),
        ([2], [1, 1.7], "INT64", "input 'x': INT64 needs integers; found a non-integer value"),
        ([2], [1, True], "INT32", "input 'x': INT32 needs integers; found a non-integer value"),
        ([1], ["yes"], "BOOL", "input 'x': BOOL needs true/false values"),
        ([2], [1.0, True], "FP32", "input 'x': FP32 needs numbers"),
        ([1], ["1"], "FP16", "input 'x': FP16 needs numbers"),
    ],
)
def test_each_malformed_tensor_is_refused_with_its_reason(
    shape: list[Any], data: Any, datatype: str, message: str
) -> None:
    assert bad(tensor("x", shape, data, datatype)) == message


def test_the_element_cap_holds_at_its_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rt, "MAX_ELEMENTS", 6)
    assert decode(tensor("x", [2, 3], [1] * 6, "INT64")).shape == (2, 3)
    assert bad(tensor("x", [7], [1] * 7, "INT64")) == "input 'x': 7 elements is beyond 6"
    # a flood of values stops being read past the cap: still refused by count
    assert bad(tensor("x", [6], [1] * 50, "INT64")).startswith("input 'x': 7 values do not")


def test_values_that_do_not_fit_the_datatype_are_refused() -> None:
    message = bad(tensor("x", [1], [300], "INT8"))
    assert message.startswith("input 'x': cannot decode as INT8 [1]: ")


def test_flat_reads_nested_lists_in_order() -> None:
    assert rt._flat([[1, [2, 3]], (4,), 5]) == [1, 2, 3, 4, 5]
    assert rt._flat(7) == [7]


# --------------------------------------------------------------------------- graph inputs
def graph(path: Path) -> Path:
    """y = sum(x * m) over the last two axes: x float [batch, 4, 8], m int64 [batch, 4, 8]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])
    m = helper.make_tensor_value_info("m", TensorProto.INT64, ["batch", 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])
    nodes = [
        helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "mf"], ["p"]),
        helper.make_node("ReduceSum", ["p", "axes"], ["y"], keepdims=0),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x, m], [y], [axes]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 9
    onnx.save(model, path)
    return path


@pytest.fixture
def runtime(tmp_path: Path) -> Any:
    """The runtime as load() leaves it for a tensors model, on a real session."""
    model = rt.ShipyardOnnxRuntime.__new__(rt.ShipyardOnnxRuntime)
    model.session = rt.session_from(graph(tmp_path / "g.onnx"), {})
    model.serving, model.task, model.labels = "tensors", "generic", []
    model.max_request_rows = 3
    model.bounds = {}
    return model


def request(**inputs: tuple[list[Any], Any, str]) -> InferenceRequest:
    return InferenceRequest.model_validate(
        {
            "inputs": [
                {"name": n, "shape": s, "data": d, "datatype": t} for n, (s, d, t) in inputs.items()
            ]
        }
    )


def rows(batch: int, cols: int = 8, datatype: str = "FP32") -> tuple[list[Any], Any, str]:
    return ([batch, 4, cols], [1] * (batch * 4 * cols), datatype)


def refused(runtime: Any, payload: InferenceRequest) -> str:
    with pytest.raises(rt.BadRequest) as exc:
        runtime._graph_inputs(payload)
    return str(exc.value)


def test_exactly_the_graph_inputs_at_a_served_batch_are_accepted(runtime: Any) -> None:
    for batch in (1, 3):  # both ends of [1, max_batch_size]
        feeds = runtime._graph_inputs(request(x=rows(batch), m=rows(batch, datatype="INT64")))
        assert sorted(feeds) == ["m", "x"] and feeds["x"].shape == (batch, 4, 8)
        assert feeds["m"].dtype == np.int64


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"x": rows(1)}, "inputs must be exactly ['m', 'x']; got ['x']"),
        (
            {"x": rows(1), "m": rows(1, datatype="INT64"), "z": rows(1)},
            "inputs must be exactly ['m', 'x']; got ['x', 'm', 'z']",
        ),
        ({"x": rows(1), "m": rows(1)}, "input 'm' must be INT64; got FP32"),
        (
            {"x": ([1, 32], [1] * 32, "FP32"), "m": rows(1, datatype="INT64")},
            "input 'x' must have 3 axes ['batch', 4, 8]; got shape [1, 32]",
        ),
        (
            {"x": rows(1, cols=9), "m": rows(1, datatype="INT64")},
            "input 'x' axis 2 must be 8; got 9",
        ),
        (
            {"x": rows(2), "m": rows(1, datatype="INT64")},
            "inputs disagree on the batch size: [1, 2]",
        ),
        (
            {"x": rows(4), "m": rows(4, datatype="INT64")},
            "batch 4 is outside [1, 3] (the served max_batch_size)",
        ),
        (
            {"x": rows(0), "m": rows(0, datatype="INT64")},
            "batch 0 is outside [1, 3] (the served max_batch_size)",
        ),
    ],
)
def test_each_wrong_request_is_refused_naming_the_input(
    runtime: Any, inputs: dict[str, Any], message: str
) -> None:
    assert refused(runtime, request(**inputs)) == message


def test_an_integer_input_is_refused_just_past_its_bounds_and_served_at_them(
    runtime: Any,
) -> None:
    runtime.bounds = {"m": (0, 2)}

    def m_with(value: int) -> InferenceRequest:
        data = [1] * 31 + [value]
        return request(x=rows(1), m=([1, 4, 8], data, "INT64"))

    for value in (0, 1):
        assert runtime._graph_inputs(m_with(value))["m"].max() == 1
    assert refused(runtime, m_with(2)) == "input 'm': values must lie in [0, 2); found 2"
    assert refused(runtime, m_with(-1)) == "input 'm': values must lie in [0, 2); found -1"
    runtime.bounds = {}  # an input without bounds takes any integer
    assert runtime._graph_inputs(m_with(7))["m"].max() == 7


def test_a_repeated_input_name_is_refused(runtime: Any) -> None:
    payload = InferenceRequest.model_validate(
        {
            "inputs": [
                {"name": "x", "shape": [1, 4, 8], "datatype": "FP32", "data": [1] * 32},
                {"name": "x", "shape": [1, 4, 8], "datatype": "FP32", "data": [1] * 32},
            ]
        }
    )
    assert refused(runtime, payload).startswith("inputs must be exactly ['m', 'x']")


def test_a_batch_runs_the_graph_and_labels_name_the_top_class(runtime: Any) -> None:
    feeds = {"x": np.ones((2, 4, 8), np.float32), "m": np.ones((2, 4, 8), np.int64)}
    assert runtime._run_batch(None, feeds)["y"].tolist() == [32.0, 32.0]
    scores = rt.label_scores(np.array([[1.0, 3.0], [2.0, 0.0]]), ["neg", "pos"])
    assert scores["label"].tolist() == ["pos", "neg"]
    assert np.allclose(scores["score"], [1 / (1 + np.exp(-2))] * 2)
    assert rt.label_scores(np.zeros((1, 3)), [])["label"].tolist() == ["LABEL_0"]
    with pytest.raises(RuntimeError, match="2 labels for 3 scores"):
        rt.label_scores(np.zeros((1, 3)), ["a", "b"])


# --------------------------------------------------------------------------- generation
@pytest.fixture
def generator(runtime: Any, tmp_path: Path) -> Any:
    """The runtime as load() leaves it for a causal LM: an engine over next_token_lm (vocab
    50), the export's limits past 10 and context 12, served batch 2."""
    from shipyard_runtime.generation.core import Engine, EngineSettings, Graph
    from shipyard_runtime.settings import BatchingSettings, RuntimeSettings

    session = rt.session_from(next_token_lm(tmp_path / "lm.onnx", vocab=50), {})
    settings = EngineSettings(max_rows=2, max_context=12, chunk=8, max_past=10, kv_budget_tokens=48)
    runtime.serving, runtime.task, runtime.text = "generate", "causal-lm", None
    runtime.max_request_rows = 2
    runtime.config = RuntimeSettings(
        task="causal-lm",
        serving="generate",
        ort_session="ort_session.json",
        batching=BatchingSettings(
            max_rows=2, enabled=True, delay_s=0, instances=1, max_queue=0, timeout_s=0
        ),
        engine=settings,
    )
    runtime.engine = Engine(Graph(session), settings)
    yield runtime
    runtime.engine.close()


def gen(
    ids: list[list[int]], datatype: str = "INT64", name: str = "input_ids", **params: Any
) -> InferenceRequest:
    shape = [len(ids), len(ids[0]) if ids else 0]
    body: dict[str, Any] = {
        "inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": ids}]
    }
    if params:
        body["parameters"] = params
    return InferenceRequest.model_validate(body)


def gen_refused(generator: Any, payload: InferenceRequest) -> str:
    with pytest.raises(rt.BadRequest) as exc:
        run_loop(generator._generation_args(payload))
    return str(exc.value)


def test_a_generation_request_at_every_limit_is_accepted(generator: Any) -> None:
    prompts, params = run_loop(
        generator._generation_args(gen([[0] * 8, [49] * 8], max_new_tokens=4))
    )
    assert prompts == [[0] * 8, [49] * 8] and params.max_tokens == 4  # past 8 + 4 - 2 = 10
    assert params.temperature == 0  # V2 decodes greedily unless asked
    prompts, params = run_loop(generator._generation_args(gen([[1]], datatype="INT32")))
    assert params.max_tokens == 1 and prompts == [[1]]
    # a prompt beyond sequence.max (8) is prefilled in chunks: only past and context bind
    args = run_loop(generator._generation_args(gen([[1] * 11], max_new_tokens=1)))
    assert args[1].max_tokens == 1


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            gen([[1]], name="tokens"),
            "causal-lm expects exactly one input 'input_ids' (or 'text'); got ['tokens']",
        ),
        (gen([[1]], datatype="FP32"), "input_ids must be INT64 (or INT32); got FP32"),
        (gen([[1]], max_new_tokens="3"), "max_new_tokens must be an integer; got '3'"),
        (gen([[1]], max_new_tokens=True), "max_new_tokens must be an integer; got True"),
        (gen([[1]], max_new_tokens=0), "max_new_tokens must be at least 1"),
        (gen([[1]], max_new_tokens=2, max_tokens=2), "give max_new_tokens or max_tokens"),
        (gen([[]]), "input_ids shape [1, 0]: send at least one row of one token"),
        (gen([[1], [1], [1]]), "batch 3 is outside [1, 2] (the served max_batch_size)"),
        (
            gen([[1] * 8], max_new_tokens=5),
            "prompt 8 + max_tokens 5 needs a past of 11 tokens; the export's past_sequence "
            "max is 10",
        ),
        (gen([[50]]), "token ids must lie in [0, 50) (the vocabulary)"),
        (gen([[-1]]), "token ids must lie in [0, 50) (the vocabulary)"),
        (gen([[1]], temperature=-1), "parameter 'temperature': Input should be greater"),
        (gen([[1]], top_p=0), "parameter 'top_p': Input should be greater than 0"),
        (gen([[1]], beam_width=4), "unknown parameter 'beam_width'; known: max_tokens"),
        (gen([[1]], stop=["x"]), "stop strings need the model's tokenizer"),
        (gen([[1]], seed=-3), "parameter 'seed'"),
    ],
)
def test_each_wrong_generation_request_is_refused(
    generator: Any, payload: InferenceRequest, message: str
) -> None:
    assert gen_refused(generator, payload).startswith(message)


def test_the_served_context_is_checked_beyond_the_export_limits(generator: Any) -> None:
    from shipyard_runtime.generation.core import Engine, EngineSettings

    generator.engine.close()
    wide = EngineSettings(max_rows=2, max_context=12, chunk=8, max_past=100, kv_budget_tokens=48)
    generator.engine = Engine(generator.engine.graph, wide)
    assert gen_refused(generator, gen([[1] * 6], max_new_tokens=8)) == (
        "prompt 6 + max_tokens 8 - 1 exceeds the served context 12"
    )
    three_axes = InferenceRequest.model_validate(
        {"inputs": [{"name": "input_ids", "shape": [1, 1, 2], "datatype": "INT64", "data": [1, 2]}]}
    )
    assert (
        gen_refused(generator, three_axes)
        == "input_ids must be [batch, prompt]; got shape [1, 1, 2]"
    )


def test_a_generation_request_through_predict_returns_ids_and_finish_reasons(
    generator: Any,
) -> None:
    """next_token_lm's greedy next token is the last id + 1: two rows of one request."""
    from mlserver.settings import ModelSettings

    generator._settings = ModelSettings(name="lm", implementation=rt.ShipyardOnnxRuntime)
    out = run_loop(generator.predict(gen([[3, 4], [40, 41]], max_new_tokens=3)))
    ids = next(o for o in out.outputs if o.name == "output_ids")
    assert ids.shape == [2, 3] and ids.data.root == [5, 6, 7, 42, 43, 44]
    reasons = next(o for o in out.outputs if o.name == "finish_reason")
    assert reasons.data.root == [b"length", b"length"]  # BYTES; JSON carries the strings


# --------------------------------------------------------------------------- batcher
def run_loop(coro: Any) -> Any:
    return asyncio.run(coro)


def test_compatible_requests_merge_up_to_max_rows_and_get_their_own_rows() -> None:
    batches: list[tuple[Any, int]] = []

    def run(key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batches.append((key, len(feeds["x"])))
        return {"y": feeds["x"] * 10}

    async def go() -> list[Any]:
        b = Batcher(run, max_rows=3, delay=0.05)
        parts = [np.full((1, 2), i, np.float32) for i in range(4)] + [np.full((2, 2), 9.0)]
        results = await asyncio.gather(
            *(b.submit("k", {"x": p}) for p in parts[:4]), b.submit("other", {"x": parts[4]})
        )
        assert b.waiting == 0 and b.pending == {} and b.due == set()
        return [r["y"].tolist() for r in results]

    out = run_loop(go())
    assert out == [[[0, 0]], [[10, 10]], [[20, 20]], [[30, 30]], [[90, 90], [90, 90]]]
    # 3 rows at once (full), the 4th in the next batch; the other key never merged in
    assert sorted(batches, key=str) == sorted([("k", 3), ("k", 1), ("other", 2)], key=str)


def test_a_batch_is_due_at_its_delay_not_before() -> None:
    async def go() -> float:
        b = Batcher(lambda key, f: {"y": f["x"]}, max_rows=8, delay=0.2)
        start = time.perf_counter()
        await b.submit("k", {"x": np.ones((1, 1))})
        return time.perf_counter() - start

    assert 0.18 <= run_loop(go()) < 1.5


def test_a_full_queue_refuses_at_once_and_a_slow_request_times_out() -> None:
    async def go() -> tuple[str, str, int]:
        def run(key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            time.sleep(0.3)
            return {"y": feeds["x"]}

        b = Batcher(run, max_rows=1, delay=0.0, max_queue=2, timeout=0.1)
        first = asyncio.ensure_future(b.submit("a", {"x": np.ones((1, 1))}))
        second = asyncio.ensure_future(b.submit("b", {"x": np.ones((1, 1))}))
        await asyncio.sleep(0)
        full = ""
        try:
            await b.submit("c", {"x": np.ones((1, 1))})
        except QueueFull as exc:
            full = f"{exc.status_code} {exc}"
        timed = ""
        try:
            await second
        except TimedOut as exc:
            timed = f"{exc.status_code} {exc}"
        with contextlib.suppress(TimedOut):  # it may start in time or not: either is fine
            await first
        await asyncio.sleep(0.4)
        return full, timed, b.waiting

    full, timed, waiting = run_loop(go())
    assert full == "503 queue full: 2 requests waiting (max_queue_depth 2); retry later"
    assert timed == "504 request timed out after 0.1 s (request_timeout_seconds)"
    assert waiting == 0


def test_a_failed_run_answers_every_request_of_its_batch_at_once() -> None:
    def run(key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ValueError("graph failed")

    async def go() -> list[str]:
        b = Batcher(run, max_rows=2, delay=0.01, timeout=5)
        start = time.perf_counter()
        results = await asyncio.gather(
            b.submit("k", {"x": np.ones((1, 1))}),
            b.submit("k", {"x": np.ones((1, 1))}),
            return_exceptions=True,
        )
        assert time.perf_counter() - start < 2
        return [repr(r) for r in results]

    assert run_loop(go()) == ["ValueError('graph failed')"] * 2


# --------------------------------------------------------------------------- sessions
def test_the_session_takes_every_option_of_ort_session_json(tmp_path: Path) -> None:
    path = graph(tmp_path / "g.onnx")
    default = rt.session_from(path, {}).get_session_options()
    assert default.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert (default.intra_op_num_threads, default.inter_op_num_threads) == (0, 0)
    assert default.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    for level, want in rt_session.LEVELS.items():
        config = {
            "session_options": {
                "graph_optimization_level": level,
                "intra_op_num_threads": 2,
                "inter_op_num_threads": 3,
                "execution_mode": "parallel",
            },
            "providers": ["CPUExecutionProvider"],
        }
        session = rt.session_from(path, config)
        options = session.get_session_options()
        assert options.graph_optimization_level == want, level
        assert (options.intra_op_num_threads, options.inter_op_num_threads) == (2, 3)
        assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
        assert session.get_providers() == ["CPUExecutionProvider"]


# --------------------------------------------------------------------------- labels
def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_label_scores_equal_a_softmax_over_the_last_axis_for_any_row() -> None:
    z = np.array([[[0.0, 5.0, 1.0], [9.0, 0.0, 2.0]], [[-1000.0, -999.0, -998.0], [3, 2, 1]]])
    out = rt.label_scores(z, [])  # default names: one per score
    want = softmax(z)
    assert out["label"].tolist() == [["LABEL_1", "LABEL_0"], ["LABEL_2", "LABEL_0"]]
    assert np.allclose(out["score"], want.max(axis=-1), atol=1e-6)
    assert not np.isnan(out["score"]).any()  # rows far below the others stay finite


def test_label_scores_are_stable_softmax_per_row_and_per_token() -> None:
    big = rt.label_scores(np.array([[1000.0, 1001.0]], dtype=np.float32), ["a", "b"])
    assert big["label"].tolist() == ["b"]
    assert big["score"].dtype == np.float32
    assert abs(float(big["score"][0]) - 1 / (1 + np.exp(-1))) < 1e-6
    tokens = rt.label_scores(np.array([[[0.0, 5.0, 0.0], [9.0, 0.0, 0.0]]]), ["x", "y", "z"])
    assert tokens["label"].tolist() == [["y", "x"]] and tokens["score"].shape == (1, 2)
    tiny = np.array([[0.0, 1e-3]])  # float64 keeps the difference float16 would lose
    assert rt.label_scores(tiny, ["a", "b"])["label"].tolist() == ["b"]


def test_a_labels_model_answers_names_and_scores(runtime: Any, tmp_path: Path) -> None:
    runtime.serving, runtime.labels = "labels", ["low", "high"]
    feeds = {"x": np.ones((2, 4, 8), np.float32), "m": np.ones((2, 4, 8), np.int64)}
    runtime.session = rt.session_from(two_scores(tmp_path / "labels.onnx"), {})
    out = runtime._run_batch(None, feeds)
    assert sorted(out) == ["label", "score", "y"]
    assert out["label"].tolist() == ["high", "high"]


def two_scores(path: Path) -> Path:
    """y = [sum(x*m), 2*sum(x*m)] per row: two class scores, the second always higher."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])
    m = helper.make_tensor_value_info("m", TensorProto.INT64, ["batch", 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [1, 2], [1.0, 2.0])
    nodes = [
        helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "mf"], ["p"]),
        helper.make_node("ReduceSum", ["p", "axes"], ["s"], keepdims=0),
        helper.make_node("Unsqueeze", ["s", "one"], ["s1"]),
        helper.make_node("Mul", ["s1", "scale"], ["y"]),
    ]
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    model = helper.make_model(
        helper.make_graph(nodes, "labels", [x, m], [y], [axes, scale, one]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 9
    onnx.save(model, path)
    return path


# --------------------------------------------------------------------------- generation
def next_token_lm(
    path: Path, vocab: int = 16, cache: int = TensorProto.FLOAT, named_vocab: bool = False
) -> Path:
    """A causal LM with a KV cache whose greedy next token is (last id + 1 + offset) % vocab,
    where offset = mask length - past length - new tokens (0 when the mask is right):
    logits = one_hot(ids + offset + 1), present = past + the new positions."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])
    past = [
        helper.make_tensor_value_info(f"past_key_values.0.{k}", cache, ["batch", 1, "past", 2])
        for k in ("key", "value")
    ]
    last = "vocab" if named_vocab else vocab
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", last])
    present = [
        helper.make_tensor_value_info(f"present.0.{k}", cache, ["batch", 1, "total", 2])
        for k in ("key", "value")
    ]
    table = np.roll(np.eye(vocab, dtype=np.float32), 1, axis=1)  # row i: one-hot of i + 1
    inits = [
        onnx.numpy_helper.from_array(table, "table"),
        helper.make_tensor("axes", TensorProto.INT64, [2], [1, 3]),
        helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        helper.make_tensor("two", TensorProto.INT64, [1], [2]),
        helper.make_tensor("n", TensorProto.INT64, [], [vocab]),
    ]
    nodes = [
        helper.make_node("Shape", ["attention_mask"], ["ms"]),
        helper.make_node("Gather", ["ms", "one"], ["total"]),
        helper.make_node("Shape", ["past_key_values.0.key"], ["ps"]),
        helper.make_node("Gather", ["ps", "two"], ["plen"]),
        helper.make_node("Shape", ["input_ids"], ["is"]),
        helper.make_node("Gather", ["is", "one"], ["slen"]),
        helper.make_node("Sub", ["total", "plen"], ["t1"]),
        helper.make_node("Sub", ["t1", "slen"], ["offset"]),
        helper.make_node("Add", ["input_ids", "offset"], ["shifted"]),
        helper.make_node("Mod", ["shifted", "n"], ["wrapped"]),
        helper.make_node("Gather", ["table", "wrapped"], ["logits"], axis=0),
        helper.make_node("Cast", ["input_ids"], ["f"], to=cache),
        helper.make_node("Unsqueeze", ["f", "axes"], ["f4"]),  # [batch, 1, sequence, 1]
        helper.make_node("Concat", ["f4", "f4"], ["new"], axis=3),
        helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "new"], ["present.0.value"], axis=2),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "lm", [ids, mask, *past], [logits, *present], inits),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 9
    onnx.save(model, path)
    return path


def greedy(session: Any, prompt: list[int], tokens: int, **limits: int) -> list[int]:
    """The engine's greedy tokens for one prompt, waited for here."""
    import queue

    from shipyard_runtime.generation.core import Engine, EngineSettings, Graph
    from shipyard_runtime.generation.params import parse

    settings = {"max_rows": 2, "max_context": 64, "chunk": 8, "max_past": 64}
    settings |= {"kv_budget_tokens": 256, **limits}
    engine = Engine(Graph(session), EngineSettings(**settings))
    events: queue.Queue[Any] = queue.Queue()
    try:
        engine.submit(prompt, parse({"max_tokens": tokens, "temperature": 0}), events.put)
        out = []
        while not out or not out[-1].finish:
            out.append(events.get(timeout=10))
            assert out[-1].error is None, out[-1].error
    finally:
        engine.close()
    return [e.token for e in out]


def test_a_float16_cache_is_fed_in_float16(tmp_path: Path) -> None:
    from shipyard_runtime.generation.runner import Graph

    path = next_token_lm(tmp_path / "lm16.onnx", cache=TensorProto.FLOAT16, named_vocab=True)
    graph = Graph(rt.session_from(path, {}))
    # a declared symbolic vocabulary that ONNX Runtime cannot infer stays unknown (0); here
    # it infers 16 from the table, so the declared name does not hide the size
    assert graph.dtype == np.float16 and graph.vocab == 16
    assert graph.bytes_per_token == 2 * 1 * 2 * 2  # key + value, 1 head, dim 2, 2 bytes
    assert greedy(rt.session_from(path, {}), [1], 2) == [2, 3]


def test_greedy_decoding_feeds_the_cache_and_generates_each_step(tmp_path: Path) -> None:
    from shipyard_runtime.generation.runner import Graph

    session = rt.session_from(next_token_lm(tmp_path / "lm.onnx"), {})
    graph = Graph(session)
    assert graph.vocab == 16 and graph.dtype == np.float32
    assert graph.spec == [("past_key_values.0.key", 1, 2), ("past_key_values.0.value", 1, 2)]
    assert graph.presents == ["present.0.key", "present.0.value"]
    assert greedy(session, [3, 4], 3) == [5, 6, 7]
    assert greedy(session, [14, 15], 3) == [0, 1, 2]  # wraps at the vocabulary
    # a prompt longer than a prefill chunk (8) is prefilled in two, then decoded
    assert greedy(session, list(range(11)), 2) == [11, 12]


def test_a_full_batch_runs_at_once_without_waiting_for_its_delay() -> None:
    async def go() -> float:
        b = Batcher(lambda k, f: {"y": f["x"]}, max_rows=2, delay=30.0)
        start = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(b.submit("k", {"x": np.ones((1, 1))}) for _ in range(2))), 5
        )
        return time.perf_counter() - start

    assert run_loop(go()) < 2


def test_requests_that_together_exceed_max_rows_go_in_separate_batches() -> None:
    sizes: list[int] = []

    def run(key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sizes.append(len(feeds["x"]))
        return {"y": feeds["x"]}

    async def go() -> None:
        b = Batcher(run, max_rows=3, delay=0.05)
        parts = [np.ones((2, 1)), np.ones((2, 1)), np.ones((1, 1))]
        await asyncio.gather(*(b.submit("k", {"x": p}) for p in parts))

    run_loop(go())
    assert sizes == [2, 3] and max(sizes) <= 3  # 2 alone (2 + 2 > 3), then 2 + 1


def test_by_default_one_instance_runs_and_nothing_times_out() -> None:
    def run(key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.6)
        return {"y": feeds["x"]}

    async def go() -> float:
        b = Batcher(run, max_rows=1, delay=0.0)  # instances=1, timeout=0 (none)
        start = time.perf_counter()
        await asyncio.gather(
            b.submit("a", {"x": np.ones((1, 1))}), b.submit("b", {"x": np.ones((1, 1))})
        )
        return time.perf_counter() - start

    elapsed = run_loop(go())
    assert elapsed >= 1.15  # two runs one after the other; 1.2 s > any 1 s default timeout


def test_position_ids_are_derived_from_the_mask_as_the_pipeline_derives_them() -> None:
    """The engine ships alone, so it has its own copy of the rule; both give the same
    numbers on any mask (left-padded rows included)."""
    from hypothesis import given
    from hypothesis import strategies as st

    from shipyard_runtime.generation import kv as ekv
    from stages.onnx import shapes as sh

    @given(
        st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=12), min_size=1, max_size=4),
        st.data(),
    )
    def agree(rows: list[list[int]], data: Any) -> None:
        width = min(len(r) for r in rows)
        mask = np.array([r[:width] for r in rows], dtype=np.int64)
        last = data.draw(st.integers(1, width))
        assert (ekv.positions_from_mask(mask, last) == sh.positions_from_mask(mask, last)).all()

    agree()
    mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1]])
    assert ekv.positions_from_mask(mask, 4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    assert ekv.positions_from_mask(mask, 1).tolist() == [[3], [1]]


def test_a_graph_with_position_ids_is_fed_them_at_every_step() -> None:
    fed: list[dict[str, np.ndarray]] = []

    class Port:
        def __init__(self, name: str, shape: list[Any]) -> None:
            self.name, self.shape, self.type = name, shape, "tensor(float)"

    class Session:
        def get_inputs(self) -> list[Port]:
            return [
                Port("input_ids", ["b", "s"]),
                Port("attention_mask", ["b", "t"]),
                Port("position_ids", ["b", "s"]),
                Port("past_key_values.0.key", ["b", 1, "p", 2]),
            ]

        def get_outputs(self) -> list[Port]:
            return [Port("logits", ["b", "s", 16]), Port("present.0.key", ["b", 1, "t", 2])]

        def get_modelmeta(self) -> Any:
            """As ONNX Runtime's: no metadata (a traced graph, left-padded rows)."""
            return type("Meta", (), {"custom_metadata_map": {}})()

        def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            fed.append(dict(feeds))
            batch, n = feeds["input_ids"].shape
            past = feeds["past_key_values.0.key"].shape[2]
            return [np.zeros((batch, n, 16), np.float32), np.zeros((batch, 1, past + n, 2))]

    greedy(Session(), [7, 8, 9], 3)
    assert [f["position_ids"].tolist() for f in fed] == [[[0, 1, 2]], [[3]], [[4]]]


def test_a_bundle_is_served_by_its_own_runtime_copy_or_not_at_all(tmp_path: Path) -> None:
    """The runtime refuses to serve a bundle whose shipped runtime package is not the code
    running (another copy was imported first); a folder shipping none (a test's), or the
    same package through a link, is served."""
    package = Path(rt.__file__).resolve().parent
    assert rt.foreign_runtime(tmp_path) is None
    import shutil

    shutil.copytree(package, tmp_path / "copy" / "shipyard_runtime")
    problem = rt.foreign_runtime(tmp_path / "copy")
    assert problem is not None and str(package) in problem and "imported first" in problem
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "shipyard_runtime").symlink_to(package)
    assert rt.foreign_runtime(tmp_path / "linked") is None
    # a copy whose files are links into a cache (DVC's symlink cache type) is another
    # folder: refused when the code runs from elsewhere ...
    cached = tmp_path / "cached" / "shipyard_runtime"
    for source in package.rglob("*.py"):
        (cached / source.relative_to(package)).parent.mkdir(parents=True, exist_ok=True)
        (cached / source.relative_to(package)).symlink_to(source)
    assert rt.foreign_runtime(tmp_path / "cached") is not None
    # ... and served when the runtime was imported from that folder (its files' targets
    # lie in the cache, the folder is the bundle's)
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path\n"
        "from shipyard_runtime.mlserver import foreign_runtime\n"
        "print(foreign_runtime(Path(sys.argv[1])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cached")], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr
