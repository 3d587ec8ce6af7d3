"""Issue 41: a request's tokens never depend on its neighbours. On the INT8 graph the
quantize stage ships (tiny-gpt2, dynamic INT8 with per-token activation scales; and the
weight-only INT4 and INT8 graphs, whose MatMulNBits kernels quantize each row's activations
alone: `compute: int8`; and a grouped-query Llama's INT8 graph, traced with
stages/onnx/grouped.py), the same
greedy request alone, beside 15 others of mixed lengths and right after a burst gives the
same tokens and the same logprobs to the bit; a seed gives the same text whatever the load;
a cached decode equals a full recompute of the served graph; a sequence that ends frees
its row at once."""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import pytest

from shipyard_runtime.generation.core import Engine, EngineSettings, Event, Graph
from shipyard_runtime.generation.params import parse
from tests.conftest import Workspace, gpt2_spec

ROWS, CONTEXT = 16, 88


def limits(**changes: Any) -> EngineSettings:
    base = {"max_rows": ROWS, "max_context": CONTEXT, "chunk": 64, "max_past": 86}
    return EngineSettings(**{**base, "kv_budget_tokens": ROWS * CONTEXT, **changes})


@pytest.fixture(
    scope="module",
    params=["int8-dynamic", "int4-weight-only", "int8-weight-only", "int8-dynamic-gqa", "fused"],
)
def int8_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    import onnx

    from tests.fixtures.fused import fused_graph
    from tests.stages.test_grouped_attention import llama_spec, llama_workspace

    root = tmp_path_factory.mktemp("engine-int8")
    if request.param == "fused":  # a grouped-query Llama's fused INT4 graph, cache in place
        return fused_graph(root)
    if request.param.endswith("-gqa"):  # a grouped-query Llama: stages/onnx/grouped.py
        ws, spec = llama_workspace(root), llama_spec()
    else:
        ws, spec = Workspace(root), gpt2_spec()
    spec["export"]["dims"]["past_sequence"]["max"] = 86
    spec["export"]["dims"]["batch"]["max"] = ROWS
    method = request.param.removesuffix("-gqa")
    if request.param != "int8-dynamic":  # the rows are the point here, not the accuracy
        spec["quantization"] |= {"method": method, "budget": {"top1_agreement_min": 0.5}}
        spec["evaluation"]["thresholds"] = []
    for stage in ("pin", "export", "quantize"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    path = ws.out(spec["name"], "quantize") / "model.onnx"
    nodes = onnx.load(path, load_external_data=False).graph.node
    if method == "int8-dynamic":
        assert "MatMulInteger" in {n.op_type for n in nodes}  # really the INT8 graph
    else:  # really weight-only, on onnxruntime's int8 kernels
        nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
        assert nbits and all(
            {a.name: a.i for a in n.attribute}["accuracy_level"] == 4 for n in nbits
        )
    return path


@pytest.fixture(scope="module")
def int8(int8_path: Any) -> Graph:
    import onnxruntime as ort

    return Graph(ort.InferenceSession(str(int8_path), providers=["CPUExecutionProvider"]))


class Recorder:
    """The graph, recording the rows and past length of each decode step."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.spec, self.presents, self.positions = graph.spec, graph.presents, graph.positions
        self.in_place = graph.in_place
        self.dtype, self.vocab = graph.dtype, graph.vocab
        self.decodes: list[tuple[int, int]] = []

    def run(self, feeds: dict[str, np.ndarray]) -> Any:
        if feeds["input_ids"].shape[1] == 1:
            self.decodes.append(feeds["attention_mask"].shape)
        return self.graph.run(feeds)


def submit(engine: Engine, prompt: list[int], **params: Any) -> queue.Queue[Event]:
    q: queue.Queue[Event] = queue.Queue()
    engine.submit(prompt, parse(params), q.put)
    return q


def drain(q: queue.Queue[Event]) -> list[Event]:
    out: list[Event] = []
    while not out or not (out[-1].finish or out[-1].error):
        out.append(q.get(timeout=60))
    assert not out[-1].error, out[-1].error
    return out


def answer(events: list[Event]) -> tuple[list[int], list[float | None]]:
    return [e.token for e in events if e.token is not None], [e.logprob for e in events]


PROBE = list(range(300, 317))  # the request judged: 17 tokens
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 3}


def others(rng: np.random.Generator, n: int) -> list[list[int]]:
    return [rng.integers(5, 500, int(rng.integers(1, 60))).tolist() for _ in range(n)]


def test_a_greedy_request_alone_beside_15_others_and_after_a_burst_is_the_same(
    int8: Graph,
) -> None:
    rng = np.random.default_rng(7)
    engine = Engine(int8, limits())
    try:
        alone = drain(submit(engine, PROBE, **GREEDY))
        # beside 15 others of mixed lengths and limits, all arriving with it
        with engine._cv:
            crowd = [
                submit(engine, p, max_tokens=int(rng.integers(1, 28)), temperature=0)
                for p in others(rng, 7)
            ]
            probe = submit(engine, PROBE, **GREEDY)
            crowd += [
                submit(engine, p, max_tokens=int(rng.integers(1, 28)), temperature=0)
                for p in others(rng, 8)
            ]
        beside = drain(probe)
        for q in crowd:
            drain(q)
        # right after a burst of 8 one-token requests prefilled together
        with engine._cv:
            burst = [submit(engine, p, max_tokens=1) for p in others(rng, 8)]
        for q in burst:
            drain(q)
        after = drain(submit(engine, PROBE, **GREEDY))
    finally:
        engine.close()
    assert answer(beside) == answer(alone)
    assert answer(after) == answer(alone)
    assert [e.top for e in beside] == [e.top for e in alone]  # the alternatives too


def test_the_same_seed_gives_the_same_text_whatever_the_load(int8: Graph) -> None:
    rng = np.random.default_rng(11)
    seeded = {"max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "logprobs": 0}
    engine = Engine(int8, limits())
    try:
        quiet = drain(submit(engine, PROBE, **seeded))
        with engine._cv:
            crowd = [submit(engine, p, max_tokens=12, temperature=0.7) for p in others(rng, 12)]
            busy = submit(engine, PROBE, **seeded)
        loaded = drain(busy)
        for q in crowd:
            drain(q)
        other = drain(submit(engine, PROBE, **{**seeded, "seed": 4321}))
    finally:
        engine.close()
    assert answer(loaded) == answer(quiet)
    assert answer(other)[0] != answer(quiet)[0]  # the seed matters


def test_a_cached_decode_equals_a_full_recompute_of_the_served_graph(
    int8: Graph, int8_path: Any
) -> None:
    """Every greedy token the engine decoded through its cache is the argmax of one full
    pass of the shipped graph over the whole sequence (no cache), for prompts that prefill
    in one chunk and in two."""
    import onnxruntime as ort

    from shipyard_runtime.generation.kv import empty_past

    session = ort.InferenceSession(str(int8_path), providers=["CPUExecutionProvider"])
    engine = Engine(int8, limits())
    prompts = [PROBE, list(range(40, 110)), [5, 9, 11]]
    try:
        decoded = [
            answer(drain(submit(engine, p, max_tokens=16, temperature=0, ignore_eos=True)))[0]
            for p in prompts
        ]
    finally:
        engine.close()
    for prompt, tokens in zip(prompts, decoded, strict=True):
        full = np.array([prompt + tokens], np.int64)
        feeds = {"input_ids": full, "attention_mask": np.ones_like(full)}
        feeds |= empty_past(int8.spec, 1, int8.dtype)
        if int8.positions:
            feeds["position_ids"] = np.arange(full.shape[1], dtype=np.int64)[None]
        logits = session.run(["logits"], feeds)[0][0]
        recomputed = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert recomputed == tokens


def test_a_sequence_that_ends_frees_its_row_at_once(int8: Graph) -> None:
    """After a burst of one-token requests (each ends at its first token) and one that ran
    longer, a lone request decodes in a batch of one row holding only its own tokens."""
    recorder = Recorder(int8)
    # in place, the graph runs on the Slots' buffers, not through Recorder.run: each decode
    # step's rows and their lengths are read from the Slots instead
    engine = Engine(int8 if int8.in_place else recorder, limits())  # type: ignore[arg-type]
    steps: list[tuple[int, list[int]]] = []
    decode = engine.runner.decode

    def recorded(last: dict[int, int]) -> Any:
        steps.append((len(engine.batch.keys), [int(n) for n in engine.batch.lengths]))
        return decode(last)

    if int8.in_place:
        engine.runner.decode = recorded  # type: ignore[method-assign]
    rng = np.random.default_rng(5)
    try:
        with engine._cv:
            burst = [submit(engine, p, max_tokens=1) for p in others(rng, 8)]
            long = submit(engine, list(range(100, 160)), max_tokens=6, ignore_eos=True)
        for q in [*burst, long]:
            drain(q)
        recorder.decodes.clear()
        steps.clear()
        drain(submit(engine, PROBE, max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        engine.close()
    if int8.in_place:  # one row, its prompt and tokens so far cached, no other row
        assert steps == [(1, [len(PROBE) + i]) for i in range(4)]
        return
    # each decode step: one row, its prompt and tokens so far (+ the new one), no padding
    assert recorder.decodes == [(1, len(PROBE) + i + 1) for i in range(4)]
